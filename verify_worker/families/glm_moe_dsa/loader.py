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
from shared.errors import CheckpointError
from shared.rope import inverse_frequencies
from shared.rope_settings import RopeSettings
from verify_worker.families.common.fp8_blocks import dequantize, scale_grid
from verify_worker.families.common.row_invariant import aligned
from verify_worker.families.common.slices import Slice
from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig
from verify_worker.families.glm_moe_dsa.model import GlmMoeDsaModel
from verify_worker.families.glm_moe_dsa.shard_plan import local_shapes, shard_slices
from verify_worker.parallel.group import TensorParallel

LAYER = re.compile(r"model\.layers\.(\d+)\.")
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
SCALE = ".weight_scale_inv"


def read_tensors(folder: str | Path, cfg: GlmMoeDsaConfig, plan: dict[str, Slice],
                 log: logging.Logger) -> dict[str, torch.Tensor]:
    """Every tensor of the text model (at TP N only this rank's slice of each tensor the plan names, the
    matching rows / columns of an FP8 weight's scale grid too), FP8 weights dequantized to float32; MTP
    layers skipped."""
    where, skipped = {}, set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                layer = LAYER.match(name)
                if layer and int(layer.group(1)) >= cfg.num_layers:
                    skipped.add(int(layer.group(1)))
                else:
                    where[name] = path
    if skipped:
        log.info("skipping the multi-token-prediction layer(s) %s (not used for verification)", sorted(skipped))
    scales = {name[: -len(SCALE)] + ".weight": name for name in where if name.endswith(SCALE)}
    if scales and cfg.fp8 is None:
        raise CheckpointError(f"{str(folder)!r} has FP8 scales ({next(iter(scales.values()))}) but its config.json "
                              "has no quantization_config")
    out = {}
    for name, path in where.items():
        if name.endswith(SCALE):
            continue
        with safe_open(str(path), framework="pt") as handle:
            cut = plan.get(name)
            tensor = handle.get_tensor(name) if cut is None else read_slice(handle.get_slice(name), cut)
            if name in scales:
                tensor = dequantize_slice(tensor, handle.get_slice(name).get_shape(), where[scales[name]],
                                          scales[name], cut, cfg.fp8.block)
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise CheckpointError(f"{str(folder)!r}: FP8 tensor {name} has no weight_scale_inv")
        out[name] = tensor
    orphans = [scale for weight, scale in scales.items() if weight not in where]
    if orphans:
        raise CheckpointError(f"{str(folder)!r} has {orphans[0]} but no {orphans[0][: -len(SCALE)]}.weight")
    return out


def read_slice(view, cut: Slice) -> torch.Tensor:
    tensor = view[(slice(None),) * cut.dim + (slice(cut.start, cut.stop),)]
    if cut.padded is not None and tensor.shape[cut.dim] < cut.padded:
        pad = list(tensor.shape)
        pad[cut.dim] = cut.padded - tensor.shape[cut.dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], cut.dim)
    return tensor


def dequantize_slice(weight: torch.Tensor, full_shape, scale_path: Path, scale_name: str, cut: Slice | None,
                     block: tuple[int, int]) -> torch.Tensor:
    """weight (the whole stored tensor, or the slice `cut` of it) times the scales of the blocks that cover it."""
    name = scale_name[: -len(SCALE)] + ".weight"
    with safe_open(str(scale_path), framework="pt") as handle:
        view = handle.get_slice(scale_name)
        grid = tuple(view.get_shape())
        if len(full_shape) != 2 or grid != scale_grid(tuple(full_shape), block):
            raise CheckpointError(f"{name}: scale grid {list(grid)} does not fit a {list(full_shape)} weight in "
                                  f"blocks of {list(block)} (expected {list(scale_grid(tuple(full_shape), block))})")
        if cut is None:
            return dequantize(weight, view[:, :], block, name)
        first, last = cut.start // block[cut.dim], -(-cut.stop // block[cut.dim])
        scale = view[(slice(None),) * cut.dim + (slice(first, last),)]
        offset = (cut.start, 0) if cut.dim == 0 else (0, cut.start)
        return dequantize(weight, scale, block, name, offset)


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
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")], parts[(e, "up")]])
                                                     for e in experts])
        out[prefix + ".down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    return out


def expected_shapes(cfg: GlmMoeDsaConfig, tp: TensorParallel) -> dict[str, tuple[int, ...]]:
    """This rank's state dict names and shapes (experts stacked, sharded tensors cut to its slice)."""
    shapes = {}
    plan = shard_slices(cfg, tp) if tp.parallel else {}
    for name, shape in cfg.tensor_shapes().items():
        cut = plan.get(name)
        if cut is not None:
            shape = tuple(cut.padded or cut.stop - cut.start if d == cut.dim else n for d, n in enumerate(shape))
        if EXPERT.fullmatch(name) is None:
            shapes[name] = shape
    e, h, m = cfg.n_routed_experts, cfg.hidden_size, local_shapes(cfg, tp).moe_intermediate_size
    for i, kind in enumerate(cfg.mlp_layer_types):
        if kind == "sparse":
            shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (e, 2 * m, h)
            shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (e, h, m)
    return shapes


def load_glm_moe_dsa(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
                     pack: bool) -> GlmMoeDsaModel:
    log = logging.getLogger("dflash.target")
    cfg = GlmMoeDsaConfig.from_dict(config)
    compute = resolve_dtype(dtype, "bfloat16" if cfg.fp8 is not None else cfg.checkpoint_dtype, device)
    plan = shard_slices(cfg, tp) if tp.parallel else {}
    tensors = stack_experts(read_tensors(folder, cfg, plan, log), cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = expected_shapes(cfg, tp)
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
    # fresh allocations: a tensor read from a file may sit at any offset, and a GEMM's roundings depend on
    # its operands' alignment (the same weights loaded twice would differ in the last bits)
    state = {name: aligned(t.to(device=device, dtype=torch.float32 if name.endswith(float32_kept) else compute))
             for name, t in tensors.items()}
    with torch.device("meta"):
        model = GlmMoeDsaModel(cfg, tp)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(RopeSettings(cfg.rope_theta), cfg.qk_rope_head_dim).to(device)  # not saved
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
