"""Strict loading of a Qwen3/Llama checkpoint folder into TargetModel."""

from pathlib import Path

import torch

from cuda_ext.row_attention.op import MAX_HEAD_DIM as ROW_ATTENTION_MAX_HEAD_DIM
from cuda_ext.row_gemm import op as row_gemm
from shared.checkpoint_io import check_tensor_names, load_tensor_slices
from shared.errors import ConfigError
from shared.packed_linear import ROWS_LAYOUT
from shared.rope import inverse_frequencies
from verify_worker.families.llama.config import TargetConfig
from verify_worker.families.llama.model import TargetModel
from verify_worker.families.llama.placement import llama_dtypes
from verify_worker.families.llama.shard_plan import shard_slices
from verify_worker.parallel.group import TensorParallel


def load_llama(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
               pack: bool, batch_invariant: bool = False) -> TargetModel:
    """At TP N, only this rank's slice of each sharded tensor is read; any missing, unexpected or mis-shaped
    tensor is a CheckpointError, a shape TP N cannot split a ConfigError. batch_invariant: packed in the rows
    layout (TargetModel.pack), on a GPU through the row GEMM of cuda_ext, which must take every projection."""
    cfg = TargetConfig.from_dict(config)
    optional = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    check_tensor_names(folder, cfg.tensor_shapes(), optional)
    slices = shard_slices(cfg, tp) if tp.parallel else {}
    chosen = llama_dtypes(cfg, dtype, device, pack, batch_invariant)
    tensors = load_tensor_slices(folder, slices, dtype=chosen.compute, device=device)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model = assemble_llama(cfg, tensors, device, tp)
    model.kv_dtype = chosen.kv
    if not pack:
        return model
    if not batch_invariant:
        return model.pack(chosen.layout)
    model.pack(ROWS_LAYOUT)
    if str(device).startswith("cuda"):
        check_row_kernels_take(model)
    return model


def check_row_kernels_take(model: TargetModel) -> None:
    """A ConfigError naming what stops cuda_ext's row GEMM or row attention from taking the model on its GPU (not
    bfloat16, a width that is not a multiple of 16, no CUDA build or a build that failed its check): another
    path's rows would depend on the batch again."""
    if model.embed_weight.dtype != torch.bfloat16 or (model.kv_dtype or torch.bfloat16) != torch.bfloat16:
        raise ConfigError(f"--batch-invariant on a GPU needs a bfloat16 model and cache (--dtype bfloat16, or auto on a "
                          f"bfloat16 checkpoint), not {model.embed_weight.dtype}")
    if model.config.head_dim > ROW_ATTENTION_MAX_HEAD_DIM:
        raise ConfigError(f"--batch-invariant: the row attention takes head sizes up to {ROW_ATTENTION_MAX_HEAD_DIM}, "
                          f"not {model.config.head_dim}")
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "multiply", None) is None or weight is None:
            continue
        probe = weight.new_zeros(1, weight.shape[1])
        if not row_gemm.usable(probe, weight):
            raise ConfigError(
                f"--batch-invariant: the row GEMM (cuda_ext/row_gemm) cannot take {name} "
                f"({weight.dtype}, [{weight.shape[0]}, {weight.shape[1]}]) on {weight.device}: it needs widths that are "
                f"multiples of {row_gemm.TILE} and the CUDA build of cuda_ext (nvcc) passing its first-use check (see "
                f"the log)")


def llama_skeleton(config: dict, tp: TensorParallel, dtype: torch.dtype) -> TargetModel:
    """This rank's TargetModel on the meta device in dtype (shapes and dtypes only: what the memory plan counts)."""
    with torch.device("meta"):
        return TargetModel(TargetConfig.from_dict(config), tp).to(dtype)


def assemble_llama(cfg: TargetConfig, tensors: dict[str, torch.Tensor], device: str,
                   tp: TensorParallel = TensorParallel()) -> TargetModel:
    """An unpacked TargetModel for inference holding `tensors` (the checkpoint's names, already on `device`)
    themselves: no module is first built with weights of its own."""
    with torch.device("meta"):
        model = TargetModel(cfg, tp)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(device)  # buffers are not in the checkpoint
    return model.eval().requires_grad_(False)
