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
    """'auto' = float32 on CPU (exact and fast there), the checkpoint's dtype on an accelerator."""
    if name == "auto":
        name = "float32" if str(device).startswith("cpu") else checkpoint_dtype
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported (choose from {', '.join(DTYPES)} or auto)")
    return DTYPES[name]


def load_target(folder: str | Path, device: str = "cpu", dtype: str = "auto",
                tp: TensorParallel = TensorParallel()) -> TargetModel:
    """Load a Qwen3/Llama HF checkpoint (at TP N, only this rank's slice of each sharded tensor); any missing,
    unexpected or mis-shaped tensor is a CheckpointError, a shape TP N cannot split a ConfigError."""
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
    return model.eval().requires_grad_(False)
