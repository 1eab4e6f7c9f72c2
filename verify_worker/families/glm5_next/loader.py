"""Strict loading of a GLM-5.3-Flash checkpoint (bf16 / fp32, or FP8 blocks kept FP8 where the model multiplies
them so) into Glm5NextModel.

As published (and as transformers writes it): the text tower under `model.language_model.` (flat `model.` exports
are accepted too), the head at `lm_head.weight`; `hc_attn_*` / `hc_ffn_*` per layer, per-q/k/v conv kernels,
per-expert tensors (stacked here). Skipped and named in the log: the vision tower (`model.visual.`) and the MTP
layer(s) (`layers.{i}` for i >= num_hidden_layers, `shared_head`). Anything else unexpected, missing or
mis-shaped is a CheckpointError naming it, before a tensor is read. The model's own state dict is the loading table
(common/checkpoint_reader.py).
"""

import logging
import re
from pathlib import Path

import torch

from shared.dtype_choice import resolve_dtype
from verify_worker.families.common.checkpoint_reader import load_checkpoint
from verify_worker.families.common.config_parts import Fp8Settings
from verify_worker.families.common.fp8_layout import published_fp8
from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.families.glm5_next.model import Glm5NextModel
from verify_worker.families.glm5_next.shard_plan import shard_slices
from verify_worker.families.placement import Placement, in_place
from verify_worker.parallel.group import TensorParallel

TEXT_PREFIX = "model.language_model."
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


def fp8_settings(config: dict) -> Fp8Settings | None:
    return Fp8Settings.from_config(config.get("text_config") or {}) or Fp8Settings.from_config(config)


def glm5_next_skeleton(config: dict, tp: TensorParallel, dtype: torch.dtype) -> Glm5NextModel:
    """This rank's model on the meta device in dtype, FP8 weights as a published FP8 checkpoint of this config keeps
    them (shapes and dtypes only: what the memory plan counts)."""
    cfg = Glm5NextConfig.from_dict(config)
    with torch.device("meta"):
        model = Glm5NextModel(cfg, tp).to(dtype)
    return published_fp8(model, fp8_settings(config), shard_slices(cfg, tp) if tp.parallel else {})


def glm5_next_placement(config: dict, tp: TensorParallel, dtype: str, device: str) -> Placement:
    """This rank's tensors once load_glm5_next has run (its parameters, placed once; FLOAT32_KEPT float32)."""
    compute = compute_dtype(config, dtype, device)
    return in_place(glm5_next_skeleton(config, tp, compute), compute, FLOAT32_KEPT)


def compute_dtype(config: dict, dtype: str, device: str) -> torch.dtype:
    """An FP8 checkpoint computes in bfloat16 (its FP8 blocks multiplied as W8A16)."""
    checkpoint = "bfloat16" if fp8_settings(config) is not None else Glm5NextConfig.from_dict(config).checkpoint_dtype
    return resolve_dtype(dtype, checkpoint, device)


def load_glm5_next(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
                   pack: bool) -> Glm5NextModel:
    cfg = Glm5NextConfig.from_dict(config)
    fp8 = fp8_settings(config)
    compute = compute_dtype(config, dtype, device)
    plan = shard_slices(cfg, tp) if tp.parallel else {}
    with torch.device("meta"):
        model = Glm5NextModel(cfg, tp)
    tied = cfg.tie_word_embeddings
    load_checkpoint(model, folder, lambda name: None if tied and name == "lm_head.weight" else our_name(name),
                    cfg.num_layers, plan, fp8, device, compute, FLOAT32_KEPT,
                    logging.getLogger("dflash.target"))
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
