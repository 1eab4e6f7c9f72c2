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

from cuda_ext.grouped_rows.reference import quantize_rows
from cuda_ext.grouped_rows.tiles import group_tiles, max_tiles

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # fixed: every sum's order depends on these and K alone (64 divides an
#                                         FP8 block of 128)


@triton.jit
def _bfloat16_rounded(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still float32: integer steps, the same everywhere
    (the interpreter's own cast truncates). Finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _grouped_rows_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, tile_group_ptr, tile_first_ptr, tile_end_ptr,
                         n, k, stride_xm, stride_xs, stride_wg, stride_wn, stride_wk, stride_sg, stride_sn, stride_sk,
                         stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_SCALES: tl.constexpr,
                         ACT_FP8: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
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
        tile_live = k_live[:, None] & col_live[None, :]
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_live[:, None] & k_live[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + group * stride_wg + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
                    mask=tile_live, other=0.0)  # [BLOCK_K, BLOCK_N]
        if ACT_FP8:  # W8A8: this K step lies in one scale group; fp8 x fp8 sums, then the row's and block's scales
            if INTERPRETED:
                partial = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            else:
                partial = tl.dot(a, b)  # [BLOCK_M, BLOCK_N] float32
            row_scale = tl.load(x_scale_ptr + rows.to(tl.int64) * stride_xs + start // SCALE_K, mask=row_live,
                                other=0.0)  # [BLOCK_M]
            block_scale = tl.load(scale_ptr + group * stride_sg + (cols // SCALE_N) * stride_sn +
                                  (start // SCALE_K) * stride_sk, mask=col_live, other=0.0)  # [BLOCK_N]
            acc += partial * row_scale[:, None] * block_scale[None, :]
        else:
            if HAS_SCALES:  # FP8 blocks, W8A16: the weight as dequantized at load, fp8 * its block's scale rounded
                scale = tl.load(scale_ptr + group * stride_sg + (cols // SCALE_N)[None, :] * stride_sn +
                                (ks // SCALE_K)[:, None] * stride_sk, mask=tile_live, other=0.0)
                b = b.to(tl.float32) * scale
                if INTERPRETED:
                    if ROUND_BF16:
                        b = _bfloat16_rounded(b)
                else:
                    b = b.to(a.dtype)
            if INTERPRETED:  # CPU tensors under TRITON_INTERPRET: see the module docstring
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")  # float32 inputs stay float32 (no TF32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & col_live[None, :])


def grouped_rows(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, out_dtype=None,
                 scales: torch.Tensor | None = None, scale_block: tuple[int, int] | None = None,
                 fp8_activations: bool = False) -> torch.Tensor:
    """x [rows, K] sorted by group, weights [groups, N, K] (any strides: a transposed view is read in place), counts
    [groups] on x's device -> [rows, N] (out_dtype, default x's): row r of group g is x[r] @ weights[g]^T, float32
    sums. With scales [groups, ceil(N / scale_block[0]), ceil(K / scale_block[1])] (float32; scale_block defaults to
    [128, 128]), weights are FP8 blocks: each is multiplied by its block's scale and rounded to x's dtype inside the
    kernel (W8A16), exactly the weight an FP8 checkpoint dequantized at load holds, so the product equals the
    dequantized twin's bit for bit. fp8_activations (W8A8, with scales): x is quantized per row and group of
    scale_block[1] columns (reference.quantize_rows), each K step of the sum an FP8 product scaled by the row's and
    the block's scales; a row's result still depends on that row alone."""
    rows, k = x.shape
    groups, n, _ = weights.shape
    dtype = out_dtype or x.dtype
    round_bf16 = x.dtype == torch.bfloat16
    scale_n, scale_k = scale_block or (128, 128)
    block_k, x_scales = BLOCK_K, None
    if fp8_activations:
        if scales is None:
            raise ValueError("fp8_activations needs FP8 weights (scales)")
        if scale_k % 32:  # an FP8 tl.dot takes K steps of 32 at least, powers of two
            raise ValueError(f"W8A8 needs blocks of a multiple of 32 columns, not {scale_k}")
        block_k = BLOCK_K if scale_k % BLOCK_K == 0 else 32  # fixed by the weight's blocks: inside one scale group
        if rows:
            x, x_scales = quantize_rows(x, scale_k)  # fp8 [rows, K], float32 [rows, ceil(K / scale_k)]
    x = x.contiguous()
    interpreted = x.device.type == "cpu"  # the interpreter truncates float32 to bfloat16: torch rounds it instead
    out = torch.empty(rows, n, dtype=torch.float32 if interpreted else dtype, device=x.device)
    if rows:
        tiles = max_tiles(rows, groups, BLOCK_M)
        tile_group, tile_first, tile_end = group_tiles(counts, BLOCK_M, tiles)
        grid = (tiles, triton.cdiv(n, BLOCK_N))
        scale_strides = scales.stride() if scales is not None else (0, 0, 0)
        _grouped_rows_kernel[grid](x, x_scales if x_scales is not None else x, weights,
                                   scales if scales is not None else weights, out, tile_group, tile_first, tile_end,
                                   n, k, x.stride(0), x_scales.stride(0) if x_scales is not None else 0,
                                   *weights.stride(), *scale_strides, out.stride(0), BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, BLOCK_K=block_k, SCALE_N=scale_n, SCALE_K=scale_k,
                                   HAS_SCALES=scales is not None, ACT_FP8=fp8_activations, ROUND_BF16=round_bf16,
                                   INTERPRETED=interpreted)
    return out.to(dtype)
