"""Layers both the target and the drafter use: RMSNorm and the gated SiLU MLP."""

import torch
from torch import nn
from torch.nn import functional as F

from shared.packed_linear import PackedLinear


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as the HF Qwen3/Llama reference does."""

    def __init__(self, size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.kernels = None  # the C++ CPU kernels (shared.cpu_kernels), set by a packed model for inference
        self.normalize = None  # (x, weight, eps) -> rms_normalize's result another way (the rows layout's), if set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalize is not None:
            return self.normalize(x, self.weight, self.eps)
        if self.kernels is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return rms_normalize(x, self.weight, self.eps)


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, the rms in float32 (HF Qwen3/Llama); weight broadcasts
    against x's trailing dimensions (a [heads, dim] weight normalizes each head row with its own)."""
    if x.dtype == torch.float32:  # the same maths without the two dtype round trips (two ops fewer)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the MLP of Qwen3, Llama and the DFlash drafter."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)
        self.gate_up_proj = None  # set by pack()

    def pack(self, layout: str, reduce=None, multiply=None) -> None:
        """Inference: gate and up as one GEMM (see shared.packed_linear); reduce: down_proj's all-reduce;
        multiply: the rows layout's product."""
        self.gate_up_proj = PackedLinear.of(self.gate_proj, self.up_proj, layout=layout, multiply=multiply)
        self.down_proj = PackedLinear.of(self.down_proj, layout=layout, reduce=reduce, multiply=multiply)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)  # [..., 2 * intermediate]: gate then up
        kernels = self.gate_up_proj.kernels  # the C++ kernels' activation where they ran the projection
        if kernels is not None and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, -1)  # [..., intermediate] each
        return self.down_proj(F.silu(gate) * up)


def project_rows(hidden: torch.Tensor, head: "torch.Tensor | PackedLinear") -> torch.Tensor:
    """[..., in] through an lm_head -> [..., out]: a packed one (PackedLinear), or a weight [out, in] as one 2-D
    linear over the rows (torch copies the whole weight per batch row when a strided 3-D input goes through a
    batched matmul)."""
    if isinstance(head, PackedLinear):
        return head(hidden)
    rows = F.linear(hidden.reshape(-1, hidden.shape[-1]), head)  # [rows, out]
    return rows.view(*hidden.shape[:-1], -1)


def normal_init(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random init for new models: norms at one, every other parameter from N(0, std) (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
