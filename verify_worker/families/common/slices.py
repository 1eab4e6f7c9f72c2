"""Which part of a checkpoint tensor a tensor-parallel rank reads."""

from dataclasses import dataclass

from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import vocab_shard


@dataclass(frozen=True)
class Slice:
    dim: int
    start: int
    stop: int
    padded: int | None = None  # zero-pad dim to this size (the last vocabulary shard)
    whole: int | None = None  # the size along dim of the tensor it is cut from (checked against the file's)


def whole_blocks(cut: Slice | None, block: tuple[int, int]) -> bool:
    """Whether a rank's cut (None: the whole tensor) is a whole number of FP8 blocks along its dimension, so every
    rank's slice starts on a block boundary and every rank keeps the weight FP8 alike."""
    return cut is None or (cut.padded is None and (cut.stop - cut.start) % block[cut.dim] == 0)


def even_slice(dim: int, size: int, tp: TensorParallel) -> Slice:
    """This rank's contiguous 1/N of `size` (which N divides) along dim."""
    local = size // tp.world_size
    return Slice(dim, tp.rank * local, (tp.rank + 1) * local, whole=size)


def vocab_slice(vocab_size: int, tp: TensorParallel) -> Slice:
    shard = vocab_shard(vocab_size, tp.world_size)
    start = tp.rank * shard
    return Slice(0, min(start, vocab_size), min(start + shard, vocab_size), padded=shard, whole=vocab_size)


def mlp_slices(plan: dict[str, Slice], cfg, layer: int, tp: TensorParallel) -> None:
    """Add the MLP slices of one layer of an MoE family (cfg: mlp_layer_types, intermediate_size,
    n_routed_experts, moe_intermediate_size, n_shared_experts): gate and up split by rows, down by columns, in
    the dense MLP, each routed expert and the shared experts."""
    prefix = f"model.layers.{layer}.mlp."

    def gated(name: str, inner: int) -> None:
        plan[name + "gate_proj.weight"] = plan[name + "up_proj.weight"] = even_slice(0, inner, tp)
        plan[name + "down_proj.weight"] = even_slice(1, inner, tp)

    if cfg.mlp_layer_types[layer] == "dense":
        gated(prefix, cfg.intermediate_size)
        return
    for expert in range(cfg.n_routed_experts):
        gated(f"{prefix}experts.{expert}.", cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        gated(prefix + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts)
