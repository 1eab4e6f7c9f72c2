"""MLA's absorbed attention over the latent cache as a Triton kernel: for each query row and block of heads, the
scores against the row's own batch entry's latents (and roped key parts), masked by the row's selection, an online
softmax, and the probabilities' weighted sum of the latents. No key or latent is copied per query row.

A program handles one query row: its arithmetic never depends on the other rows. Keys are walked in chunks of
BLOCK_T counted from position 0 and merged in order, and a chunk whose keys the row does not see changes nothing
(its probabilities are exact zeros and the running maximum stays, so the rescale is by exactly 1): the result does
not depend on how far past the row's keys the call reaches. So a verify block's rows equal one-token rows bit for
bit. Under Triton's interpreter (CPU tensors: tests) the tile products are explicit float32 sums, as in
cuda_ext/grouped_rows/kernel.py, for the same reasons.

With a width (the indexer's top-k, a bound fixed by the config), a program walks its row's selected positions
instead (ascending, in chunks of BLOCK_T of the list) and reads those latents alone: a row's result then depends on
its selection alone, whatever the context or the call's key length, and its cost on the selection, not the context.

Shapes: q_latent [rows, heads, kv_lora], q_rope [rows, heads, rope], latent [batch, keys, kv_lora], key_rope
[batch, keys, rope], visible [rows, keys] (rows = batch * seq, row r in batch entry r // seq) -> [rows, heads,
kv_lora] in the latent's dtype.
"""

import torch
import triton
import triton.language as tl

BLOCK_H, BLOCK_T = 16, 64  # fixed: every sum's order depends on these and the widths alone


