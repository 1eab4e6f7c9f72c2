"""The row attention as a torch custom op (dflash::row_attention, with a fake implementation) and
`row_attention`, the target's attention where it is packed for --batch-invariant: causal attention over the
positional cache whose every row's arithmetic depends on that row alone (rows.h). CUDA tensors run the CUDA build,
CPU tensors the host build (the same bits). On a GPU it is --batch-invariant's attention (SDPA, the default
there, rounds a row by the batch); on CPU it only serves tests: the C++ kernels' attention, the default, is
row-invariant too and much faster."""

import torch

from cuda_ext.dispatch import call_kernel

CHUNK = 256  # rows.h: kRowChunk
MAX_HEAD_DIM = 256  # rows.h: kRowMaxHeadDim
DTYPES = (torch.float32, torch.bfloat16)
WORKSPACE_BYTES = 256 * 2**20  # the most one call's chunk states take: longer query blocks go in pieces
MAX_GROUP_ROWS = 4 * 65535  # kernel.cu: a grid's z dimension of 4-warp blocks covers group heads x queries


@torch.library.custom_op("dflash::row_attention", mutates_args=())
def row_attention_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                         positions: torch.Tensor, chunks: int, scale: float) -> torch.Tensor:
    """reference.row_attention's contract with the keys cut into `chunks` chunks of CHUNK positions (enough for
    every position + 1); q in the cache's dtype (float32 or bfloat16), float32 arithmetic and result."""
    batch, heads, queries, dim = q.shape
    num_slots, kv_heads, capacity = keys.shape[0], keys.shape[1], keys.shape[2]
    q = q.contiguous()
    slots, positions = slots.long().contiguous(), positions.long().contiguous()
    on_device = all(t.device == q.device for t in (keys, values, slots, positions))
    if not (on_device and q.dtype == keys.dtype == values.dtype and q.dtype in DTYPES and keys.is_contiguous()
            and values.is_contiguous() and keys.shape == values.shape and keys.shape[3] == dim
            and heads % kv_heads == 0 and dim <= MAX_HEAD_DIM and slots.shape == (batch,)
            and positions.shape == (batch, queries) and chunks >= 1):
        described = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in (q, keys, values, slots, positions))
        raise ValueError(f"dflash::row_attention: inconsistent arguments ({described}; {chunks} chunks)")
    partials = torch.empty(batch, heads, queries, chunks, 2 + dim, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, queries, heads * dim, dtype=torch.float32, device=q.device)
    call_kernel("row_attention", q.device, q.data_ptr(), keys.data_ptr(), values.data_ptr(), slots.data_ptr(),
                positions.data_ptr(), partials.data_ptr(), out.data_ptr(), batch, heads, kv_heads, queries, dim,
                capacity, num_slots, chunks, int(q.dtype == torch.bfloat16), scale)
    return out


@row_attention_kernel.register_fake
def _(q, keys, values, slots, positions, chunks, scale):
    batch, heads, queries, dim = q.shape
    return q.new_empty(batch, queries, heads * dim, dtype=torch.float32)


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor, key_length: int, scale: float) -> torch.Tensor:
    """q [b, heads, queries, dim] (converted to the cache's dtype); one layer's cache keys, values [slots, kv_heads,
    capacity, dim]; slots [b]; positions [b, queries]; key_length: at least every real row's position + 1 (the
    host's fact; rows past it, padding, see only its keys). -> [b, queries, heads * dim] in q's dtype. A slot
    outside the cache: a ValueError on CPU, zero rows on CUDA (nothing is read back from the device). Queries go
    in pieces where one call's chunk states would pass WORKSPACE_BYTES (a long prefill chunk): rows are
    independent, so the pieces give the same bits."""
    batch, heads, queries, dim = q.shape
    chunks = max(1, -(-min(key_length, keys.shape[2]) // CHUNK))
    per_query = batch * heads * chunks * (2 + dim) * 4
    piece = max(1, min(WORKSPACE_BYTES // per_query, MAX_GROUP_ROWS // (heads // keys.shape[1])))
    dtype, q = q.dtype, q.to(keys.dtype)
    parts = [row_attention_kernel(q[:, :, i: i + piece], keys, values, slots, positions[:, i: i + piece], chunks,
                                  float(scale)) for i in range(0, queries, piece)]  # each [b, piece, heads * dim]
    if not parts:  # no queries
        return q.new_empty(batch, 0, heads * dim, dtype=dtype)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(dtype)
