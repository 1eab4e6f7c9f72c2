"""Manifold-constrained hyper-connections (mHC, GLM-5.3-Flash): N residual streams per token, mixed around every
attention and MLP block. Pure functions; every sum over the N streams is written out in a fixed order, so a
token's result never depends on the rows around it."""

import torch
from torch import nn

from verify_worker.families.common.kernel_set import TorchKernels
from verify_worker.families.common.row_invariant import elementwise_rows


def stream_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class HyperConnection(nn.Module):
    """fn [(2 + N) * N, N * D], base [(2 + N) * N] and scale [3], all float32 (as published)."""

    def __init__(self, streams: int, hidden: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.streams, self.iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nn.Parameter(torch.empty(width, streams * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.glm_kernels = TorchKernels()  # the norm and mixing product, chosen again when the model is packed

    def forward(self, streams: torch.Tensor):
        """streams [b, s, N, D] -> (post [b, s, N], comb [b, s, N, N] float32, the collapsed block input [b, s, D])."""
        n = self.streams
        flat = streams.reshape(*streams.shape[:2], -1).float()  # [b, s, N * D]
        flat = self.glm_kernels.norm(flat, flat.new_ones(flat.shape[-1]), self.norm_eps)  # an unweighted RMSNorm
        mixed = self.glm_kernels.rows(flat, self.fn.float())  # [b, s, (2 + N) * N]
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], -1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = elementwise_rows(torch.sigmoid, pre_w * pre_s + pre_b) + self.eps
        post = 2 * elementwise_rows(torch.sigmoid, post_w * post_s + post_b)
        comb = torch.softmax((comb_w * comb_s + comb_b).view(*comb_w.shape[:-1], n, n), -1) + self.eps
        comb = comb / (stream_sum([comb[..., i:i + 1, :] for i in range(n)]) + self.eps)  # columns
        for _ in range(self.iters - 1):
            comb = comb / (stream_sum([comb[..., i:i + 1] for i in range(n)]) + self.eps)  # rows
            comb = comb / (stream_sum([comb[..., i:i + 1, :] for i in range(n)]) + self.eps)  # columns
        collapsed = stream_sum([pre[..., i, None] * streams[..., i, :] for i in range(n)]).to(streams.dtype)
        return post, comb, collapsed


def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The next streams [b, s, N, D]: post_n * block_out + sum_m comb[m, n] * residual_m (the mix in the model's
    dtype, as transformers rounds it)."""
    dtype = block_out.dtype
    post, comb = post.to(dtype), comb.to(dtype)
    n = residual.shape[2]
    mixed = [stream_sum([comb[..., m, i, None] * residual[..., m, :] for m in range(n)]) for i in range(n)]
    return torch.stack([post[..., i, None] * block_out + mixed[i] for i in range(n)], dim=2)


def stream_mean(streams: torch.Tensor) -> torch.Tensor:
    """[b, s, N, D] -> [b, s, D]: the unweighted mean of the streams (the final collapse, and what a tap is)."""
    return stream_sum([streams[..., i, :] for i in range(streams.shape[2])]) / streams.shape[2]
