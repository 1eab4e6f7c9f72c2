"""Tensor parallelism for glm_moe_dsa: attention heads (q_b, kv_b rows; o_proj columns) and MLP / expert
columns (gate, up rows; down columns) are split evenly; the latent projections, the norms, the indexer and the
router are replicated (every rank computes the same latent, selection and routing from the whole residual
stream); the vocabulary is split in contiguous shards."""

from dataclasses import dataclass

from shared.errors import ConfigError
from verify_worker.families.common.slices import Slice, even_slice, mlp_slices, vocab_slice
from verify_worker.families.glm_moe_dsa.config import GlmMoeDsaConfig
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import vocab_shard


@dataclass(frozen=True)
class LocalShapes:
    num_heads: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int  # each routed expert (the shared experts: times n_shared_experts)
    vocab_shard: int


def local_shapes(cfg: GlmMoeDsaConfig, tp: TensorParallel) -> LocalShapes:
    w = tp.world_size
    for what, size in (("attention heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                       ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if size % w:
            raise ConfigError(f"tensor parallel size {w} does not divide the {size} {what}")
    return LocalShapes(cfg.num_heads // w, cfg.intermediate_size // w, cfg.moe_intermediate_size // w,
                       vocab_shard(cfg.vocab_size, w))


def shard_slices(cfg: GlmMoeDsaConfig, tp: TensorParallel) -> dict[str, Slice]:
    """Checkpoint tensor name -> the slice this rank reads (names absent here are read whole)."""
    local_shapes(cfg, tp)  # the divisibility checks
    heads = lambda per_head, dim: even_slice(dim, cfg.num_heads * per_head, tp)  # noqa: E731
    vocab = vocab_slice(cfg.vocab_size, tp)
    plan = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        plan[p + "self_attn.q_b_proj.weight"] = heads(cfg.qk_head_dim, 0)
        plan[p + "self_attn.kv_b_proj.weight"] = heads(cfg.qk_nope_head_dim + cfg.v_head_dim, 0)
        plan[p + "self_attn.o_proj.weight"] = heads(cfg.v_head_dim, 1)
        mlp_slices(plan, cfg, i, tp)
    return plan
