"""The pooled DSA indexer of GLM-5.3-Flash: keys are scored per pool of `kpool` consecutive tokens (from
position 0), and a query attends to the tokens of its best pools plus, with always_select_tail, its own
incomplete trailing pool. Pure functions on tensors; a pool's key depends only on its own tokens."""

import torch

from verify_worker.families.common.hyper_connection import stream_sum


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """keys, gates [b, T, D] per token (T a multiple of kpool), ape [kpool, D] -> pooled keys [b, T / kpool, D]:
    per channel, the softmax over the pool's tokens of gate + ape weighs their keys."""
    batch, total, dim = keys.shape
    kpool = ape.shape[0]
    logits = (gates.float().view(batch, -1, kpool, dim) + ape.float()).transpose(2, 3)  # [b, P, D, kpool]
    weights = torch.softmax(logits.contiguous(), -1).to(keys.dtype)  # each (pool, channel) row on its own
    grouped = keys.view(batch, -1, kpool, dim)
    return stream_sum([weights[..., j] * grouped[:, :, j] for j in range(kpool)])


def select_pooled(scores: torch.Tensor, positions: torch.Tensor, kpool: int, top_pools: int, keys: int,
                  tail: bool) -> torch.Tensor:
    """scores [b, s, P] (the indexer's scores of each query against the pooled keys), positions [b, s] -> selected
    keys [b, s, keys] (bool). Candidates are the complete pools whose last token the query sees; the best top_pools
    of them by score (ties: the earlier pool) are attended, plus the query's own incomplete pool's tokens when
    tail. Pools past a row's own position are never candidates, so rolled-back drafts cannot be chosen."""
    pools = scores.shape[-1]
    ends = torch.arange(pools, device=scores.device) * kpool + kpool - 1  # [P]
    candidates = ends[None, None] <= positions[..., None]  # [b, s, P]
    masked = scores.masked_fill(~candidates, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :top_pools]
    chosen = torch.zeros_like(candidates).scatter_(-1, order, True) & candidates  # [b, s, P]
    selected = chosen.repeat_interleave(kpool, -1)[..., :keys]  # [b, s, keys]
    if keys > selected.shape[-1]:
        selected = torch.nn.functional.pad(selected, (0, keys - selected.shape[-1]))
    if tail:
        token = torch.arange(keys, device=scores.device)
        tail_start = positions + 1 - (positions + 1) % kpool  # the first token of the query's incomplete pool
        selected = selected | ((token >= tail_start[..., None]) & (token <= positions[..., None]))
    return selected
