"""Sharded layers. Column-parallel = an nn.Linear holding a slice of the output features (no communication);
the classes here add the communication: a row-parallel linear sums partial products over the ranks, the
vocab-parallel embedding and lm_head own a contiguous slice of the vocabulary."""

import torch
from torch import nn
from torch.nn import functional as F

from verify_worker.parallel.group import TensorParallel


class RowParallelLinear(nn.Linear):
    """Holds weight[:, in_slice]; x holds the matching input slice. Output: the full sum, bias added once."""

    def __init__(self, in_local: int, out_features: int, tp: TensorParallel, bias: bool):
        super().__init__(in_local, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))  # [..., out]
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Holds rows [start, start + shard) of the embedding (the last shard zero-padded)."""

    def __init__(self, shard: int, hidden: int, tp: TensorParallel):
        super().__init__(shard, hidden)
        self.tp, self.start = tp, tp.rank * shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [..., hidden]
        return self.tp.all_reduce(x.masked_fill(outside[..., None], 0))


def vocab_shard(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def gather_vocab_logits(local_logits: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """[..., shard] per rank -> [..., vocab] (padding rows of the last shard dropped)."""
    return tp.all_gather_last(local_logits)[..., :vocab_size]
