"""The weights of draft_walk.cpp's one call (CpuKernels.draft_greedy_walk: a DFlash 2 drafter's greedy drafts from
its block's hidden states), checked once when the proposer is built: the C++ code trusts them. The ctypes
structure mirrors the C++ struct field by field."""

import ctypes
from dataclasses import dataclass

import torch

from shared.cpu_kernels.arguments import check_arguments, tiles_of

_pointer, _count = ctypes.c_void_p, ctypes.c_int64


class DraftWalk(ctypes.Structure):
    _fields_ = [("hidden", _count), ("vocab", _count), ("top_k", _count), ("rank", _count),
                ("selector_vocab", _count), ("amx", _count), ("lm_head", _pointer), ("projection", _pointer),
                ("predecessor", _pointer), ("successor", _pointer)]


@dataclass(frozen=True)
class DraftWalkWeights:
    """The lm_head and the selector's hidden projection as bfloat16 tiles of one layout (amx: the "amx" one), the
    selector's codebooks [selector_vocab, rank] float32, and the candidates a row (top_k <= vocab). Holds the
    tensors the C structure points into."""

    lm_head: torch.Tensor
    projection: torch.Tensor
    predecessor: torch.Tensor
    successor: torch.Tensor
    c_weights: DraftWalk

    @classmethod
    def of(cls, lm_head: torch.Tensor, vocab: int, projection: torch.Tensor, predecessor: torch.Tensor,
           successor: torch.Tensor, top_k: int, amx: bool) -> "DraftWalkWeights":
        hidden, rank = lm_head.shape[1], predecessor.shape[1]
        ok = (lm_head.dtype == projection.dtype == torch.bfloat16 and lm_head.is_contiguous()
              and projection.is_contiguous() and tiles_of(lm_head, hidden, vocab) and tiles_of(projection, hidden, rank)
              and predecessor.dtype == successor.dtype == torch.float32 and predecessor.shape == successor.shape
              and predecessor.is_contiguous() and successor.is_contiguous() and predecessor.shape[0] >= vocab
              and 1 <= top_k <= vocab)
        check_arguments(ok, "draft walk weights", lm_head, projection, predecessor, successor)
        c_weights = DraftWalk(hidden, vocab, top_k, rank, predecessor.shape[0], amx, lm_head.data_ptr(),
                              projection.data_ptr(), predecessor.data_ptr(), successor.data_ptr())
        return cls(lm_head, projection, predecessor, successor, c_weights)
