"""Strict loading of a GLM-5.2 checkpoint (bf16, or FP8 blocks kept FP8 where the model multiplies them so) into
GlmMoeDsaModel.

Published names: per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj.weight`, stacked here as transformers
stacks them (gate then up). MTP layers (`model.layers.{i}` for i >= num_hidden_layers) are skipped and named in
the log. Anything else unexpected, missing or mis-shaped is a CheckpointError naming it, before a tensor is read
(common/checkpoint_reader.py).
"""

import logging
from pathlib import Path

import torch

from shared.dtype_choice import resolve_dtype
from shared.rope import inverse_frequencies
from shared.rope_settings import RopeSettings
from verify_worker.families.common.checkpoint_reader import load_checkpoint
from verify_worker.families.common.fp8_layout import published_fp8
from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig
from verify_worker.families.glm_moe_dsa.model import GlmMoeDsaModel
from verify_worker.families.glm_moe_dsa.shard_plan import shard_slices
from verify_worker.families.placement import Placement, in_place
from verify_worker.parallel.group import TensorParallel

FLOAT32_KEPT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router stays float32


def glm_moe_dsa_skeleton(config: dict, tp: TensorParallel, dtype: torch.dtype) -> GlmMoeDsaModel:
    """This rank's model on the meta device in dtype, FP8 weights as a published FP8 checkpoint of this config keeps
    them (shapes and dtypes only: what the memory plan counts)."""
    cfg = GlmMoeDsaConfig.from_dict(config)
    with torch.device("meta"):
        model = GlmMoeDsaModel(cfg, tp).to(dtype)
    return published_fp8(model, cfg.fp8, shard_slices(cfg, tp) if tp.parallel else {})


def glm_moe_dsa_placement(config: dict, tp: TensorParallel, dtype: str, device: str) -> Placement:
    """This rank's tensors once load_glm_moe_dsa has run (its parameters, placed once; the router float32)."""
    cfg = GlmMoeDsaConfig.from_dict(config)
    compute = compute_dtype(cfg, dtype, device)
    return in_place(glm_moe_dsa_skeleton(config, tp, compute), compute, FLOAT32_KEPT)


def compute_dtype(cfg: GlmMoeDsaConfig, dtype: str, device: str) -> torch.dtype:
    """An FP8 checkpoint computes in bfloat16 (its FP8 blocks multiplied as W8A16)."""
    return resolve_dtype(dtype, "bfloat16" if cfg.fp8 is not None else cfg.checkpoint_dtype, device)


def load_glm_moe_dsa(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
                     pack: bool) -> GlmMoeDsaModel:
    cfg = GlmMoeDsaConfig.from_dict(config)
    compute = compute_dtype(cfg, dtype, device)
    plan = shard_slices(cfg, tp) if tp.parallel else {}
    with torch.device("meta"):
        model = GlmMoeDsaModel(cfg, tp)
    tied = cfg.tie_word_embeddings
    load_checkpoint(model, folder, lambda name: None if tied and name == "lm_head.weight" else name, cfg.num_layers,
                    plan, cfg.fp8, device, compute, FLOAT32_KEPT,
                    logging.getLogger("dflash.target"))
    model.inv_freq = inverse_frequencies(RopeSettings(cfg.rope_theta), cfg.qk_rope_head_dim).to(device)  # not saved
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
