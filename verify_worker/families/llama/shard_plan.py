"""Which slice of each checkpoint tensor a rank owns. Attention heads and MLP columns are split evenly; KV heads
are split when there are at least as many as ranks and replicated (one per group of ranks) otherwise; the
vocabulary is split in contiguous shards, the last one zero-padded."""

from dataclasses import dataclass

from shared.errors import ConfigError
from verify_worker.families.common.slices import Slice
from verify_worker.families.llama.config import TargetConfig
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import vocab_shard


@dataclass(frozen=True)
class LocalShapes:
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_shard: int
    kv_head_start: int  # the first KV head this rank holds


def local_shapes(cfg: TargetConfig, tp: TensorParallel) -> LocalShapes:
    w, r = tp.world_size, tp.rank
    if cfg.num_heads % w:
        raise ConfigError(f"tensor parallel size {w} does not divide the {cfg.num_heads} attention heads")
    if cfg.intermediate_size % w:
        raise ConfigError(f"tensor parallel size {w} does not divide intermediate_size {cfg.intermediate_size}")
    if cfg.num_kv_heads >= w:
        if cfg.num_kv_heads % w:
            raise ConfigError(f"tensor parallel size {w} does not divide the {cfg.num_kv_heads} KV heads")
        kv_local, kv_start = cfg.num_kv_heads // w, r * cfg.num_kv_heads // w
    else:
        if w % cfg.num_kv_heads:
            raise ConfigError(f"the {cfg.num_kv_heads} KV heads cannot be replicated evenly over {w} ranks")
        kv_local, kv_start = 1, r // (w // cfg.num_kv_heads)
    return LocalShapes(cfg.num_heads // w, kv_local, cfg.intermediate_size // w, vocab_shard(cfg.vocab_size, w),
                       kv_start)


def shard_slices(cfg: TargetConfig, tp: TensorParallel) -> dict[str, Slice]:
    """Checkpoint tensor name -> the slice this rank loads (names absent here are loaded whole)."""
    local = local_shapes(cfg, tp)
    r, hd = tp.rank, cfg.head_dim
    q = Slice(0, r * local.num_heads * hd, (r + 1) * local.num_heads * hd)
    kv = Slice(0, local.kv_head_start * hd, (local.kv_head_start + local.num_kv_heads) * hd)
    o = Slice(1, q.start, q.stop)
    cols = Slice(0, r * local.intermediate_size, (r + 1) * local.intermediate_size)
    down = Slice(1, cols.start, cols.stop)
    vocab_start = r * local.vocab_shard
    vocab = Slice(0, min(vocab_start, cfg.vocab_size), min(vocab_start + local.vocab_shard, cfg.vocab_size),
                  padded=local.vocab_shard)
    plan = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            plan[f"{p}self_attn.q_proj.{suffix}"] = q
            plan[f"{p}self_attn.k_proj.{suffix}"] = kv
            plan[f"{p}self_attn.v_proj.{suffix}"] = kv
            plan[f"{p}mlp.gate_proj.{suffix}"] = cols
            plan[f"{p}mlp.up_proj.{suffix}"] = cols
        plan[f"{p}self_attn.o_proj.weight"] = o  # row-parallel: the bias stays whole, added once after the sum
        plan[f"{p}mlp.down_proj.weight"] = down
    return plan
