"""The cost of exact KDA rollback: a verify step of a GLM-5.3-Flash-shaped target against the commit after it,
when the whole block is kept (the tip is adopted) and when part of it is (the kept prefix is replayed).

A random target of our own (no checkpoint needed), float32, one thread; medians of interleaved rounds.

    python benchmarks/bench_kda_commit.py [--hidden 512] [--kda-heads 8] [--head-dim 64] [--batch 8] [--block 8]
"""

import argparse
import statistics
import time

import torch

from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.families.glm5_next.model import Glm5NextModel
from verify_worker.families.interface import StepBatch


def random_model(args) -> Glm5NextModel:
    text = {"vocab_size": 1024, "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
            "moe_intermediate_size": args.hidden // 2, "num_hidden_layers": 4, "num_attention_heads": 4,
            "q_lora_rank": args.hidden // 2, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "v_head_dim": 64,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "index_topk": 64, "index_kpool": 4,
            "index_head_dim": 64, "index_n_heads": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "mlp_layer_types": ["dense"] + ["sparse"] * 3, "max_position_embeddings": 4096,
            "linear_attn_config": {"num_heads": args.kda_heads, "head_dim": args.head_dim,
                                   "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}}
    model = Glm5NextModel(Glm5NextConfig.from_dict({"text_config": text}))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            fill = torch.ones if name.endswith("norm.weight") or name.endswith("hc.scale") else None
            tensor.copy_(fill(tensor.shape) if fill else torch.randn(tensor.shape, generator=generator) * 0.05)
    return model.eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--hidden", 512), ("--kda-heads", 8), ("--head-dim", 64), ("--batch", 8),
                          ("--block", 8), ("--context", 256), ("--rounds", 7)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = random_model(args)
    batch, block, context = args.batch, args.block, args.context
    slots = torch.arange(batch)
    state = model.new_state(batch, context + block, block)
    ids = torch.randint(0, 1024, (batch, context + block), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.step(StepBatch(ids[:, :context], torch.arange(context)[None].expand(batch, -1), slots), state)
        model.commit(state, slots, torch.full((batch,), context))
        times = {"verify step": [], "commit, all kept": [], f"commit, {block // 2 - 1} kept (replay)": []}
        positions = torch.arange(context, context + block)[None].expand(batch, -1)
        for _ in range(args.rounds):
            partial = f"commit, {block // 2 - 1} kept (replay)"
            for kept, name in ((block, "commit, all kept"), (block // 2 - 1, partial)):
                started = time.perf_counter()
                model.step(StepBatch(ids[:, context:], positions, slots), state)
                times["verify step"].append(time.perf_counter() - started)
                started = time.perf_counter()
                model.commit(state, slots, torch.full((batch,), kept))
                times[name].append(time.perf_counter() - started)  # (the next block reuses the same positions)
    step = statistics.median(times["verify step"])
    kda = sum(1 for t in model.config.layer_types if t == "linear")
    print(f"KDA commit cost: batch {batch}, block {block}, context {context}, {kda} KDA layers of "
          f"{args.kda_heads} x {args.head_dim}, hidden {args.hidden} (medians of {args.rounds} rounds)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:32s} {median * 1e3:8.2f} ms  ({median / step:5.1%} of the verify step)")


if __name__ == "__main__":
    main()
