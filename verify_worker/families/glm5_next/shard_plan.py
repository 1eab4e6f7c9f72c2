"""Tensor parallelism for glm5_next: KDA heads (their q/k/v projections and conv channels, forget-gate and
output-gate rows, dt_bias, A_log, beta rows; o_proj columns), MLA heads and MLP / expert columns are split
evenly; the mHC mixers, the norms, the low-rank gate inputs (f_a, g_a), the latent projections, the indexer and
the router are replicated; the vocabulary is split in contiguous shards."""

from dataclasses import dataclass

from shared.errors import ConfigError
from verify_worker.families.common.slices import Slice, even_slice, mlp_slices, vocab_slice
from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import vocab_shard


@dataclass(frozen=True)
class LocalShapes:
    num_heads: int  # MLA heads
    linear_num_heads: int  # KDA heads
    intermediate_size: int
    moe_intermediate_size: int
    vocab_shard: int


def local_shapes(cfg: Glm5NextConfig, tp: TensorParallel) -> LocalShapes:
    w = tp.world_size
    for what, size in (("attention heads", cfg.num_heads), ("KDA heads", cfg.linear_num_heads),
                       ("intermediate_size", cfg.intermediate_size),
                       ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if size % w:
            raise ConfigError(f"tensor parallel size {w} does not divide the {size} {what}")
    return LocalShapes(cfg.num_heads // w, cfg.linear_num_heads // w, cfg.intermediate_size // w,
                       cfg.moe_intermediate_size // w, vocab_shard(cfg.vocab_size, w))


def shard_slices(cfg: Glm5NextConfig, tp: TensorParallel) -> dict[str, Slice]:
    """Our tensor name (after the checkpoint's renames) -> the slice this rank reads."""
    local_shapes(cfg, tp)
    vocab = vocab_slice(cfg.vocab_size, tp)
    plan = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
    kda = even_slice(0, cfg.linear_dim, tp)

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.layer_types[i] == "linear":
            for name in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj", "g_b_proj"):
                plan[f"{p}self_attn.{name}.weight"] = kda
            plan[p + "self_attn.dt_bias"] = kda
            plan[p + "self_attn.A_log"] = plan[p + "self_attn.b_proj.weight"] = even_slice(0, cfg.linear_num_heads, tp)
            plan[p + "self_attn.o_proj.weight"] = even_slice(1, cfg.linear_dim, tp)
        else:
            plan[p + "self_attn.q_b_proj.weight"] = even_slice(0, cfg.num_heads * cfg.qk_nope_head_dim, tp)
            plan[p + "self_attn.kv_b_proj.weight"] = even_slice(
                0, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), tp)
            plan[p + "self_attn.o_proj.weight"] = even_slice(1, cfg.num_heads * cfg.v_head_dim, tp)
        mlp_slices(plan, cfg, i, tp)
    return plan
