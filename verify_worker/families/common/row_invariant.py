"""Operations whose result for a row never depends on how many rows share the call.

A verify block must give each token exactly what one-token decoding gives it, or a top-k selection (indexer,
router) downstream can flip. Two things in PyTorch's CPU kernels break that for small widths (and a third, the
alignment of a GEMM's weight in memory, makes the same weights loaded from two files differ: see aligned()):
- a 2-D GEMM picks its blocking (and so its roundings) by the row count;
- elementwise loops run whole vector chunks with vectorized maths (exp, sigmoid, cos...) and the leftover
  tail of the tensor with scalar maths, which rounds differently; which elements fall in the tail depends
  on the total size.
"""

import torch

from cuda_ext.row_gemm import op as row_gemm

VECTOR_CHUNK = 32  # a multiple of every CPU vector loop's chunk (2 x 8 floats on AVX2, 2 x 16 on AVX-512)


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out], each row's result independent of the other rows: on a GPU
    the row GEMM of cuda_ext (tensor cores, a sum order fixed by the weight's shape) where it takes the product;
    otherwise as a batched matmul with one row per batch entry, at least two entries (on CPU, in bfloat16, a
    2-D product rounds differently from 2 rows on for 1 row with K = 64, and from 64 rows on with K = 768, in
    0.2-2% of rows; the batched kernel with two or more entries gave the same bits at every count tried; on a
    GPU this path is a fallback whose invariance depends on cuBLAS)."""
    if x.device.type == "cuda" and row_gemm.usable(x, weight):
        return row_gemm.row_gemm(x, weight)
    rows = x.reshape(-1, 1, x.shape[-1])  # [n, 1, in]
    alone = rows.shape[0] == 1
    if alone:  # a batch of one goes to another kernel (2-D, M = 1), whose roundings differ: keep two entries
        rows = rows.expand(2, -1, -1)
    out = torch.bmm(rows, weight.t().expand(rows.shape[0], -1, -1))  # [n, 1, out]
    return (out[:1] if alone else out).view(*x.shape[:-1], weight.shape[0])


def exact_linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear_rows where a fallback is not acceptable (a target packed for --batch-invariant): on a GPU the row GEMM
    or a RuntimeError naming the product, never the batched matmul whose rows cuBLAS may round by the batch."""
    if x.device.type != "cuda":
        return linear_rows(x, weight)
    if not row_gemm.usable(x, weight):
        raise RuntimeError(f"the row GEMM cannot take x {tuple(x.shape)} {x.dtype} @ weight {tuple(weight.shape)} "
                           f"{weight.dtype} on {x.device}: a row-invariant product is not available for it")
    return row_gemm.row_gemm(x, weight)


def elementwise_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, with each row of the last dimension padded to whole vector chunks, so that
    every element takes the vectorized path whatever the number of rows."""
    width = x.shape[-1]
    pad = -width % VECTOR_CHUNK
    if pad == 0:
        return fn(x.contiguous())
    padded = torch.nn.functional.pad(x, (0, pad))  # [..., width + pad], contiguous
    return fn(padded)[..., :width]


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in a fresh allocation (the CPU allocator aligns it to 64 bytes), whatever the source's offset."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
