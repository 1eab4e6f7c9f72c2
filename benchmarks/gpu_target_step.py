"""The target step on a GPU: a random Qwen3-8B-shaped target (bfloat16, no download: random weights are fine for
timing), one forward + lm_head per step, eager against a CUDA graph replay (verify_worker/cuda_graph_step.py)
and, with --compile, torch.compile (Inductor, then its own CUDA graphs: mode "reduce-overhead").

For each shape BATCHxTOKENS (1 token: a plain decode step; 16: a verify block) every row attends over about
--context cached positions. Columns (medians of CUDA-event timings, ms a step):
- "eager, device facts": the step as it ran before the host passed its facts (key length and slot range read
  back from the device: two syncs a step);
- "eager": the engine's step (StepBatch with key_length and slot_range from the host: no sync);
- "graph": the same step captured once per shape (key length rounded up to a bucket of 256, slots read by
  index) and replayed.
Checks printed with them: the graph's logits against an eager call of the identical batch (bit for bit), and
against the engine's eager step (largest difference, greedy tokens). Then, for lossless verification on this
device: a verify block of 16 tokens against the same 16 tokens decoded one at a time (rows equal bit for bit,
greedy tokens equal), and a row of a one-token step beside seven longer rows against the same row alone (the
batch's composition must not change a row either). --batch-invariant runs all of it on the target as
--batch-invariant packs it (every projection through cuda_ext's row GEMM, every norm through its row norm,
attention through its row attention).

    python benchmarks/gpu_target_step.py                        # on a GPU: Qwen3-8B-shaped, bfloat16
    python benchmarks/gpu_target_step.py --compile --compile-budget-s 240
    python benchmarks/gpu_target_step.py --batch-invariant --shapes 1x1,1x16,8x1,8x16,32x1,32x16
    python benchmarks/gpu_target_step.py --device cpu --config tiny --shapes 1x1,2x4 --rounds 2   # dry run
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_kernels import median_ms  # noqa: E402  (this folder's kernel benchmark: CUDA events, medians)
from shared.attention import batch_invariant_attention, cached_attention, visibility_mask  # noqa: E402
from verify_worker.cuda_graph_step import CudaGraphStep, StepShape  # noqa: E402
from verify_worker.families.interface import StepBatch  # noqa: E402
from verify_worker.families.llama.config import TargetConfig  # noqa: E402
from verify_worker.families.llama.loader import assemble_llama  # noqa: E402
from verify_worker.families.llama.model import TargetModel  # noqa: E402

CONFIGS = {
    "qwen3-8b": dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0),
}
KEY_BUCKET = 256


def random_target(name: str, device: str, dtype: torch.dtype, seed: int = 0, layout: str = "auto") -> TargetModel:
    """A packed TargetModel of the named shape with random weights in the checkpoint's tensor table, assembled as
    the loader assembles one (loader.assemble_llama), without writing a checkpoint."""
    cfg = TargetConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                                  "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 40_960,
                                  "torch_dtype": "bfloat16", **CONFIGS[name]})
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for tensor_name, shape in cfg.tensor_shapes().items():
        if tensor_name.endswith("norm.weight"):
            tensors[tensor_name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            std = 1.0 if "embed_tokens" in tensor_name else 0.02
            tensors[tensor_name] = (torch.randn(shape, generator=generator, device=device) * std).to(dtype)
    return assemble_llama(cfg, tensors, device).pack(layout)


def step_inputs(batch: int, tokens: int, context: int, vocab: int, device: str, generator: torch.Generator):
    """ids [b, s], positions [b, s] (each row's context a little different: ragged), slots [b]."""
    contexts = context - torch.arange(batch) * 7  # [b]
    positions = (contexts[:, None] + torch.arange(tokens)).to(device)  # [b, s]
    ids = torch.randint(0, vocab, (batch, tokens), generator=generator).to(device)
    return ids, positions, torch.arange(batch, device=device), int(contexts.max()) + tokens


def bucket(key_length: int, capacity: int) -> int:
    return min(-(-key_length // KEY_BUCKET) * KEY_BUCKET, capacity)


def time_shapes(model, cache, args, device: str) -> list[tuple]:
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    rows = []
    print(f"{'shape':>7} {'eager, device facts':>20} {'eager':>8} {'graph':>8} {'eager/graph':>12}  checks")
    for text in args.shapes.split(","):
        batch, tokens = (int(v) for v in text.split("x"))
        ids, positions, slots, key_length = step_inputs(batch, tokens, args.context, vocab, device, generator)
        engine_batch = StepBatch(ids, positions, slots, key_length=key_length, slot_range=(0, batch))

        def device_facts():
            return model.logits(model(ids, positions, cache, slots).hidden)

        def eager():
            return model.logits(model.step(engine_batch, cache).hidden)

        synced, plain = median_ms(device_facts, args.rounds, device), median_ms(eager, args.rounds, device)
        graph_ms, checks = float("nan"), "graph: needs CUDA"
        if device == "cuda":
            shape = StepShape(batch, tokens, bucket(key_length, cache.capacity))
            graphed = CudaGraphStep(model, cache, shape, ids, positions, slots)
            graph_ms = median_ms(lambda: graphed.run(ids, positions, slots), args.rounds, device)
            replayed = graphed.run(ids, positions, slots).logits.clone()
            same_batch = StepBatch(ids, positions, slots, key_length=shape.key_length)
            identical = model.logits(model.step(same_batch, cache).hidden)
            engine = eager()
            again = model.logits(model.step(same_batch, cache).hidden)
            checks = (f"eager twice alike: {torch.equal(again, identical)}; "
                      f"graph == eager of the same batch: {torch.equal(replayed, identical)}; vs the engine's step: "
                      f"max |diff| {(replayed - engine).abs().max().item():.2e}, greedy tokens equal "
                      f"{int((replayed.argmax(-1) == engine.argmax(-1)).sum())}/{batch * tokens}")
            del graphed
        print(f"{text:>7} {synced:20.3f} {plain:8.3f} {graph_ms:8.3f} {plain / graph_ms:12.2f}  {checks}", flush=True)
        rows.append((text, synced, plain, graph_ms))
    return rows


def component_invariance(model, device: str, block: int = 16) -> None:
    """Which op makes a block's rows differ from one-row calls: one layer's projections, the lm_head and its
    RMSNorm (rows of [block, in] against [1, in]), and attention (block queries against one query, the same
    keys)."""
    generator = torch.Generator().manual_seed(4)
    dtype = model.embed_weight.dtype
    hidden = model.config.hidden_size
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    packed = attention.qkv_proj is not None
    projections = [("qkv", attention.qkv_proj if packed else attention.q_proj), ("o", attention.o_proj),
                   ("gate/up", mlp.gate_up_proj if packed else mlp.gate_proj), ("down", mlp.down_proj),
                   ("lm_head", model.logits)]
    for name, linear in projections:
        width = hidden if name == "lm_head" else linear.weight.shape[0 if getattr(linear, "transposed", False) else 1]
        x = torch.randn(block, width, generator=generator).to(device, dtype)
        whole = linear(x)
        rows = torch.cat([linear(x[i: i + 1]) for i in range(block)])
        print(f"  {name}: rows of {block} vs 1 equal bit for bit {int((whole == rows).all(-1).sum())}/{block}")
    x = torch.randn(block, hidden, generator=generator).to(device, dtype)
    whole = layer.input_layernorm(x)
    rows = torch.cat([layer.input_layernorm(x[i: i + 1]) for i in range(block)])
    print(f"  RMSNorm: rows of {block} vs 1 equal bit for bit {int((whole == rows).all(-1).sum())}/{block}")
    heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    keys = 1024  # whole chunks of 64, as batch_invariant_attention is called
    q = torch.randn(1, heads, block, dim, generator=generator).to(device, dtype)
    k = torch.randn(1, kv_heads, keys + block, dim, generator=generator).to(device, dtype)
    v = torch.randn(1, kv_heads, keys + block, dim, generator=generator).to(device, dtype)
    positions = (keys + torch.arange(block))[None].to(device)
    for name, attend in (("SDPA", cached_attention), ("batch_invariant_attention", batch_invariant_attention)):
        whole = attend(q, k, v, visibility_mask(positions, keys + block), dim**-0.5)  # [1, block, heads * dim]
        rows = torch.cat([attend(q[:, :, i: i + 1], k, v, visibility_mask(positions[:, i: i + 1], keys + block),
                                 dim**-0.5) for i in range(block)], 1)
        print(f"  attention ({name}, {keys} cached keys): rows of {block} vs 1 equal bit for bit "
              f"{int((whole == rows).all(-1).sum())}/{block}", flush=True)


def gemm_row_sweep(model, device: str, counts=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), pad: int = 16) -> None:
    """For each of the step's GEMM shapes: at which row counts M a row of an M-row product equals the same row
    multiplied alone (bit for bit), and the same with every product padded to a multiple of `pad` rows (a
    batch-invariant GEMM is what greedy identity needs on a GPU; padding is the cheapest candidate)."""
    generator = torch.Generator().manual_seed(5)
    dtype = model.embed_weight.dtype
    layer = model.model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate/up": layer.mlp.gate_up_proj,
              "down": layer.mlp.down_proj}
    for name, linear in shapes.items():
        if linear is None or getattr(linear, "layout", None) != "fused":
            print(f"  GEMM sweep: {name} is not a plain [out, in] weight here (layout "
                  f"{getattr(linear, 'layout', None)}): skipped")
            continue
        weight = linear.weight  # [out, in]
        x = torch.randn(max(counts), weight.shape[1], generator=generator).to(device, dtype)

        def product(rows: torch.Tensor, padded: bool) -> torch.Tensor:
            if not padded:
                return torch.nn.functional.linear(rows, weight)
            total = -(-rows.shape[0] // pad) * pad
            return torch.nn.functional.linear(torch.cat([rows, rows.new_zeros(total - rows.shape[0], rows.shape[1])]),
                                              weight)[: rows.shape[0]]

        for padded in (False, True):
            alone = torch.cat([product(x[i: i + 1], padded) for i in range(max(counts))])  # [max M, out]
            same = [m for m in counts if torch.equal(product(x[:m], padded), alone[:m])]
            print(f"  GEMM {name} [{weight.shape[1]} -> {weight.shape[0]}]{' padded to ' + str(pad) if padded else ''}:"
                  f" rows equal alone at M = {same} of {list(counts)}", flush=True)


def row_invariance(model, cache, args, device: str, block: int = 16) -> None:
    """A verify block's rows against the same tokens decoded one at a time, into two different slots."""
    generator = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    ids, positions, _, _ = step_inputs(1, block, args.context, vocab, device, generator)
    prefix = torch.randint(0, vocab, (1, args.context), generator=generator).to(device)
    key_length = args.context + block
    for slot in (0, 1):  # the same context in both slots
        slots = torch.tensor([slot], device=device)
        model.step(StepBatch(prefix, torch.arange(args.context, device=device)[None], slots,
                             key_length=args.context, slot_range=(slot, slot + 1)), cache)
    verify = model.logits(model.step(StepBatch(ids, positions, torch.tensor([0], device=device),
                                               key_length=key_length, slot_range=(0, 1)), cache).hidden)[0]
    single = torch.cat([model.logits(model.step(StepBatch(ids[:, i: i + 1], positions[:, i: i + 1],
                                                          torch.tensor([1], device=device), key_length=key_length,
                                                          slot_range=(1, 2)), cache).hidden)[0]
                        for i in range(block)])  # [block, vocab]
    equal_rows = int((verify == single).all(-1).sum())
    equal_tokens = int((verify.argmax(-1) == single.argmax(-1)).sum())
    print(f"verify block of {block} vs {block} one-token steps ({model.embed_weight.dtype}): rows equal bit for bit "
          f"{equal_rows}/{block}, greedy tokens equal {equal_tokens}/{block}, max |diff| "
          f"{(verify - single).abs().max().item():.2e}", flush=True)


def time_compiled(model, cache, args, device: str, started: float) -> None:
    """torch.compile of the engine's step (mode reduce-overhead: Inductor's kernels in its own CUDA graphs),
    one shape after another while the budget lasts (compiling a 36-layer step takes minutes)."""
    generator = torch.Generator().manual_seed(3)
    for text in args.compile_shapes.split(","):
        left = args.compile_budget_s - (time.perf_counter() - started)
        if left < 60:
            print(f"compile {text}: skipped, {left:.0f} s of the budget left", flush=True)
            continue
        batch, tokens = (int(v) for v in text.split("x"))
        ids, positions, slots, key_length = step_inputs(batch, tokens, args.context, model.config.vocab_size,
                                                        device, generator)
        key_length = bucket(key_length, cache.capacity)

        def step(ids, positions, slots):
            return model.logits(model.step(StepBatch(ids, positions, slots, key_length=key_length), cache).hidden)

        compiled = torch.compile(step, mode="reduce-overhead", dynamic=False)
        compile_started = time.perf_counter()
        try:
            for _ in range(3):
                compiled(ids, positions, slots)
            torch.cuda.synchronize()
        except Exception as error:  # report and go on: the eager and graph figures stand without it
            print(f"compile {text}: failed ({type(error).__name__}: {str(error)[:300]})", flush=True)
            continue
        compile_s = time.perf_counter() - compile_started
        compiled_ms = median_ms(lambda: compiled(ids, positions, slots), args.rounds, device)
        eager_ms = median_ms(lambda: step(ids, positions, slots), args.rounds, device)
        out, reference = compiled(ids, positions, slots).clone(), step(ids, positions, slots)
        print(f"compile {text}: {compile_s:.0f} s to compile; eager (same batch) {eager_ms:.3f} ms, compiled "
              f"{compiled_ms:.3f} ms ({eager_ms / compiled_ms:.2f}x); max |diff| "
              f"{(out - reference).abs().max().item():.2e}, greedy tokens equal "
              f"{int((out.argmax(-1) == reference.argmax(-1)).sum())}/{batch * tokens}", flush=True)


def batch_invariance(model, cache, args, device: str, beside: int = 7) -> None:
    """A one-token step's first row computed beside `beside` longer rows against the same row alone (the other
    rows' key lengths set the step's, and the batch size the GEMMs' row counts)."""
    generator = torch.Generator().manual_seed(3)
    vocab, rows = model.config.vocab_size, beside + 1
    contexts = [args.context - 100] + [args.context + 13 * i for i in range(1, rows)]  # row 0 the shortest
    for slot, length in enumerate(contexts):
        prefix = torch.randint(0, vocab, (1, length), generator=generator).to(device)
        model.step(StepBatch(prefix, torch.arange(length, device=device)[None], torch.tensor([slot], device=device),
                             key_length=length, slot_range=(slot, slot + 1)), cache)
    ids = torch.randint(0, vocab, (rows, 1), generator=generator).to(device)
    positions = torch.tensor(contexts, device=device)[:, None]
    together = model.logits(model.step(StepBatch(ids, positions, torch.arange(rows, device=device),
                                                 key_length=max(contexts) + 1, slot_range=(0, rows)), cache).hidden)
    alone = model.logits(model.step(StepBatch(ids[:1], positions[:1], torch.tensor([0], device=device),
                                              key_length=contexts[0] + 1, slot_range=(0, 1)), cache).hidden)
    print(f"a row beside {beside} longer rows vs alone: equal bit for bit {torch.equal(together[0], alone[0])}, "
          f"greedy token equal {bool(together[0].argmax(-1).eq(alone[0].argmax(-1)).all())}, max |diff| "
          f"{(together[0] - alone[0]).abs().max().item():.2e}", flush=True)


def invariance_variants(model, cache, args) -> None:
    """The row check again where PyTorch is told to keep reduced-precision sums out of bfloat16 GEMMs, with
    attention on the math backend, and in float32 (a second model)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = False
    print("bfloat16, allow_bf16_reduced_precision_reduction False:")
    row_invariance(model, cache, args, "cuda")
    matmul.allow_bf16_reduced_precision_reduction = True
    with sdpa_kernel(SDPBackend.MATH):
        print("bfloat16, SDPA math backend:")
        row_invariance(model, cache, args, "cuda")
    wide = random_target(args.config, "cuda", torch.float32)
    wide_cache = wide.new_cache(2, cache.capacity)
    print("float32:")
    row_invariance(wide, wide_cache, args, "cuda")
    component_invariance(wide, "cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--config", default="qwen3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1x1,1x16,8x1,8x16,32x1,32x16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (minutes per shape)")
    parser.add_argument("--invariant-attention", action="store_true",
                        help="attend with batch_invariant_attention (the CPU's bfloat16 path) instead of SDPA")
    parser.add_argument("--gemm-sweep", action="store_true",
                        help="which row counts give every GEMM's rows the bits of one-row products (and padded)")
    parser.add_argument("--invariance-variants", action="store_true",
                        help="the row check under other GEMM / attention settings and in float32 (a second model)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the target as --batch-invariant packs it (the rows layout: cuda_ext's row GEMM)")
    parser.add_argument("--compile-shapes", default="1x1,1x16")
    parser.add_argument("--compile-budget-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible to torch: nothing to run (--device cpu --config tiny is the dry run)")
        return 2
    started = time.perf_counter()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = random_target(args.config, args.device, dtype, layout="rows" if args.batch_invariant else "auto")
    max_batch = max([int(text.split("x")[0]) for text in args.shapes.split(",") if text] + [8])
    capacity = bucket(args.context + 64, 1 << 30)
    cache = model.new_cache(max(max_batch, 2), capacity)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: {args.config} target, {args.dtype}, "
          f"{sum(p.numel() for p in model.state_dict().values()) / 1e9:.2f}B values, cache "
          f"{cache.nbytes() / 2**30:.1f} GiB ({capacity} positions x {cache.num_slots} slots), context {args.context}; "
          f"built in {time.perf_counter() - started:.1f} s"
          + ("; packed for --batch-invariant (row GEMM, row norm, row attention)" if args.batch_invariant else ""),
          flush=True)
    if args.invariant_attention:  # a trial of the CPU's bfloat16 attention on this device (not the served default)
        import verify_worker.families.llama.model as llama

        llama.invariant_attention = lambda x, rows_layout=False: x.dtype == torch.bfloat16
        print("attention: batch_invariant_attention (shared/attention.py) in place of SDPA")
    with torch.inference_mode():
        if args.shapes:
            time_shapes(model, cache, args, args.device)
        row_invariance(model, cache, args, args.device)
        batch_invariance(model, cache, args, args.device)
        component_invariance(model, args.device)
        if args.gemm_sweep:
            gemm_row_sweep(model, args.device)
        if args.invariance_variants and args.device == "cuda":
            invariance_variants(model, cache, args)
        if args.compile and args.device == "cuda":
            time_compiled(model, cache, args, args.device, time.perf_counter())
    return 0


if __name__ == "__main__":
    sys.exit(main())
