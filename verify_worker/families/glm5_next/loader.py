"""Strict loading of a GLM-5.3-Flash checkpoint (bf16 / fp32, or FP8 blocks dequantized at load) into
Glm5NextModel.

As published (and as transformers writes it): the text tower under `model.language_model.` (flat `model.` exports
are accepted too), the head at `lm_head.weight`; `hc_attn_*` / `hc_ffn_*` per layer, per-q/k/v conv kernels,
per-expert tensors (stacked here). Skipped and named in the log: the vision tower (`model.visual.`) and the MTP
layer(s) (`layers.{i}` for i >= num_hidden_layers, `shared_head`). Anything else unexpected, missing or
mis-shaped is a CheckpointError naming it. The model's own state dict is the loading table.
"""

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from shared.checkpoint_io import safetensors_files
from shared.dtype_choice import resolve_dtype
from shared.errors import CheckpointError
from verify_worker.families.common.row_invariant import aligned
from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.families.glm5_next.model import Glm5NextModel
from verify_worker.families.glm5_next.shard_plan import shard_slices
from verify_worker.families.glm_moe_dsa.config import Fp8Settings
from verify_worker.families.glm_moe_dsa.loader import SCALE, dequantize_slice, read_slice, stack_experts
from verify_worker.parallel.group import TensorParallel

TEXT_PREFIX = "model.language_model."
LAYER = re.compile(r"model\.layers\.(\d+)\.")
HYPER = re.compile(r"(model\.layers\.\d+\.)hc_(attn|ffn)_(fn|base|scale)")
FLOAT32_KEPT = ("mlp.gate.weight", "e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log", "hc.base",
                "hc.scale", "hc.fn")


def our_name(name: str) -> str | None:
    """The checkpoint name in our module tree, or None for what verification does not use."""
    if name.startswith("model.visual.") or ".shared_head." in name:
        return None
    if name.startswith(TEXT_PREFIX):
        name = "model." + name[len(TEXT_PREFIX):]
    return HYPER.sub(lambda m: f"{m.group(1)}{m.group(2)}_hc.{m.group(3)}", name)


def load_glm5_next(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
                   pack: bool) -> Glm5NextModel:
    log = logging.getLogger("dflash.target")
    cfg = Glm5NextConfig.from_dict(config)
    fp8 = Fp8Settings.from_config(config.get("text_config") or {}) or Fp8Settings.from_config(config)
    compute = resolve_dtype(dtype, "bfloat16" if fp8 is not None else cfg.checkpoint_dtype, device)
    plan = shard_slices(cfg, tp) if tp.parallel else {}
    where, skipped, mtp = {}, 0, set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                ours = our_name(name)
                layer = LAYER.match(ours or "")
                if ours is None:
                    skipped += 1
                elif layer and int(layer.group(1)) >= cfg.num_layers:
                    mtp.add(int(layer.group(1)))
                else:
                    where[name] = path
    scales = {name[: -len(SCALE)] + ".weight": name for name in where if name.endswith(SCALE)}
    if scales and fp8 is None:
        raise CheckpointError(f"{str(folder)!r} has FP8 scales ({next(iter(scales.values()))}) but its config.json "
                              "has no quantization_config")
    tensors = {}
    for name, path in where.items():
        if name.endswith(SCALE):
            continue
        ours, cut = our_name(name), plan.get(our_name(name))
        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(name) if cut is None else read_slice(handle.get_slice(name), cut)
            if name in scales:  # FP8 blocks: dequantized with the scales that cover this rank's part
                tensor = dequantize_slice(tensor, handle.get_slice(name).get_shape(), where[scales[name]],
                                          scales[name], cut, fp8.block)
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise CheckpointError(f"{str(folder)!r}: FP8 tensor {name} has no weight_scale_inv")
        tensors[ours] = tensor
    orphans = [scale for weight, scale in scales.items() if weight not in where]
    if orphans:
        raise CheckpointError(f"{str(folder)!r} has {orphans[0]} but no {orphans[0][: -len(SCALE)]}.weight")
    if skipped:
        log.info("skipping %d vision-tower tensor(s) (model.visual.*): the verify worker serves text", skipped)
    if mtp:
        log.info("skipping the multi-token-prediction layer(s) %s (not used for verification)", sorted(mtp))
    tensors = stack_experts(tensors, cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Glm5NextModel(cfg, tp)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{str(folder)!r} is missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{str(folder)!r} has unexpected tensor(s): {', '.join(unexpected[:8])}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"tensor {name!r} in {str(folder)!r} has shape {list(tensor.shape)}, expected "
                                  f"{list(expected[name])}")
    # fresh allocations: a tensor read from a file may sit at any offset, and a GEMM's roundings depend on
    # its operands' alignment (the same weights loaded twice would differ in the last bits)
    state = {name: aligned(t.to(device=device, dtype=torch.float32 if name.endswith(FLOAT32_KEPT) else compute))
             for name, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
