"""The PyTorch reference of the drafter's block attention (the test oracle; on CPU the drafter keeps its own
paths: shared.attention.cached_attention, or the C++ CPU kernels' attention)."""

import torch

from shared.attention import cached_attention, visibility_mask


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                    ends: torch.Tensor, positions: torch.Tensor, window: int, causal: bool, scale: float):
    """q [b, heads, queries, dim]; one layer's cache keys, values [slots, kv_heads, capacity, dim]; slots [b];
    ends [b] (keys before them are visible, the whole block included); positions [b, queries]; window 0 = none.
    Returns [b, queries, heads * dim]."""
    length = max(int(ends.max()), 1) if len(ends) else 1
    k, v = keys[slots, :, :length], values[slots, :, :length]  # [b, kv_heads, length, dim]
    window = window or None
    if causal:
        mask = visibility_mask(positions, length, sliding_window=window) & visibility_mask(positions, length, ends)
    else:
        mask = visibility_mask(positions, length, visible_end=ends, sliding_window=window)
    out = cached_attention(q, k, v, mask, scale)
    sees = mask[:, 0].any(-1)[..., None]  # [b, queries, 1]
    return torch.where(sees, out, torch.zeros_like(out))  # a row that sees no key: zeros (SDPA gives NaN)
