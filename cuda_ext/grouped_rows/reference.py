"""The grouped product in PyTorch, the oracle of the Triton kernel: each group's rows times its own weight."""

import torch


def grouped_rows(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [rows, K] sorted by group, weights [groups, N, K], counts [groups] (summing to rows) -> [rows, N] float32:
    row r of group g is x[r] @ weights[g]^T, summed in float32. Reads counts on the host."""
    out = torch.empty(x.shape[0], weights.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for group, count in enumerate(counts.tolist()):
        out[start:start + count] = x[start:start + count].float() @ weights[group].float().t()
        start += count
    return out
