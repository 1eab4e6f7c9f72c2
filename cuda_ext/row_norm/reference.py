"""The row RMSNorm's contract in PyTorch, the test oracle: shared.layers.rms_normalize (x / rms(x) in float32,
rounded to x's dtype, times the weight), with a [weight_rows, dim] weight applied to rows in turn."""

import torch

from shared.layers import rms_normalize


def row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., weight_rows, dim] or [..., dim] with a [dim] weight."""
    return rms_normalize(x, weight, eps)
