"""The grouped product in PyTorch, the oracle of the Triton kernel (each group's rows times its own weight), and the
FP8 activations of its W8A8 form."""

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


FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (float8_e4m3fn [rows, K], float32 scales [rows, ceil(K / group)]): each row's groups of `group`
    columns scaled so their largest magnitude is e4m3's largest (dynamic 1 x group quantization, as DeepSeek-V3's
    FP8 format quantizes activations); x ~ q * scale. A row's values depend on that row alone."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(rows, -1, group)  # [rows, groups, group]
    scales = (padded.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [rows, groups]
    q = (padded / scales[..., None]).to(torch.float8_e4m3fn).view(rows, -1)[:, :k]
    return q.contiguous(), scales
