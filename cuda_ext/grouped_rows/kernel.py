"""The grouped row-invariant product as a Triton kernel: rows sorted by group (an MoE's token-expert pairs by
expert), each group's rows times its own weight [N, K], read in place (no gather of weights per row).

Every entry's sum runs over K in BLOCK_K steps in one order, with BLOCK_M, BLOCK_N and BLOCK_K fixed constants and
no split of K: a row's result never depends on how many rows the call has, on which rows share its tile or its
group, or on where in a tile it sits, so a verify block's rows equal one-token rows bit for bit. The tiles come
from tiles.py on the device, so a call has no host synchronisation and a fixed grid for a given row count.
Triton's interpreter (TRITON_INTERPRET=1) runs it on CPU tensors (tests/glm_kernels_interpreted.py). There the
tile product is an explicit float32 sum over the tile's K entries instead of tl.dot: the interpreter's dot misreads
bfloat16 and runs numpy's BLAS, which rounds a row by its place in the tile; and the output is written in float32
and rounded by torch (the interpreter truncates to bfloat16). So the interpreter checks the tiling,
the groups, the masks and the addressing; that tl.dot's tensor-core sums keep a row's bits wherever it sits is
checked on a GPU (the same script with DFLASH_GROUPED_DEVICE=cuda, in benchmarks/gpu_session.sh).
"""

import torch
import triton
import triton.language as tl

from cuda_ext.grouped_rows.tiles import group_tiles, max_tiles

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # fixed: every sum's order depends on these and K alone


@triton.jit
def _grouped_rows_kernel(x_ptr, w_ptr, out_ptr, tile_group_ptr, tile_first_ptr, tile_end_ptr, n, k,
                         stride_xm, stride_wg, stride_wn, stride_wk, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    tile = tl.program_id(0)
    first = tl.load(tile_first_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if first >= end:  # a tile past the last real one
        return
    group = tl.load(tile_group_ptr + tile).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_live, col_live = rows < end, cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_live = ks < k
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_live[:, None] & k_live[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + group * stride_wg + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
                    mask=k_live[:, None] & col_live[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if INTERPRETED:  # CPU tensors under TRITON_INTERPRET: see the module docstring
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")  # float32 inputs stay float32 (no TF32)  # float32 inputs stay float32 (no TF32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & col_live[None, :])


def grouped_rows(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """x [rows, K] sorted by group, weights [groups, N, K] (any strides: a transposed view is read in place), counts
    [groups] on x's device -> [rows, N] (out_dtype, default x's): row r of group g is x[r] @ weights[g]^T, float32
    sums."""
    rows, k = x.shape
    groups, n, _ = weights.shape
    x = x.contiguous()
    dtype = out_dtype or x.dtype
    interpreted = x.device.type == "cpu"  # the interpreter truncates float32 to bfloat16: torch rounds it instead
    out = torch.empty(rows, n, dtype=torch.float32 if interpreted else dtype, device=x.device)
    if rows:
        tiles = max_tiles(rows, groups, BLOCK_M)
        tile_group, tile_first, tile_end = group_tiles(counts, BLOCK_M, tiles)
        grid = (tiles, triton.cdiv(n, BLOCK_N))
        _grouped_rows_kernel[grid](x, weights, out, tile_group, tile_first, tile_end, n, k, x.stride(0),
                                   weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
                                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, INTERPRETED=interpreted)
    return out.to(dtype)
