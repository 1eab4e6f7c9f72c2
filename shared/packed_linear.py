"""Inference-time packing of linear layers: several projections of one input fused into one GEMM (q/k/v,
gate/up), each weight stored in the layout its device multiplies fastest.

Checkpoints load into the unpacked modules (their names are the loading table); a loaded model then packs
itself. Measured on 2 CPU cores (AMD EPYC, float32, one thread, MKL): a [1536, 256] gate/up weight costs
217 us per one-token row through F.linear and 51 us stored transposed ([in, out]) and multiplied as x @ W
(8 rows: 497 against 334 us); benchmarks/bench_forward.py measures the whole demo target forward 1.27x faster
packed for one token and 1.13x for an 8-token block, with the same greedy tokens. On CUDA, cuBLAS reads either layout alike, so the weights keep the [out, in] layout there and only
the GEMMs are fused.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def packing_layout(weight: torch.Tensor) -> str | None:
    """How to pack weights like this one: "transposed" ([in, out], x @ W) for float32 on CPU, "fused" (the
    [out, in] layout, F.linear) on accelerators, None (leave the layers as loaded) for reduced precision on CPU,
    whose oneDNN GEMMs give the row invariance bfloat16 verification relies on (see batch_invariant_attention)
    in the layout it was checked in."""
    if weight.device.type != "cpu":
        return "fused"
    return "transposed" if weight.dtype == torch.float32 else None


class PackedLinear(nn.Module):
    """The outputs of one or more nn.Linear layers of the same input, side by side in one GEMM (no autograd).

    reduce: applied to the product before the bias (a row-parallel layer's all-reduce: the bias is added once).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.transposed = layout == "transposed"
        self.register_buffer("weight", weight.t().contiguous() if self.transposed else weight.contiguous())
        self.register_buffer("bias", bias)
        self.reduce = reduce

    @classmethod
    def of(cls, *linears: nn.Linear, layout: str,
           reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "PackedLinear":
        weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum of outs, in]
        biases = [linear.bias for linear in linears]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("cannot pack linear layers with and without a bias together")
        bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        return cls(weight, bias, layout, reduce)

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.transposed else self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.reduce is None and not self.transposed:
            return F.linear(x, self.weight, self.bias)
        out = torch.matmul(x, self.weight) if self.transposed else F.linear(x, self.weight)
        if self.reduce is not None:
            out = self.reduce(out)
        return out if self.bias is None else out + self.bias
