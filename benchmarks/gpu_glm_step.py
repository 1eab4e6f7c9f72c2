"""The GLM families' target step on a GPU, on slices of the published shapes with random weights (no download):
GLM-5.3-Flash (hidden 4096, 64 heads, KDA head 128, q_lora 1536, kv_lora 512, 288 experts top-8 of width 2048 plus
one shared, mHC 4 streams; layers in the 3:1 KDA:DSA schedule, every one with the MoE) and GLM-5.2 (hidden 6144, MLA
with rope 64, 256 experts top-8). The target is built as the loader builds one (on the meta device, the tensors
assigned, then packed for the device: kernel_set.py's Triton kernels and fla's KDA recurrence on CUDA).

For batch B and T new tokens per row (1: a decode step; --block: a verify block) over --context cached positions:
the step's time (forward + logits; medians of CUDA events), the weights it reads (every dense weight, the experts
the step's routing hits, counted from that routing) and the cache and state bytes, and the achieved bytes/s
against the device's copy bandwidth (measured here) and its datasheet peak; on CUDA the same step captured in a
CUDA graph (verify_worker/cuda_graph_step.py) and replayed, and whether the replay gives the eager step's logits.
Then, through the engine (verify_worker/engine), with the
benchmark's replay drafter (replay_proposer.py: the target's own greedy continuation, one draft per block made
wrong so each step commits --acceptances tokens): greedy speculative == plain on --prompts prompts (mismatches
counted), and speculative / plain decode speed at each acceptance for --speedup-batches; then greedy speculative ==
plain with a random drafter of the family's kind attached (DFlash 2 / DFlash); the speedups for the Qwen3-8B-shaped
target of gpu_target_step.py too.

    python benchmarks/gpu_glm_step.py                                       # on a GPU (slices; about 60 GB)
    python benchmarks/gpu_glm_step.py --families glm5 --layers 2 --batches 1,8
    python benchmarks/gpu_glm_step.py --device cpu --config tiny            # the dry run CI can afford
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_kernels import median_ms  # noqa: E402  (this folder's kernel benchmark: CUDA events, medians)
from replay_proposer import ReplayProposer  # noqa: E402
from draft_worker.draft_checkpoint import random_drafter  # noqa: E402
from draft_worker.local_proposer import LocalProposer  # noqa: E402
from shared.draft_config import DFlash2Settings, DraftConfig  # noqa: E402
from shared.generation_request import GenerationRequest  # noqa: E402
from verify_worker.cuda_graph_step import CudaGraphStep, StepShape  # noqa: E402
from verify_worker.engine import SpeculativeEngine  # noqa: E402
from verify_worker.families.common.kernel_set import TorchKernels, TritonKernels, use_kernels  # noqa: E402
from verify_worker.families.common.moe import RoutedExperts  # noqa: E402
from verify_worker.families.registry import family_for  # noqa: E402
from verify_worker.parallel.group import TensorParallel  # noqa: E402
from verify_worker.families.interface import StepBatch  # noqa: E402

GLM5 = {  # GLM-5.3-Flash's text config (../shared/docs/glm-targets.md section 0), the layer count set per run
    "vocab_size": 154880, "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256,
    "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "intermediate_size": 12288, "hc_mult": 4, "hc_sinkhorn_iters": 20, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 32, "index_kpool": 4, "swiglu_limit": 10.0, "dtype": "bfloat16",
    "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
}
GLM52 = {  # GLM-5.2 (section 4 there)
    "vocab_size": 154880, "hidden_size": 6144, "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048, "intermediate_size": 12288,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 0, "dtype": "bfloat16",
}
TINY = {  # the shapes of the tests' tiny checkpoints, for the CPU dry run
    "glm5": {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
             "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_intermediate_size": 32,
             "intermediate_size": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "index_topk": 8, "index_head_dim": 16,
             "index_n_heads": 4, "index_kpool": 4, "swiglu_limit": 10.0, "dtype": "float32",
             "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}},
    "glm52": {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16,
              "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_intermediate_size": 32,
              "intermediate_size": 128, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 4,
              "first_k_dense_replace": 0, "dtype": "float32"},
}
DEFAULT_LAYERS = {"glm5": 4, "glm52": 2}  # GLM-5.2's experts take 19 GB a layer in bfloat16
PEAK_TBS = {"H100 PCIe": 2.0, "H100": 3.35, "H200": 4.8, "GB200": 8.0, "GB300": 8.0, "GB10": 0.273}  # datasheets


def family_config(family: str, config: str, layers: int, fp8: bool = False) -> dict:
    text = dict(TINY[family] if config == "tiny" else GLM5 if family == "glm5" else GLM52)
    text["num_hidden_layers"] = layers
    if fp8:  # as the FP8 checkpoints are published: 128 x 128 blocks (16 x 16 at the tiny widths), bfloat16 compute
        block = [16, 16] if config == "tiny" else [128, 128]
        text.update(dtype="bfloat16", quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                           "weight_block_size": block})
    if family == "glm5":
        text["layer_types"] = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        text["mlp_layer_types"] = ["sparse"] * layers
        text["indexer_types"] = ["full"] * layers
        return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text}
    text["indexer_types"] = ["full"] * layers
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **text}


def random_target(config: dict, device: str, seed: int = 0):
    """The family's model with random weights, assembled as its loader assembles one, packed for the device."""
    entry = family_for(config)
    dtype = getattr(torch, (config.get("text_config") or config)["dtype"])
    model = entry.skeleton(config, TensorParallel(), dtype)  # on the meta device; FP8 where an FP8 config keeps it
    cfg = model.config
    kept = entry.float32_kept  # what the loader keeps float32
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = {name: tuple(meta.shape) for name, meta in model.state_dict().items()}
    tensors = {}
    for name, meta in model.state_dict().items():
        placed = torch.float32 if any(part in name for part in kept) else meta.dtype
        tensor = torch.empty(meta.shape, dtype=placed, device=device)
        if meta.dtype == torch.float8_e4m3fn:  # FP8 blocks: values of order 1, the fan-in in the scales
            tensor = torch.randn(meta.shape, generator=generator, device=device).to(meta.dtype)
        elif name.endswith("_scale_inv"):
            tensor.fill_(shapes[name[: -len("_scale_inv")]][-1] ** -0.5)
        elif name.endswith("norm.weight") or name.endswith("_hc.scale"):
            tensor.fill_(1.0)
        elif name.endswith(("bias", "A_log", "_hc.base")) or meta.dim() < 2:
            tensor.normal_(0.0, 0.5, generator=generator)
        else:  # a projection (or a stack of them): 1 / sqrt(fan in) keeps activations of order 1
            tensor.normal_(0.0, 1.0 if "embed_tokens" in name else meta.shape[-1] ** -0.5, generator=generator)
        tensors[name] = tensor
    model.load_state_dict(tensors, strict=True, assign=True)
    if entry.name == "glm_moe_dsa":  # not in the state dict: made as the loader makes it
        from shared.rope import inverse_frequencies
        from shared.rope_settings import RopeSettings

        model.inv_freq = inverse_frequencies(RopeSettings(cfg.rope_theta), cfg.qk_rope_head_dim).to(device)
    return model.eval().requires_grad_(False).pack()


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of every weight outside the routed experts, bytes of one routed expert's three projections)."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    routed = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    per_expert = routed // sum(m.gate_up_proj.shape[0] for m in experts) if experts else 0
    return total - routed, per_expert


