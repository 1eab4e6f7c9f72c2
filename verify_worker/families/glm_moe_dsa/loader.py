"""Strict loading of a GLM-5.2 checkpoint (bf16, or FP8 blocks dequantized once at load) into GlmMoeDsaModel.

Published names: per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj.weight`, stacked here as transformers
stacks them (gate then up). MTP layers (`model.layers.{i}` for i >= num_hidden_layers) are skipped and named in
the log. Anything else unexpected, missing or mis-shaped is a CheckpointError naming it.
"""

import logging
from pathlib import Path

import torch

from shared.dtype_choice import resolve_dtype
from shared.rope import inverse_frequencies
from shared.rope_settings import RopeSettings
from verify_worker.families.common.checkpoint_reader import EXPERT, placed, read_checkpoint, stack_experts
from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig
from verify_worker.families.glm_moe_dsa.model import GlmMoeDsaModel
from verify_worker.families.glm_moe_dsa.shard_plan import local_shapes, shard_slices
from verify_worker.parallel.group import TensorParallel

FLOAT32_KEPT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router stays float32


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


def glm_moe_dsa_skeleton(config: dict, tp: TensorParallel) -> GlmMoeDsaModel:
    """This rank's model on the meta device (shapes only: what the memory plan counts)."""
    with torch.device("meta"):
        return GlmMoeDsaModel(GlmMoeDsaConfig.from_dict(config), tp)


def load_glm_moe_dsa(folder: str | Path, config: dict, device: str, dtype: str, tp: TensorParallel,
                     pack: bool) -> GlmMoeDsaModel:
    cfg = GlmMoeDsaConfig.from_dict(config)
    compute = resolve_dtype(dtype, "bfloat16" if cfg.fp8 is not None else cfg.checkpoint_dtype, device)
    plan = shard_slices(cfg, tp) if tp.parallel else {}
    tensors = read_checkpoint(folder, lambda name: name, cfg.num_layers, plan, cfg.fp8.block if cfg.fp8 else None,
                              logging.getLogger("dflash.target"))
    tensors = stack_experts(tensors, cfg.n_routed_experts)
    expected = expected_shapes(cfg, tp)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    state = placed(folder, tensors, expected, device, compute, FLOAT32_KEPT)
    with torch.device("meta"):
        model = GlmMoeDsaModel(cfg, tp)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inverse_frequencies(RopeSettings(cfg.rope_theta), cfg.qk_rope_head_dim).to(device)  # not saved
    model = model.eval().requires_grad_(False)
    return model.pack() if pack else model
