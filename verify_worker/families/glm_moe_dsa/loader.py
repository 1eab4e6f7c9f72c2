"""Strict loading of a GLM-5.2 checkpoint (bf16, or FP8 blocks dequantized once at load) into GlmMoeDsaModel.

Published names: per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj.weight`, stacked here as transformers
stacks them (gate then up); transformers' own stacked names are accepted too. MTP layers (`model.layers.{i}`
for i >= num_hidden_layers) are skipped and named in the log. Anything else unexpected, missing or mis-shaped
is a CheckpointError naming it.
"""

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from shared.checkpoint_io import safetensors_files
from shared.dtype_choice import resolve_dtype
from shared.errors import CheckpointError, ConfigError
from shared.rope import inverse_frequencies
from shared.rope_settings import RopeSettings
from verify_worker.families.common.fp8_blocks import dequantize
from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig
from verify_worker.families.glm_moe_dsa.model import GlmMoeDsaModel
from verify_worker.parallel.group import TensorParallel

LAYER = re.compile(r"model\.layers\.(\d+)\.")
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
SCALE = ".weight_scale_inv"


def read_tensors(folder: str | Path, cfg: GlmMoeDsaConfig, log: logging.Logger) -> dict[str, torch.Tensor]:
    """Every tensor of the text model, FP8 weights dequantized to float32; MTP layers skipped."""
    raw, skipped = {}, set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                layer = LAYER.match(name)
                if layer and int(layer.group(1)) >= cfg.num_layers:
                    skipped.add(int(layer.group(1)))
                    continue
                raw[name] = handle.get_tensor(name)
    if skipped:
        log.info("skipping the multi-token-prediction layer(s) %s (not used for verification)", sorted(skipped))
    scales = {name[: -len(SCALE)] + ".weight": raw.pop(name) for name in [n for n in raw if n.endswith(SCALE)]}
    if scales and cfg.fp8 is None:
        raise CheckpointError(f"{str(folder)!r} has FP8 scales ({next(iter(scales))}_scale_inv) but its config.json "
                              "has no quantization_config")
    for name, scale in scales.items():
        if name not in raw:
            raise CheckpointError(f"{str(folder)!r} has {name[:-7]}{SCALE} but no {name}")
        raw[name] = dequantize(raw[name], scale, cfg.fp8.block, name)
    fp8 = [n for n, t in raw.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if fp8:
        raise CheckpointError(f"{str(folder)!r}: FP8 tensor {fp8[0]} has no weight_scale_inv")
    return raw


def stack_experts(tensors: dict[str, torch.Tensor], cfg: GlmMoeDsaConfig) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down -> experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    per_expert: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            per_expert.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
    for prefix, parts in per_expert.items():
        missing = [f"{prefix}.{e}.{kind}_proj.weight" for e in range(cfg.n_routed_experts)
                   for kind in ("gate", "up", "down") if (e, kind) not in parts]
        if missing:
            raise CheckpointError(f"missing tensor(s): {', '.join(missing[:8])}")
        extra = sorted({e for e, _ in parts} - set(range(cfg.n_routed_experts)))
        if extra:
            raise CheckpointError(f"unexpected tensor(s): {prefix}.{extra[0]}.*")
        experts = range(cfg.n_routed_experts)
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts])
        out[prefix + ".down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    return out


def expected_shapes(cfg: GlmMoeDsaConfig) -> dict[str, tuple[int, ...]]:
    """The model's state dict names and shapes (experts stacked)."""
    shapes = {n: s for n, s in cfg.tensor_shapes().items() if EXPERT.fullmatch(n) is None}
    e, h, m = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for i, kind in enumerate(cfg.mlp_layer_types):
        if kind == "sparse":
            shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (e, 2 * m, h)
            shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (e, h, m)
    return shapes


def load_glm_moe_dsa(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
                     pack: bool) -> GlmMoeDsaModel:
    if tp.parallel:
        raise ConfigError("glm_moe_dsa targets do not run tensor-parallel yet (--tp 1)")
    log = logging.getLogger("dflash.target")
    cfg = GlmMoeDsaConfig.from_dict(config)
    compute = resolve_dtype(dtype, "bfloat16" if cfg.fp8 is not None else cfg.checkpoint_dtype, device)
    tensors = stack_experts(read_tensors(folder, cfg, log), cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{str(folder)!r} is missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{str(folder)!r} has unexpected tensor(s): {', '.join(unexpected[:8])}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {name!r} in {str(folder)!r} has shape {list(tensor.shape)}, expected "
                                  f"{list(expected[name])}")
    float32_kept = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router stays float32
    state = {name: t.to(device=device, dtype=torch.float32 if name.endswith(float32_kept) else compute)
             for name, t in tensors.items()}
    with torch.device("meta"):
        model = GlmMoeDsaModel(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(RopeSettings(cfg.rope_theta), cfg.qk_rope_head_dim).to(device)  # not saved
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
