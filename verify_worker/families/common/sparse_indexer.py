"""The DSA indexer's selection maths (token-level, GLM-5.2 / DeepSeek-V3.2): pure functions on tensors."""

import torch


def index_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, s, heads, dim], keys [b, T, dim], head_weights [b, s, heads] -> float32 scores [b, s, T]:
    sum over heads of w_h * relu(scale * q_h . k), in float32 (one query row per batch entry, as in attention)."""
    batch, seq, heads, dim = q.shape
    total = keys.shape[1]
    expanded = keys.float()[:, None].expand(batch, seq, total, dim).reshape(batch * seq, total, dim)
    per_head = torch.relu(torch.bmm(q.float().reshape(batch * seq, heads, dim), expanded.transpose(1, 2)) * scale)
    weights = head_weights.float().reshape(batch * seq, 1, heads)
    return torch.bmm(weights, per_head).view(batch, seq, total)  # [b, s, T]


def select_top_keys(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [b, s, T] float32, visible [b, s, T] bool -> the selected keys [b, s, T] bool: each row's top_k
    visible keys by score; equal scores prefer the earlier position (a stable sort), so decode and verify
    choose alike. Keys a row cannot see are masked before the cut, so whatever a slot holds past its
    committed length can never be chosen; a row that sees at most top_k keys selects all of them."""
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :top_k]  # [b, s, <=top_k]
    chosen = torch.zeros_like(visible).scatter_(-1, order, True)
    return chosen & visible
