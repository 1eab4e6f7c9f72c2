"""The row RMSNorm as a torch custom op (dflash::row_norm, with a fake implementation) and `row_norm`, the norm of
a target packed for --batch-invariant: each row's sum of squares in an order fixed by the row alone (rows.h).
CUDA tensors run the CUDA build, CPU tensors the host build (the same bits)."""

import torch

from cuda_ext.dispatch import call_kernel

DTYPES = (torch.float32, torch.bfloat16)


@torch.library.custom_op("dflash::row_norm", mutates_args=())
def row_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, dim]; weight [weight_rows, dim] (row r takes weight row r % weight_rows) of x's dtype."""
    rows, dim = x.shape
    x, weight = x.contiguous(), weight.contiguous()
    if not (x.dtype == weight.dtype and x.dtype in DTYPES and weight.dim() == 2 and weight.shape[1] == dim
            and weight.device == x.device and dim >= 1):
        raise ValueError(f"dflash::row_norm: inconsistent arguments (x {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device})")
    out = torch.empty_like(x)
    call_kernel("row_norm", x.device, x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, weight.shape[0],
                int(x.dtype == torch.bfloat16), eps)
    return out


@row_norm_kernel.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """shared.layers.rms_normalize's contract for x [..., dim] and a weight [dim], or [heads, dim] against x
    [..., heads, dim] (each head row with its own), through the kernel."""
    dim = x.shape[-1]
    weight = weight.to(x.dtype).reshape(-1, dim)  # [weight_rows, dim]
    if weight.shape[0] > 1 and tuple(x.shape[-2:]) != tuple(weight.shape):
        raise ValueError(f"row_norm: a weight of {tuple(weight.shape)} rows against x of {tuple(x.shape)}")
    return row_norm_kernel(x.reshape(-1, dim), weight, float(eps)).view(x.shape)
