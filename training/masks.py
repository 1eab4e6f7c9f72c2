"""Pure functions of the training layout: which keys each block row sees, and the loss weight of each row."""

import math

import torch


def block_visibility(anchors: torch.Tensor, context_len: int, block_size: int,
                     block_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask [A * B, S + A * B] for A blocks of B rows laid out after S context rows.

    A row of block i sees context position j only when j < anchors[i] (the anchor's own features do not exist
    at inference: it is the last committed token, whose features arrive with the next verify), every row of
    its own block below block_lengths[i] (default B), and nothing of any other block. Visibility is decided
    by the anchor's position, never by the block's index.
    """
    a, b = len(anchors), block_size
    lengths = block_lengths if block_lengths is not None else torch.full((a,), b)
    context = torch.arange(context_len)[None, :] < anchors[:, None]  # [A, S]
    context = context.repeat_interleave(b, dim=0)  # [A*B, S]
    block_of_row = torch.arange(a).repeat_interleave(b)  # [A*B]
    row_in_block = torch.arange(b).repeat(a)  # [A*B]
    same_block = block_of_row[:, None] == block_of_row[None, :]  # [A*B, A*B]
    key_live = row_in_block < lengths[block_of_row]  # [A*B]
    return torch.cat([context, same_block & key_live[None, :]], dim=1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for block rows k = 1..B-1; row 0 (the anchor) has weight 0. [B]"""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def default_gamma(block_size: int) -> float:
    return 7.0 if block_size >= 16 else 4.0 if block_size >= 8 else max(1.0, math.sqrt(block_size))
