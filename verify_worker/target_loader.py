"""Strict loading of a target checkpoint folder into TargetModel."""

from pathlib import Path

import torch

from shared.checkpoint_io import DTYPES, check_tensor_names, load_tensor_slices, read_config
from shared.errors import ConfigError
from shared.rope import inverse_frequencies
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.shard_plan import shard_slices
from verify_worker.target_config import TargetConfig
from verify_worker.target_model import TargetModel


def resolve_dtype(name: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """'auto' = the checkpoint's dtype on an accelerator; on CPU, bfloat16 for a bfloat16 checkpoint when the CPU
    multiplies bfloat16 natively (AVX512-BF16 or AMX: an 8-token verify block then costs about as much as one
    token), else float32 (float16 and emulated bfloat16 are slow there)."""
    if name == "auto":
        on_cpu = str(device).startswith("cpu")
        name = checkpoint_dtype if not on_cpu or (checkpoint_dtype == "bfloat16" and native_cpu_bfloat16()) \
            else "float32"
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported (choose from {', '.join(DTYPES)} or auto)")
    return DTYPES[name]


def native_cpu_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). oneDNN's own bf16 check also
    accepts plain AVX512, where bfloat16 is emulated (slow, and its row invariance is not checked)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def load_target(folder: str | Path, device: str = "cpu", dtype: str = "auto",
                tp: TensorParallel = TensorParallel(), pack: bool = True) -> TargetModel:
    """Load a Qwen3/Llama HF checkpoint (at TP N, only this rank's slice of each sharded tensor); any missing,
    unexpected or mis-shaped tensor is a CheckpointError, a shape TP N cannot split a ConfigError. pack: fuse
    the projections for inference (TargetModel.pack); False keeps the checkpoint's modules and names."""
    cfg = TargetConfig.from_dict(read_config(folder))
    optional = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    check_tensor_names(folder, cfg.tensor_shapes(), optional)
    slices = shard_slices(cfg, tp) if tp.parallel else {}
    tensors = load_tensor_slices(folder, slices, dtype=resolve_dtype(dtype, cfg.checkpoint_dtype, device),
                                 device=device)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = TargetModel(cfg, tp)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(device)  # buffers are not in the checkpoint
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