@triton.jit
def _latent_attention_kernel(q_ptr, qr_ptr, lat_ptr, kr_ptr, vis_ptr, out_ptr, heads, span, seq, latent_dim,
                             rope_dim, scale, stride_qm, stride_qh, stride_qrm, stride_qrh, stride_lb, stride_lt,
                             stride_kb, stride_kt, stride_vm, stride_om, stride_oh,
                             BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr, INDEXED: tl.constexpr,
                             INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    batch = row // seq
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    ds = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_live, d_live = hs < heads, ds < latent_dim
    q = tl.load(q_ptr + row * stride_qm + hs[:, None] * stride_qh + ds[None, :],
                mask=h_live[:, None] & d_live[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if HAS_ROPE:
        rs = tl.arange(0, BLOCK_R)
        r_live = rs < rope_dim
        q_rope = tl.load(qr_ptr + row * stride_qrm + hs[:, None] * stride_qrh + rs[None, :],
                         mask=h_live[:, None] & r_live[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    running_max = tl.full((BLOCK_H,), -1e30, tl.float32)  # finite: a first chunk the row does not see stays 0
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for start in range(0, span, BLOCK_T):  # span: the keys (masked), or the width of the lists (INDEXED)
        if INDEXED:  # vis_ptr: the row's selected positions, ascending, -1 past its last
            entries = start + tl.arange(0, BLOCK_T)  # [BLOCK_T]
            ts = tl.load(vis_ptr + row * stride_vm + entries, mask=entries < span, other=-1)
            t_live = ts >= 0
            ts = tl.where(t_live, ts, 0)
        else:
            ts = start + tl.arange(0, BLOCK_T)  # [BLOCK_T]
            t_live = ts < span
        lat = tl.load(lat_ptr + batch * stride_lb + ts[:, None] * stride_lt + ds[None, :],
                      mask=t_live[:, None] & d_live[None, :], other=0.0)  # [BLOCK_T, BLOCK_D]
        if INTERPRETED:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * lat.to(tl.float32)[None, :, :], axis=2)
        else:
            scores = tl.dot(q, tl.trans(lat), input_precision="ieee")  # [BLOCK_H, BLOCK_T] float32
        if HAS_ROPE:
            k_rope = tl.load(kr_ptr + batch * stride_kb + ts[:, None] * stride_kt + rs[None, :],
                             mask=t_live[:, None] & r_live[None, :], other=0.0)  # [BLOCK_T, BLOCK_R]
            if INTERPRETED:
                scores += tl.sum(q_rope.to(tl.float32)[:, None, :] * k_rope.to(tl.float32)[None, :, :], axis=2)
            else:
                scores += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
        if INDEXED:
            seen = t_live
        else:
            seen = tl.load(vis_ptr + row * stride_vm + ts, mask=t_live, other=0) != 0  # [BLOCK_T]
        scores = tl.where(seen[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # [BLOCK_H]
        probs = tl.exp(scores - new_max[:, None])  # [BLOCK_H, BLOCK_T]; exact zeros where unseen
        rescale = tl.exp(running_max - new_max)
        total = total * rescale + tl.sum(probs, axis=1)
        weights = probs.to(lat.dtype)
        if INTERPRETED:
            acc = acc * rescale[:, None] + tl.sum(weights.to(tl.float32)[:, :, None] * lat.to(tl.float32)[None, :, :],
                                                  axis=1)
        else:
            acc = acc * rescale[:, None] + tl.dot(weights, lat, input_precision="ieee")
        running_max = new_max
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_om + hs[:, None] * stride_oh + ds[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_live[:, None] & d_live[None, :])


def selected_positions(visible: torch.Tensor, width: int) -> torch.Tensor:
    """visible [rows, keys] bool -> int32 [rows, min(width, keys)]: each row's visible positions in ascending order,
    -1 past its last. A row that sees more than width keys is an error, raised on the device without waiting for
    it (on CUDA a device-side assertion, which ends the worker: the families' widths are proven bounds, so it
    marks a bug, never a request's input)."""
    if visible.shape[-1] > width:
        torch._assert_async(visible.sum(-1).max() <= width, "a row selects more keys than the selection's width")
    order = torch.sort(visible.to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :width]
    return torch.where(visible.gather(-1, order), order, -1).to(torch.int32).contiguous()  # [rows, min(width, keys)]


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, key_rope: torch.Tensor,
                     visible: torch.Tensor, scale: float, width: int | None = None) -> torch.Tensor:
    """See the module docstring for the shapes. width: at most this many keys per row are visible (the indexer's
    top-k): the kernel then reads those keys' latents alone, walked in ascending order in chunks of BLOCK_T, instead
    of every key's (its cost then grows with the selection, not the context)."""
    rows, heads, latent_dim = q_latent.shape
    batch, keys, _ = latent.shape
    rope_dim = q_rope.shape[-1]
    q_latent, q_rope = q_latent.to(latent.dtype).contiguous(), q_rope.to(latent.dtype).contiguous()
    latent, key_rope = latent.contiguous(), key_rope.contiguous()
    visible = visible.reshape(rows, keys)
    if width is None:
        visible, span = visible.to(torch.uint8).contiguous(), keys
    else:  # lists of min(width, keys): a chunk of -1 changes nothing, so the bits are those of any longer list
        visible = selected_positions(visible, width)
        span = visible.shape[-1]
    interpreted = latent.device.type == "cpu"  # the interpreter truncates float32 to bfloat16: torch rounds instead
    out = torch.empty(rows, heads, latent_dim, device=latent.device,
                      dtype=torch.float32 if interpreted else latent.dtype)
    grid = (rows, triton.cdiv(heads, BLOCK_H))
    _latent_attention_kernel[grid](
        q_latent, q_rope, latent, key_rope, visible, out, heads, span, rows // batch, latent_dim, rope_dim, scale,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), latent.stride(0),
        latent.stride(1), key_rope.stride(0), key_rope.stride(1), visible.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_T=BLOCK_T, BLOCK_D=max(16, triton.next_power_of_2(latent_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(max(rope_dim, 1))), HAS_ROPE=rope_dim > 0, INDEXED=width is not None,
        INTERPRETED=interpreted)
    return out.to(latent.dtype)
