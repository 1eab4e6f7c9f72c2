"""Bias-free projections and the gated SiLU MLP, computed row by row (see row_invariant.py)."""

import torch
from torch import nn
from torch.nn import functional as F

from verify_worker.families.common.kernel_set import TorchKernels
from verify_worker.families.common.row_invariant import elementwise_rows


class Linear(nn.Module):
    """A bias-free projection computed row by row (the kernel set's rows); named like nn.Linear for loading. fp8: the
    weight may be kept as FP8 blocks (fp8_weights.keep_fp8; then `weight_scale_inv` holds its scales and the
    product runs on the kernel set's fp8_rows); False for a weight read other than through forward."""

    def __init__(self, inputs: int, outputs: int, fp8: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs))
        self.register_parameter("weight_scale_inv", None)
        self.fp8_weights = ("weight",) if fp8 else ()
        self.fp8_block: tuple[int, int] | None = None
        self.glm_kernels = TorchKernels()  # chosen again when the model is packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return self.glm_kernels.rows(x, self.weight)
        return self.glm_kernels.fp8_rows(x, self.weight, self.weight_scale_inv, self.fp8_block)


class GatedMLP(nn.Module):
    """down(silu(gate) * up), with gate clamped to at most `limit` and up to [-limit, limit] when a limit is given
    (GLM-5.3-Flash's swiglu_limit). inner: this rank's columns; reduce: the sum over the ranks of the partial
    output (None: left partial)."""

    def __init__(self, hidden: int, inner: int, reduce=None, limit: float | None = None):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, inner), Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)
        self.reduce, self.limit = reduce, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = clamp_gate_up(self.gate_proj(x), self.up_proj(x), self.limit)
        out = self.down_proj(elementwise_rows(F.silu, gate) * up)
        return out if self.reduce is None else self.reduce(out)


def clamp_gate_up(gate: torch.Tensor, up: torch.Tensor, limit: float | None):
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(-limit, limit)
