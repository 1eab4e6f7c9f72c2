"""Loading a GLM-5.2-FP8-shaped slice checkpoint: peak host memory against the checkpoint's size, load time, and the
memory plan's weight bytes against what the loader placed (and, on a GPU, torch.cuda.max_memory_allocated).

The slice has the published widths (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, rope 64, expert width 2048, 128 x
128 FP8 blocks) with fewer layers, experts and words (--layers, --experts, --vocab) so that it fits any machine; it is
written in shards of one layer, as published checkpoints are sharded. The load runs in a fresh process (its peak
resident memory is the load's alone): the loader reads one tensor at a time into its place on --device, so the host
holds the model only when the model lives on the host (--device cpu), never a second copy of it.

    python benchmarks/load_memory.py                          # CPU: 2 layers, 16 experts (1.9 GiB)
    python benchmarks/load_memory.py --device cuda --experts 64
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GLM52_FP8 = {  # GLM-5.2-FP8's config (benchmarks/published_configs/glm-5.2-fp8.json), layers and experts set per run
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
    "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
    "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048, "intermediate_size": 12288,
    "n_group": 1, "topk_group": 1, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "first_k_dense_replace": 0, "dtype": "bfloat16", "max_position_embeddings": 4096,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["model.embed_tokens", "lm_head"]},
}
UNQUANTIZED = ("norm.weight", "norm.bias", "mlp.gate.weight", "e_score_correction_bias", "embed_tokens.weight",
               "lm_head.weight", "weights_proj.weight")


def write_slice(folder: Path, layers: int, experts: int, vocab: int) -> dict:
    """The slice checkpoint: random FP8 blocks (scales 1 / sqrt(fan in)) for the projections, one shard a layer."""
    import torch
    from safetensors.torch import save_file

    from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig

    config = {**GLM52_FP8, "num_hidden_layers": layers, "n_routed_experts": experts, "vocab_size": vocab,
              "mlp_layer_types": ["sparse"] * layers, "indexer_types": ["full"] * layers}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = GlmMoeDsaConfig.from_dict(config).tensor_shapes()
    generator = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in shapes.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "top"
        shard = shards.setdefault(layer, {})
        if len(shape) == 2 and not name.endswith(UNQUANTIZED):
            shard[name] = torch.randn(shape, generator=generator).to(torch.float8_e4m3fn)
            grid = (-(-shape[0] // 128), -(-shape[1] // 128))
            shard[name[: -len(".weight")] + ".weight_scale_inv"] = torch.full(grid, shape[1] ** -0.5)
        else:
            shard[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    for index, (layer, tensors) in enumerate(shards.items()):
        save_file(tensors, str(folder / f"model-{index:05d}-of-{len(shards):05d}.safetensors"))
    return config


def measure(folder: str, device: str) -> dict:
    """Run in the child process: load the slice, report the peak host memory and the placed bytes."""
    import torch

    from verify_worker.families.common.checkpoint_reader import peak_host_bytes
    from verify_worker.memory_plan import PlanRequest, make_plan
    from verify_worker.target_loader import load_target

    before = peak_host_bytes()
    started = time.monotonic()
    target = load_target(folder, device=device, dtype="bfloat16", pack=False)
    seconds = time.monotonic() - started
    peak = peak_host_bytes()
    placed: dict[str, int] = {}
    for parameter in target.parameters():
        key = str(parameter.dtype).removeprefix("torch.")
        placed[key] = placed.get(key, 0) + parameter.numel() * parameter.element_size()
    config = json.loads((Path(folder) / "config.json").read_text())
    plan = make_plan(PlanRequest(config, None, 1, None, 1, 64, 1, "bfloat16", device, None, False, False))
    return {"seconds": seconds, "host_before": before, "host_peak": peak, "placed": placed, "planned": plan.weights,
            "cuda_max_allocated": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16384, help="the vocabulary (published: 154880; its embedding "
                        "and head alone are 3.8 GB in bfloat16)")
    parser.add_argument("--folder", default=None, help="write the slice here (default: a temporary folder)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.device)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.folder or scratch) / "glm52-fp8-slice"
        started = time.monotonic()
        write_slice(folder, args.layers, args.experts, args.vocab)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"slice: {args.layers} layers, {args.experts} experts, vocabulary {args.vocab}, "
              f"{size / 2**30:.2f} GiB in "
              f"{len(list(folder.glob('*.safetensors')))} shards (written in {time.monotonic() - started:.0f} s)",
              flush=True)
        run = subprocess.run([sys.executable, __file__, "--child", str(folder), "--device", args.device],
                             capture_output=True, text=True, cwd=ROOT)
        if run.returncode:
            sys.exit(run.stderr[-3000:])
        found = json.loads(run.stdout.strip().splitlines()[-1])
    placed, planned = sum(found["placed"].values()), sum(found["planned"].values())
    growth = found["host_peak"] - found["host_before"]
    print(f"load to {args.device}: {found['seconds']:.1f} s; host memory: {found['host_before'] / 2**30:.2f} GiB "
          f"before (Python, torch), peak {found['host_peak'] / 2**30:.2f} GiB: +{growth / 2**30:.2f} GiB = "
          f"{growth / size:.2f}x the checkpoint")
    print(f"placed {placed / 2**30:.2f} GiB {found['placed']}; the memory plan's weights "
          f"{planned / 2**30:.2f} GiB ({planned / placed - 1:+.1%})")
    if found["cuda_max_allocated"] is not None:
        allocated = found["cuda_max_allocated"]
        print(f"torch.cuda.max_memory_allocated {allocated / 2**30:.2f} GiB; "
              f"plan / allocated {planned / allocated:.3f}")


if __name__ == "__main__":
    main()
