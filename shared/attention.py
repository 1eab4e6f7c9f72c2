"""Attention over a positional cache, with visibility decided by absolute positions."""

import torch
from torch.nn import functional as F

KEY_CHUNK = 64  # batch-invariant attention reads keys in whole chunks of this many positions
QUERY_CHUNK = 128  # and scores at most this many queries at once (float32 scores: [.., queries, keys])


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


def batch_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """The same result as cached_attention, computed so that each query row's output does not depend on how
    many other query rows share the call or on masked-out keys beyond its own (the reduced-precision path of
    HF's eager attention: bf16 scores, a float32 softmax, bf16 probabilities).

    On CPU, torch's fused SDPA kernel blocks its work by the number of queries and keys, so a verify block of 8
    tokens and 8 one-token decode steps give different roundings; in bfloat16 those differences flip near-tied
    greedy tokens (7 of 16 demo-pair continuations differed from plain decoding). Its matmuls are bfloat16
    oneDNN GEMMs, whose rows are computed alike whatever the row count in the common case only (a batched
    matmul of 2 entries rounds differently from one of 4 in rare rows: see
    docs/decisions/0001-bfloat16-on-cpu-bit-for-bit.md; cuda_ext/row_attention is exact by construction), and the caller passes key lengths rounded up to
    KEY_CHUNK, so masked extra keys only add exact zeros.

    q [batch, heads, queries, dim]; k, v [batch, kv_heads, keys, dim]; mask [batch, 1, queries, keys].
    Returns [batch, queries, heads * dim].
    """
    if q.shape[2] > QUERY_CHUNK:  # a long prefill: bounded memory, and rows are independent anyway
        return torch.cat([batch_invariant_attention(q[:, :, i: i + QUERY_CHUNK], k, v, mask[:, :, i: i + QUERY_CHUNK],
                                                    scale) for i in range(0, q.shape[2], QUERY_CHUNK)], dim=1)
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * queries, dim)  # query heads of one KV head side by side
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale  # [b, kv_heads, group * queries, keys]
    visible = mask[:, :, None].expand(batch, 1, group, queries, keys).reshape(batch, 1, group * queries, keys)
    probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), -1).to(v.dtype)
    out = torch.matmul(probs, v)  # [b, kv_heads, group * queries, dim]
    return out.view(batch, heads, queries, dim).transpose(1, 2).reshape(batch, queries, heads * dim)


def invariant_key_length(key_length: int, capacity: int) -> int:
    """The key length batch_invariant_attention reads: rounded up to a whole KEY_CHUNK, at most the cache's."""
    return min(-(-key_length // KEY_CHUNK) * KEY_CHUNK, capacity)