def experts_hit(model, run) -> int:
    """Distinct (layer, expert) pairs the routing of one call of `run` reaches (read once each by a step)."""
    hits = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: hits.append(int(torch.unique(args[1]).numel())))
             for m in model.modules() if isinstance(m, RoutedExperts)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(hits)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the achievable figure to compare a step against."""
    size = 2**30 if device == "cuda" else 2**26
    source, target = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8,
                                                                                       device=device)
    return 2 * size / (median_ms(lambda: target.copy_(source), 10, device) / 1e3)


def datasheet_peak(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tbs * 1e12 for key, tbs in PEAK_TBS.items() if key in name), None)


def step_table(model, args, device: str, copy_bps: float, peak: float | None) -> None:
    cfg = model.config
    dense, per_expert = weight_bytes(model)
    print(f"  weights: {dense / 2**20:.1f} MiB outside the routed experts, {per_expert / 2**20:.2f} MiB an expert")
    capacity = args.context + args.block + 1
    state = model.new_state(max(args.batches), capacity, args.block)
    per_slot = model.state_bytes_per_slot(args.context, args.block)
    print(f"  {'B x T':>7} {'ms':>9} {'graphed':>9} {'weights read':>13} {'cache+state':>12} {'GB/s':>8} "
          f"{'of copy':>8} {'of peak':>8}  commit ms")
    generator = torch.Generator().manual_seed(1)
    one_token = {}
    for batch in args.batches:
        for tokens in (1, args.block):
            ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=generator).to(device)
            positions = (args.context + torch.arange(tokens))[None].expand(batch, -1).to(device)
            slots = torch.arange(batch, device=device)
            step = StepBatch(ids, positions, slots, key_length=args.context + tokens, slot_range=(0, batch))

            def run():
                return model.logits(model.step(step, state).hidden)

            ms = median_ms(run, args.rounds, device)
            graphed = graphed_ms(model, state, step, args.rounds) if device == "cuda" else "-"
            read = dense + experts_hit(model, run) * per_expert
            cache = batch * per_slot
            bps = (read + cache) / (ms / 1e3)
            commit = ""
            if getattr(model, "commits_state", False) and tokens > 1:  # KDA: keep half the block (a replay)
                kept = torch.full((batch,), tokens // 2, device=device)
                commit = f"{commit_ms(model, state, run, slots, kept, args.rounds, device):.3f}"
            if tokens == 1:
                one_token[batch] = ms
            ratio = f"  ({ms / one_token[batch]:.2f}x the 1-token step)" if tokens > 1 else ""
            print(f"  {batch:>3} x {tokens:<2} {ms:9.3f} {graphed:>9} {read / 2**20:10.1f} MiB "
                  f"{cache / 2**20:9.1f} MiB "
                  f"{bps / 1e9:8.1f} {bps / copy_bps:8.0%} {(f'{bps / peak:.0%}' if peak else 'n/a'):>8}  "
                  f"{commit or '-'}{ratio}", flush=True)


def graphed_ms(model, state, step: StepBatch, rounds: int) -> str:
    """The step (forward + logits) captured in a CUDA graph: its replay's median ms, and "!" after it where the
    replay's logits are not the eager step's bit for bit; the failure's name where it cannot be captured."""
    shape = StepShape(step.input_ids.shape[0], step.input_ids.shape[1], step.key_length)
    try:
        graph = CudaGraphStep(model, state, shape, step.input_ids, step.positions, step.slots)
    except Exception as error:  # noqa: BLE001 - a benchmark reports what failed and goes on
        print(f"    capture failed for {shape}: {type(error).__name__}: {error}", flush=True)
        return type(error).__name__[:9]
    ms = median_ms(lambda: graph.run(step.input_ids, step.positions, step.slots), rounds, "cuda")
    nothing = torch.zeros_like(step.slots)
    model.commit(state, step.slots, nothing)  # each from the committed state (KDA tips go back)
    replayed = graph.run(step.input_ids, step.positions, step.slots).logits.clone()
    model.commit(state, step.slots, nothing)
    eager = model.logits(model.step(step, state).hidden)
    model.commit(state, step.slots, nothing)
    return f"{ms:.3f}{'' if torch.equal(replayed, eager) else '!'}"


