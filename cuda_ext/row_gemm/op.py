"""The row-invariant GEMM as a torch custom op (dflash::row_gemm, with a fake implementation): x [..., K] @
weight [N, K]^T on the tensor cores, each row's result the same bits whatever the other rows of the call
(kernel.cu says how). CUDA only; `usable` says whether a call can take it, and the first call on a device checks
the kernel against the float32 product and its own one-row results before it is trusted (`verified`)."""

import functools
import logging

import torch

from cuda_ext.dispatch import call_kernel, kernel_entry
from cuda_ext.row_gemm import reference

TILE = 16  # kernel.cu: kTile; rows are padded to whole tiles, N and K must be whole tiles
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}
WARPS_PER_MULTIPROCESSOR = 16  # what the K slices aim to keep in flight (weights read at full speed)
MIN_SLICE = 256  # the shortest K slice (a slice of fewer steps costs more in partial sums than it gains)
WORKSPACE_BYTES = 256 * 2**20  # the most one call's slice sums take: more rows go in pieces


def slice_length(n: int, k: int, multiprocessors: int) -> int:
    """How many K entries one warp sums (a whole number of tiles): K is cut into slices so that a layer with few
    column tiles still has about WARPS_PER_MULTIPROCESSOR warps per multiprocessor. A function of N, K and the
    device alone, never of the row count: the order of every sum depends on it."""
    tiles = n // TILE
    wanted = max(1, -(-WARPS_PER_MULTIPROCESSOR * multiprocessors // tiles))
    slices = min(wanted, max(1, k // MIN_SLICE))
    length = -(-k // slices)
    return -(-length // TILE) * TILE


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@torch.library.custom_op("dflash::row_gemm", mutates_args=())
def row_gemm_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T -> [rows, N] in x's dtype (see `usable` for what it takes)."""
    rows, k = x.shape
    n = weight.shape[0]
    padded_rows = -(-rows // TILE) * TILE
    if padded_rows != rows or not x.is_contiguous() or x.data_ptr() % 32:  # whole, aligned tiles (kernel.cu)
        padded = torch.zeros(padded_rows, k, dtype=x.dtype, device=x.device)
        padded[:rows] = x
        x = padded
    length = slice_length(n, k, _multiprocessors(_device_index(x.device)))
    slices = -(-k // length)
    partials = torch.empty(slices, padded_rows, n, dtype=torch.float32, device=x.device)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    call_kernel("row_gemm", x.device, x.data_ptr(), weight.data_ptr(), partials.data_ptr(), out.data_ptr(), rows,
                padded_rows, n, k, length, slices, n, DTYPE_CODES[x.dtype])
    return out


@row_gemm_kernel.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether row_gemm takes this product: CUDA tensors of one dtype (bfloat16 or float16), a contiguous
    32-byte-aligned weight [N, K] with N and K multiples of 16, a kernel build for the device that passed
    `verified`."""
    return (x.device.type == "cuda" and weight.device == x.device and x.dtype in DTYPE_CODES
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[0] > 0 and weight.shape[1] > 0
            and weight.shape[0] % TILE == 0 and weight.shape[1] % TILE == 0 and x.shape[-1] == weight.shape[1]
            and weight.is_contiguous() and weight.data_ptr() % 32 == 0
            and kernel_entry("row_gemm", x.device) is not None and verified(_device_index(x.device)))


def row_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] through the kernel (the caller checked `usable`). Rows go in pieces
    where one call's slice sums would pass WORKSPACE_BYTES (a long prompt through the lm_head): a row's bits do
    not depend on the rows beside it, so the pieces give the same bits."""
    n, k = weight.shape
    flat = x.reshape(-1, k)  # [rows, K]
    slices = -(-k // slice_length(n, k, _multiprocessors(_device_index(x.device))))
    piece = max(TILE, WORKSPACE_BYTES // (slices * n * 4) // TILE * TILE)
    parts = [row_gemm_kernel(flat[i: i + piece], weight) for i in range(0, flat.shape[0], piece)]  # [piece, N] each
    if not parts:  # no rows
        return x.new_empty(*x.shape[:-1], n)
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    return rows.view(*x.shape[:-1], n)


@functools.cache
def verified(device_index: int) -> bool:
    """The first call's check on a device, before any layer trusts the kernel: on random bfloat16 inputs of
    shapes that take several K slices and row groups, its product is the float32 product's to bfloat16 rounding,
    and every row equals that row computed alone, bit for bit. False (logged) leaves the callers' other path."""
    log = logging.getLogger("dflash.cuda_ext")
    device = torch.device("cuda", device_index)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(70, 1024, generator=generator, device=device).to(torch.bfloat16)
    weight = torch.randn(48, 1024, generator=generator, device=device).div(32).to(torch.bfloat16)
    try:
        together = row_gemm_kernel(x, weight)
        alone = torch.cat([row_gemm_kernel(x[i: i + 1], weight) for i in (0, 17, 69)])
        expected = reference.row_gemm(x, weight)
    except (RuntimeError, ValueError) as exc:
        log.error("cuda_ext row GEMM failed its first call on GPU %d (%s): not used", device_index, exc)
        return False
    error = (together.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    invariant = torch.equal(alone, together[[0, 17, 69]])
    if not error <= 0.02 * max(scale, 1.0) or not invariant:  # (two bfloat16 roundings apart at most: 1/128)
        log.error("cuda_ext row GEMM failed its check on GPU %d (max |error| %.3g against the float32 product, rows "
                  "alone %s the rows together): not used", device_index, error, "equal" if invariant else "differ from")
        return False
    return True
