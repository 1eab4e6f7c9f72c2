"""Strict loading of a Qwen3/Llama checkpoint folder into TargetModel."""

from pathlib import Path

import torch

from shared.checkpoint_io import check_tensor_names, load_tensor_slices
from shared.dtype_choice import kv_cache_dtype, resolve_dtype
from shared.packed_linear import float32_kernels_run, kernel_layout
from shared.rope import inverse_frequencies
from verify_worker.families.llama.config import TargetConfig
from verify_worker.families.llama.model import TargetModel
from verify_worker.families.llama.shard_plan import shard_slices
from verify_worker.parallel.group import TensorParallel


def load_llama(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
               pack: bool) -> TargetModel:
    """At TP N, only this rank's slice of each sharded tensor is read; any missing, unexpected or mis-shaped
    tensor is a CheckpointError, a shape TP N cannot split a ConfigError."""
    cfg = TargetConfig.from_dict(config)
    optional = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    check_tensor_names(folder, cfg.tensor_shapes(), optional)
    slices = shard_slices(cfg, tp) if tp.parallel else {}
    kernels = pack and float32_kernels_run(device)
    compute = resolve_dtype(dtype, cfg.checkpoint_dtype, device, kernels)
    tensors = load_tensor_slices(folder, slices, dtype=compute, device=device)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model = assemble_llama(cfg, tensors, device, tp)
    model.kv_dtype = kv_cache_dtype(dtype, cfg.checkpoint_dtype, compute, kernels)
    return model.pack(kernel_layout(dtype, cfg.checkpoint_dtype, device)) if pack else model


def assemble_llama(cfg: TargetConfig, tensors: dict[str, torch.Tensor], device: str,
                   tp: TensorParallel = TensorParallel()) -> TargetModel:
    """An unpacked TargetModel for inference holding `tensors` (the checkpoint's names, already on `device`)
    themselves: no module is first built with weights of its own."""
    with torch.device("meta"):
        model = TargetModel(cfg, tp)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(device)  # buffers are not in the checkpoint
    return model.eval().requires_grad_(False)