def commit_ms(model, state, run, slots, kept, rounds: int, device: str) -> float:
    """The median time of the commit alone (a KDA replay of the kept tokens), each after an untimed step."""
    times = []
    for _ in range(rounds + 1):
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.commit(state, slots, kept)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times[1:])[rounds // 2]


def prompts(count: int, length: int, vocab: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, vocab, (length,), generator=generator).tolist()) for _ in range(count)]


def engine_run(model, proposer, requests, max_requests: int, max_len: int, graphs: bool = False):
    """The engine's results and seconds for requests; graphs: its decode steps replayed from CUDA graphs
    (--cuda-graphs), all captured before the clock starts."""
    engine = SpeculativeEngine(model, proposer, max_requests=max_requests, max_model_len=max_len,
                               step_buckets="cuda-graphs" if graphs else None)
    engine.warm_up()
    if model.embed_weight.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = engine.generate(requests)
    if model.embed_weight.device.type == "cuda":
        torch.cuda.synchronize()
    return results, time.perf_counter() - started


def random_drafter_check(model, args, label: str) -> None:
    """A random drafter of the family's kind (DFlash 2 for GLM-5.3-Flash, DFlash for GLM-5.2; one layer at the
    target's width, tapping its first and last layers, sharing its embedding and lm_head) attached through the
    engine: greedy speculative == plain on --prompts prompts (it proposes, and the target rejects, real drafts)."""
    cfg = model.config
    hidden, device = cfg.hidden_size, model.embed_weight.device
    head_dim = 16 if hidden < 512 else 128
    draft_cfg = DraftConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_layers=1, num_heads=hidden // head_dim,
        num_kv_heads=max(1, hidden // head_dim // 4), head_dim=head_dim, vocab_size=cfg.vocab_size,
        num_target_layers=cfg.num_layers, target_layer_ids=tuple(sorted({0, cfg.num_layers - 1})),
        mask_token_id=cfg.vocab_size - 1, block_size=args.block,
        dflash2=DFlash2Settings(selector_rank=32, selector_top_k=4) if label == "glm5" else None)
    drafter = random_drafter(draft_cfg, seed=3, std=0.02).to(device, model.embed_weight.dtype)
    requests = [GenerationRequest(p, args.tokens, request_id=f"r{i}")
                for i, p in enumerate(prompts(args.prompts, args.prompt_length, cfg.vocab_size))]
    max_len = args.prompt_length + args.tokens + args.block
    proposer = LocalProposer(drafter, model.embed_weight, model.lm_head_weight, block_size=args.block,
                             max_requests=args.prompts, max_model_len=max_len)
    plain, _ = engine_run(model, None, requests, args.prompts, max_len)
    spec, _ = engine_run(model, proposer, requests, args.prompts, max_len)
    mismatches = sum(s.token_ids != p.token_ids for s, p in zip(spec, plain))
    drafted = sum(s.stats.draft_tokens for s in spec)
    accepted = sum(s.stats.accepted_tokens for s in spec)
    print(f"  {label} with a random {'DFlash 2' if draft_cfg.dflash2 else 'DFlash'} drafter: {mismatches}/"
          f"{len(requests)} greedy mismatches against plain decoding ({drafted} drafts, {accepted} accepted)",
          flush=True)
    del drafter, proposer


