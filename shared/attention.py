"""Attention over a positional cache, with visibility decided by absolute positions."""

import torch
from torch.nn import functional as F


def visibility_mask(
    query_positions: torch.Tensor,
    key_length: int,
    visible_end: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean mask [batch, 1, queries, keys]: which cached key positions each query sees.

    query_positions: [batch, queries] absolute positions of the queries.
    visible_end: [batch] when given, a query sees every key position < visible_end (bidirectional within a
        block); otherwise it sees key positions <= its own (causal).
    sliding_window: when given, additionally |query - key| < window.
    """
    keys = torch.arange(key_length, device=query_positions.device)  # [keys]
    q = query_positions[:, :, None]  # [batch, queries, 1]
    if visible_end is None:
        mask = keys[None, None, :] <= q
    else:
        mask = (keys[None, None, :] < visible_end[:, None, None]).expand(-1, q.shape[1], -1)
    if sliding_window is not None:
        mask = mask & ((q - keys[None, None, :]).abs() < sliding_window)
    return mask[:, None]  # [batch, 1, queries, keys]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [batch, heads, queries, dim]; k, v [batch, kv_heads, keys, dim]; mask [batch, 1, queries, keys].

    Returns [batch, queries, heads * dim].
    """
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
