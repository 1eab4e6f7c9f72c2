"""The row GEMM's contract in PyTorch, the test oracle: x [..., K] @ weight [N, K]^T with float32 sums, rounded to
x's dtype. (It is not itself row-invariant on a GPU: cuBLAS picks its algorithm by the row count.)"""

import torch


def row_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x.float(), weight.float().t()).to(x.dtype)