def speculation(model, args, label: str) -> None:
    """Greedy speculative == plain with the replay drafter, and the speedup at each acceptance length."""
    vocab, layers = model.config.vocab_size, model.config.num_layers
    batch_sizes = sorted({args.prompts, *args.speedup_batches})
    for batch in batch_sizes:
        requests = [GenerationRequest(p, args.tokens, request_id=f"r{i}", num_speculative_tokens=args.block - 1)
                    for i, p in enumerate(prompts(batch, args.prompt_length, vocab))]
        plain_requests = [GenerationRequest(r.prompt_ids, r.max_tokens, request_id=r.request_id) for r in requests]
        max_len = args.prompt_length + args.tokens + args.block
        graphs = args.engine_graphs
        engine_run(model, None, plain_requests[:1], batch, max_len)  # warm-up (kernels compiled, caches made)
        plain, plain_s = engine_run(model, None, plain_requests, batch, max_len, graphs)
        continuations = {r.request_id: list(r.prompt_ids) + p.token_ids for r, p in zip(requests, plain)}
        tokens = sum(len(p.token_ids) for p in plain)
        line = f"  {label}{' (graphed)' if graphs else ''} batch {batch:>2}: plain {tokens / plain_s:8.1f} tok/s"
        for acceptance in args.acceptances:
            drafter = ReplayProposer(continuations, acceptance, args.block, layers, vocab)
            spec, spec_s = engine_run(model, drafter, requests, batch, max_len, graphs)
            mismatches = sum(s.token_ids != p.token_ids for s, p in zip(spec, plain))
            committed = sum(s.stats.committed_tokens for s in spec) / max(sum(s.stats.verify_steps for s in spec), 1)
            line += (f" | acceptance {acceptance} ({committed:.2f}/step): {plain_s / spec_s:5.2f}x, "
                     f"{mismatches}/{batch} mismatches")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=("slice", "tiny"), default="slice")
    parser.add_argument("--families", default="glm5,glm52", help="comma-separated: glm5 (GLM-5.3-Flash), glm52")
    parser.add_argument("--layers", type=int, default=None, help="layers of each slice (default: glm5 4, glm52 2)")
    parser.add_argument("--batches", default="1,8,32", help="batch sizes of the step table")
    parser.add_argument("--block", type=int, default=8, help="the verify block (the drafter's block size)")
    parser.add_argument("--context", type=int, default=1024, help="cached positions each row attends over")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--acceptances", default="3,4,5", help="tokens each verify step commits (replay drafter)")
    parser.add_argument("--speedup-batches", default="1,16")
    parser.add_argument("--prompts", type=int, default=16, help="prompts of the speculative == plain check")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request decodes in the engine runs")
    parser.add_argument("--fp8", nargs="?", const="w8a16", choices=("w8a16", "w8a8"), default=None,
                        help="the slices' experts and projections as FP8 blocks, multiplied as an FP8 checkpoint "
                        "loads (w8a16, the default) or with FP8 activations (w8a8); against the bfloat16 run")
    parser.add_argument("--engine-graphs", action="store_true", help="the engine runs replay CUDA graphs "
                        "(--cuda-graphs: each engine captures its shapes before it is timed)")
    parser.add_argument("--qwen", default="qwen3-8b", help="gpu_target_step.py's config for the Qwen3 speedups "
                        "('none' to skip; the tiny config's on --config tiny)")
    args = parser.parse_args()
    if args.engine_graphs and not args.device.startswith("cuda"):
        parser.error("--engine-graphs needs a CUDA device")
    args.batches = [int(v) for v in args.batches.split(",")]
    args.acceptances = [int(v) for v in args.acceptances.split(",")]
    args.speedup_batches = [int(v) for v in args.speedup_batches.split(",")]
    if args.config == "tiny":
        args.context = min(args.context, 64)
    device = torch.device(args.device).type  # "cuda" for any CUDA device: the timings synchronise by this name
    if args.device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(args.device))
    copy_bps, peak = copy_bandwidth(device), datasheet_peak(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}: copy {copy_bps / 1e9:.0f} GB/s; datasheet "
          f"{f'{peak / 1e9:.0f} GB/s' if peak else 'unknown'}; torch {torch.__version__}", flush=True)
    for family in args.families.split(","):
        layers = args.layers or DEFAULT_LAYERS[family]
        model = random_target(family_config(family, args.config, layers, args.fp8 is not None), device)
        if args.fp8 == "w8a8":  # the same kernel set, FP8 activations (kernel_set.py)
            kernel_set = TritonKernels if any(m.glm_kernels.name == "triton" for m in model.modules()
                                              if hasattr(m, "glm_kernels")) else TorchKernels
            use_kernels(model, kernel_set(fp8_activations=True))
        kernels = sorted({m.glm_kernels.name for m in model.modules() if hasattr(m, "glm_kernels")})
        recurrence = getattr(model, "recurrence_name", "none")
        weights = f", FP8 weights ({args.fp8})" if args.fp8 else ""
        print(f"{family} ({args.config}{weights}, {layers} layers): kernels {kernels}, KDA recurrence {recurrence}",
              flush=True)
        step_table(model, args, device, copy_bps, peak)
        speculation(model, args, family)
        random_drafter_check(model, args, family)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.qwen != "none":
        from gpu_target_step import random_target as qwen_target

        model = qwen_target("tiny" if args.config == "tiny" else args.qwen, device,
                            torch.float32 if args.config == "tiny" else torch.bfloat16)
        print(f"qwen3 ({'tiny' if args.config == 'tiny' else args.qwen})", flush=True)
        speculation(model, args, "qwen3")


if __name__ == "__main__":
    main()
