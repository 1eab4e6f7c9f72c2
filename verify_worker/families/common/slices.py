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


def even_slice(dim: int, size: int, tp: TensorParallel) -> Slice:
    """This rank's contiguous 1/N of `size` (which N divides) along dim."""
    local = size // tp.world_size
    return Slice(dim, tp.rank * local, (tp.rank + 1) * local)


def vocab_slice(vocab_size: int, tp: TensorParallel) -> Slice:
    shard = vocab_shard(vocab_size, tp.world_size)
    start = tp.rank * shard
    return Slice(0, min(start, vocab_size), min(start + shard, vocab_size), padded=shard)
