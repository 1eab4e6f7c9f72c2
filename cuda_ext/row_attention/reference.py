"""The row attention's contract in PyTorch, the test oracle: causal attention of each query over its request's
cached keys [0, position + 1), float32 arithmetic, the result [batch, queries, heads * dim] in float32."""

import torch

from shared.attention import cached_attention, visibility_mask


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor, key_length: int, scale: float) -> torch.Tensor:
    """q [b, heads, queries, dim]; one layer's cache keys, values [slots, kv_heads, capacity, dim]; slots [b];
    positions [b, queries]; key_length: at least every position + 1."""
    k = keys[slots, :, :key_length].float()  # [b, kv_heads, key_length, dim]
    v = values[slots, :, :key_length].float()
    return cached_attention(q.float(), k, v, visibility_mask(positions, key_length), scale)
