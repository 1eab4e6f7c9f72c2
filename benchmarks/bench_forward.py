"""The bare target forward (with its lm_head), as loaded (the checkpoint's modules) against packed for inference
(TargetModel.pack: fused q/k/v and gate/up, the device's fastest weight layout, q and k heads normalized and
rotated together), measured in interleaved rounds in one process; prints medians and ratios. For float32 on
CPU it times both packed layouts: "transposed" (PyTorch's GEMM on [in, out] weights) and "bf16" (the C++
kernel on the checkpoint's bfloat16 weights, the default where it builds), "bf16 per-op", the same
kernels called op by op instead of one call for the whole layer stack (shared/cpu_kernels/decoder_layer.cpp),
"bf16 + bf16 cache" (--dtype auto keeps the KV cache in bfloat16 there), "... N thr", that with the layer stack
and lm_head shared between --kernel-threads threads (worker_pool.h; the same bits), and on a CPU with AMX "amx 1
thr" and "amx N thr", the served default there (bfloat16 products, shared/cpu_kernels/bf16_gemm_amx.cpp).

    python benchmarks/bench_forward.py                         # demo target, float32, 1 thread
    python benchmarks/bench_forward.py --dtype bfloat16 --threads 2
    python benchmarks/bench_forward.py --target path/to/hf_checkpoint --shapes 1x1,1x8,16x1,16x8

Shapes are BATCHxTOKENS: 1x1 is a plain decode step, 1x8 a verify block of 8, 16x8 sixteen verify blocks.
Every row attends over --context cached positions. The two models must give the same greedy tokens; the
largest logit difference is printed too.
"""

import argparse
import statistics
import time

import torch

from shared.demo_models import default_pair
from shared.cpu_kernels.library import cpu_kernels
from shared.packed_linear import packing_layout
from verify_worker.families.llama.backends import KernelLayers
from verify_worker.target_loader import load_target


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target checkpoint folder (default: the embedded demo target)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default="1x1,1x8,16x1,16x8")
    parser.add_argument("--kernel-threads", type=int, default=2,
                        help="threads of the last column's C++ layer stack (1: no such column)")
    parser.add_argument("--context", type=int, default=200, help="cached positions before the new tokens")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="timed forwards per model per round")
    return parser.parse_args(argv)


def time_forward(model, cache, ids, positions, slots, calls: int) -> tuple[float, torch.Tensor]:
    """Median seconds of one forward + logits over `calls` calls, and the last logits."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        logits = model.logits(model(ids, positions, cache, slots, (1,)).hidden)
        times.append(time.perf_counter() - started)
    return statistics.median(times), logits


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.target or default_pair().target
    models = {"as loaded": load_target(folder, dtype=args.dtype, pack=False)}
    default = packing_layout(models["as loaded"].embed_weight)
    layouts = [default] if default in (None, "fused", "transposed") else ["transposed", default]
    for layout in layouts:  # float32 on CPU: PyTorch's GEMM on [in, out] weights, then the default (C++ bf16)
        models[f"packed {layout}"] = load_target(folder, dtype=args.dtype, pack=False).pack(layout)
    if getattr(models[f"packed {layouts[-1]}"], "whole_layers", None) is not None:  # the C++ kernels op by op too
        per_op = load_target(folder, dtype=args.dtype, pack=False).pack(layouts[-1])
        per_op.backend = KernelLayers(per_op.kernels)  # op by op: the same kernels without the one-call stack
        models[f"{layouts[-1]} per-op"] = per_op
        bf16_cache = load_target(folder, dtype=args.dtype, pack=False).pack(layouts[-1])
        bf16_cache.kv_dtype = torch.bfloat16  # what --dtype auto serves a bfloat16 checkpoint with here
        models[f"{layouts[-1]} + bf16 cache"] = bf16_cache
        if args.kernel_threads > 1:
            pooled = load_target(folder, dtype=args.dtype, pack=False).pack(layouts[-1], args.kernel_threads)
            pooled.kv_dtype = torch.bfloat16
            models[f"... {args.kernel_threads} thr"] = pooled
        if cpu_kernels().amx:  # bfloat16 products on AMX: what --dtype auto serves a bfloat16 checkpoint with here
            for threads in sorted({1, args.kernel_threads}):
                amx = load_target(folder, dtype=args.dtype, pack=False).pack("amx", threads)
                amx.kv_dtype = torch.bfloat16
                models[f"amx {threads} thr"] = amx
    vocab = models["as loaded"].config.vocab_size
    names = list(models)
    print(f"target {folder}, {args.dtype}, {args.threads} thread(s), context {args.context}; ms per forward, "
          f"ratios against {names[0]!r}; max |logit diff| and same argmax against it too")
    print(f"{'shape':>6} " + " ".join(f"{name:>18}" for name in names) + "  ratios    max|diff|  same argmax")
    for shape in args.shapes.split(","):
        batch, tokens = (int(n) for n in shape.split("x"))
        ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
        positions = (args.context + torch.arange(tokens))[None].expand(batch, -1)
        slots = torch.arange(batch)
        caches = {name: model.new_cache(batch, args.context + tokens) for name, model in models.items()}
        seconds = {name: [] for name in models}
        logits = {}
        with torch.inference_mode():
            for name, model in models.items():  # fill the cached context alike
                model(torch.randint(0, vocab, (batch, args.context), generator=torch.Generator().manual_seed(1)),
                      torch.arange(args.context)[None].expand(batch, -1), caches[name], slots)
            for _ in range(args.rounds):
                for name, model in models.items():
                    median, logits[name] = time_forward(model, caches[name], ids, positions, slots, args.calls)
                    seconds[name].append(median)
        ms = [statistics.median(seconds[n]) * 1e3 for n in names]
        ratios = " ".join(f"{ms[0] / m:.2f}x" for m in ms[1:])
        diff = max((logits[names[0]] - logits[n]).abs().max().item() for n in names[1:])
        same = all(torch.equal(logits[names[0]].argmax(-1), logits[n].argmax(-1)) for n in names[1:])
        print(f"{shape:>6} " + " ".join(f"{m:18.2f}" for m in ms) + f"  {ratios}  {diff:.2e}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
