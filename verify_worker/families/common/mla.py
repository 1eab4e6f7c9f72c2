"""Multi-head latent attention (MLA) maths, absorbed form: queries attend in the kv_lora latent space.

Per cached token only the normalised latent c [kv_lora] and the roped key part [rope] are kept. The key of
head h is [W_uk[h] c, k_rope] and its value W_uv[h] c, so q_nope . k_nope = (W_uk[h]^T q_nope) . c and the
output W_uv[h] (sum_t p_t c_t): the cache is never expanded per head. Pure functions on tensors.
"""

import torch

from shared.attention import QUERY_CHUNK
from verify_worker.families.common.row_invariant import elementwise_rows


def interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x0, x1), (x2, x3)... of x [..., seq, (heads,) rope]; cos, sin [b, seq, rope / 2] broadcast
    over the heads axis when x has one. The output puts the rotated evens first, then the odds (transformers'
    apply_rotary_pos_emb_interleave, so cached keys equal the oracle's)."""
    if x.dim() == cos.dim() + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def rotary_angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [b, s] -> cos, sin [b, s, rope / 2] (float32 angles, then dtype, as transformers; row-invariant)."""
    freqs = positions[..., None].float() * inv_freq  # [b, s, rope / 2]
    return elementwise_rows(torch.cos, freqs).to(dtype), elementwise_rows(torch.sin, freqs).to(dtype)


def absorbed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, key_rope: torch.Tensor,
                       w_uk: torch.Tensor, w_uv: torch.Tensor, visible: torch.Tensor, scale: float,
                       kernels, width: int | None = None) -> torch.Tensor:
    """q_nope [b, s, heads, nope], q_rope [b, s, heads, rope]; latent [b, keys, kv_lora], key_rope [b, keys, rope];
    w_uk [heads, nope, kv_lora], w_uv [heads, v, kv_lora]; visible [b, s, keys] (bool); kernels: the family's
    kernel set (kernel_set.py); width: a bound on the keys a row sees (the indexer's selection). Returns
    [b, s, heads * v]: the queries taken into the latent space per head, the attention there
    (kernels.latent_attention), the result taken out per head."""
    batch, seq, _, _ = q_nope.shape
    q_latent = per_head(q_nope, w_uk, kernels)  # [b, s, heads, kv_lora]
    out_latent = kernels.latent_attention(q_latent, q_rope, latent, key_rope, visible, scale,
                                          width)  # [b, s, heads, kv_lora]
    return per_head(out_latent, w_uv.transpose(1, 2), kernels).reshape(batch, seq, -1)


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, key_rope: torch.Tensor,
                     visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent [b, s, heads, kv_lora], q_rope [b, s, heads, rope], latent [b, keys, kv_lora], key_rope [b, keys,
    rope], visible [b, s, keys] -> [b, s, heads, kv_lora]. Every query row is computed on its own: scores and the
    weighted sum are batched matmuls with one query row per batch entry, so a verify block's rows equal one-token
    rows bit for bit (with the key length the caller rounds to whole chunks, masked keys only add exact zeros)."""
    if q_latent.shape[1] > QUERY_CHUNK:  # a long prefill: bounded score memory
        return torch.cat([latent_attention(q_latent[:, i: i + QUERY_CHUNK], q_rope[:, i: i + QUERY_CHUNK], latent,
                                           key_rope, visible[:, i: i + QUERY_CHUNK], scale)
                          for i in range(0, q_latent.shape[1], QUERY_CHUNK)], dim=1)
    batch, seq, heads, _ = q_latent.shape
    keys = latent.shape[1]
    query = torch.cat([q_latent, q_rope], -1).reshape(batch * seq, heads, -1)  # [b*s, heads, kv_lora + rope]
    key = torch.cat([latent, key_rope], -1)[:, None].expand(batch, seq, keys, -1).reshape(batch * seq, keys, -1)
    scores = torch.bmm(query, key.transpose(1, 2)).float() * scale  # [b*s, heads, keys]
    scores = scores.masked_fill_(~visible.reshape(batch * seq, 1, keys), float("-inf"))
    probs = torch.softmax(scores, -1).to(latent.dtype)
    values = latent[:, None].expand(batch, seq, keys, -1).reshape(batch * seq, keys, -1)
    return torch.bmm(probs, values).view(batch, seq, heads, -1)  # [b, s, heads, kv_lora]


def per_head(x: torch.Tensor, w: torch.Tensor, kernels) -> torch.Tensor:
    """x [b, s, heads, i] times each head's w [heads, i, o] -> [b, s, heads, o]: the rows grouped by head, each head's
    rows times its weight in place (grouped products: a row's result never depends on the other rows; an einsum
    would fold b * s into one GEMM whose roundings depend on the row count)."""
    batch, seq, heads, inputs = x.shape
    rows = x.permute(2, 0, 1, 3).reshape(heads * batch * seq, inputs)  # [heads * b * s, i], head by head
    counts = torch.full((heads,), batch * seq, dtype=torch.int64, device=x.device)
    out = kernels.grouped(rows, w.transpose(1, 2), counts)  # [heads * b * s, o]
    return out.view(heads, batch, seq, -1).permute(1, 2, 0, 3)
