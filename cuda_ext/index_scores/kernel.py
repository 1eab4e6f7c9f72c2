"""The DSA indexer's scores as a Triton kernel: for each query row and chunk of keys, sum over heads of
w_h * relu(scale * q_h . k), in float32, against the row's own batch entry's keys (no key copied per query row).
A program handles one query row and BLOCK_T keys: a row's scores never depend on the other rows or on how many keys
the call has, so a verify block selects as one-token steps do. Under Triton's interpreter (CPU tensors: tests) the
tile product is an explicit float32 sum, as in cuda_ext/grouped_rows/kernel.py.

Shapes: q [rows, heads, dim], keys [batch, T, dim], head_weights [rows, heads] (rows = batch * seq, row r in batch
entry r // seq) -> float32 [rows, T].
"""

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # fixed: the sums' order depends on it and the widths alone


@triton.jit
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, heads, total, seq, dim, scale, stride_qm, stride_qh,
                         stride_kb, stride_kt, stride_wm, stride_om,
                         BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    batch = row // seq
    hs, ds = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    h_live, d_live, t_live = hs < heads, ds < dim, ts < total
    q = tl.load(q_ptr + row * stride_qm + hs[:, None] * stride_qh + ds[None, :],
                mask=h_live[:, None] & d_live[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + batch * stride_kb + ts[:, None] * stride_kt + ds[None, :],
                mask=t_live[:, None] & d_live[None, :], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_D]
    if INTERPRETED:
        per_head = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    else:
        per_head = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_T]
    per_head = tl.maximum(per_head * scale, 0.0)
    w = tl.load(w_ptr + row * stride_wm + hs, mask=h_live, other=0.0).to(tl.float32)  # [BLOCK_H]
    tl.store(out_ptr + row * stride_om + ts, tl.sum(w[:, None] * per_head, axis=0), mask=t_live)


def index_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    """See the module docstring for the shapes."""
    rows, heads, dim = q.shape
    batch, total, _ = keys.shape
    q, keys, head_weights = q.contiguous(), keys.contiguous(), head_weights.contiguous()
    out = torch.empty(rows, total, dtype=torch.float32, device=q.device)
    grid = (rows, triton.cdiv(total, BLOCK_T))
    _index_scores_kernel[grid](q, keys, head_weights, out, heads, total, rows // batch, dim, scale, q.stride(0),
                               q.stride(1), keys.stride(0), keys.stride(1), head_weights.stride(0), out.stride(0),
                               BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_T=BLOCK_T,
                               BLOCK_D=max(16, triton.next_power_of_2(dim)), INTERPRETED=q.device.type == "cpu")
    return out
