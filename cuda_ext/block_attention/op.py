"""The drafter's block attention as a torch custom op (dflash::block_attention, with a fake implementation), and
`block_attention`, which picks the kernel or the reference (cuda_ext/dispatch.py). On CPU the reference (or the
drafter's own AVX2 kernel) stays the default: the host build runs one row at a time in plain scalar code. On
CUDA the reference is the default too: on an H200 (2026-12-04, benchmarks/gpu_kernels.py, a Qwen3-8B-shaped
drafter layer, block 16, contexts 512..2048) the kernel took 6.96 / 15.3 / 27.5 ms at batch 1 / 8 / 32 against the
reference's 0.26 / 0.30 / 1.06 ms: a thread block per (row, KV head) is 8 blocks for 132 multiprocessors at batch 1,
and each thread walks its keys alone. The kernel stays callable (use_kernel=True) and tested until it is rewritten
(keys split over blocks, a warp per dot product)."""

import torch

from cuda_ext.block_attention import reference
from cuda_ext.dispatch import call_kernel, kernel_entry

MAX_HEAD_DIM, CUDA_MAX_ROWS = 256, 256  # rows.h: kMaxHeadDim, kAttentionMaxRows


@torch.library.custom_op("dflash::block_attention", mutates_args=())
def block_attention_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           ends: torch.Tensor, positions: torch.Tensor, window: int, causal: bool,
                           scale: float) -> torch.Tensor:
    """reference.block_attention's contract in one launch: q and the (contiguous) cache in float32 or bfloat16, the
    arithmetic in float32, the result in q's dtype."""
    device = q.device
    batch, heads, queries, dim = q.shape
    num_slots, kv_heads, capacity = keys.shape[0], keys.shape[1], keys.shape[2]
    dtype = keys.dtype
    q = q.to(dtype).contiguous()
    slots, ends, positions = slots.long().contiguous(), ends.long().contiguous(), positions.long().contiguous()
    if not (keys.dtype == values.dtype and dtype in (torch.float32, torch.bfloat16) and keys.is_contiguous() and values.is_contiguous()
            and keys.shape == values.shape and keys.shape[3] == dim and heads % kv_heads == 0
            and slots.shape == ends.shape == (batch,) and positions.shape == (batch, queries)):
        described = ", ".join(str(tuple(t.shape)) for t in (q, keys, values, slots, ends, positions))
        raise ValueError(f"dflash::block_attention: inconsistent arguments ({described})")
    out = torch.empty(batch, queries, heads * dim, dtype=torch.float32, device=device)
    if device.type == "cpu" and len(slots) and not (bool(((slots >= 0) & (slots < num_slots)).all())
                                                     and bool(((ends >= 0) & (ends <= capacity)).all())):
        raise ValueError(f"dflash::block_attention: slots {slots.tolist()} or ends {ends.tolist()} outside the cache "
                         f"({num_slots} slots x {capacity} positions)")  # (the CUDA kernel writes zeros for them)
    call_kernel("block_attention", device, q.data_ptr(), keys.data_ptr(), values.data_ptr(), slots.data_ptr(),
                ends.data_ptr(), positions.data_ptr(), batch, heads, kv_heads, queries, dim, capacity, num_slots,
                window, int(causal), int(dtype == torch.bfloat16), scale, out.data_ptr())
    return out.to(dtype)


@block_attention_kernel.register_fake
def _(q, keys, values, slots, ends, positions, window, causal, scale):
    batch, heads, queries, dim = q.shape
    return q.new_empty(batch, queries, heads * dim, dtype=keys.dtype)


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                    ends: torch.Tensor, positions: torch.Tensor, window: int, causal: bool, scale: float,
                    use_kernel: bool | None = None) -> torch.Tensor:
    """reference.block_attention, on the kernel where dispatch picks it and its sizes fit (use_kernel forces the
    choice)."""
    if use_kernel is None:
        use_kernel = kernel_available(q, keys)
    if not use_kernel:
        return reference.block_attention(q, keys, values, slots, ends, positions, window, causal, scale)
    return block_attention_kernel(q, keys, values, slots, ends, positions, int(window or 0), bool(causal),
                                  float(scale))


def kernel_available(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether dispatch sends this block attention to a kernel build (DFLASH_KERNELS=host on CPU; on CUDA not by
    default, see above) and the kernel takes its sizes: head size <= 256; on CUDA, GQA group x block queries <=
    256 (a thread each)."""
    heads, queries, dim = q.shape[1], q.shape[2], q.shape[3]
    fits = dim <= MAX_HEAD_DIM and keys.dtype in (torch.float32, torch.bfloat16) and (
        q.device.type != "cuda" or heads // keys.shape[1] * queries <= CUDA_MAX_ROWS)
    return fits and kernel_entry("block_attention", q.device, cuda_default=False) is not None
