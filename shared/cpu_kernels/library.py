"""Building and loading the C++ CPU kernels (bf16_gemm.cpp with bf16_gemm_avx512.cpp, bf16_gemm_amx.cpp, attention.cpp,
layer_ops.cpp, decoder_layer.cpp, draft_block.cpp, draft_walk.cpp, worker_pool.cpp, top_k.cpp, top_p.cpp; simd_exp.h,
worker_pool.h, pooled_jobs.h, no_contraction.h):
compiled on first use with the system's C++ compiler (about a second; no torch headers) into a cache folder
keyed by the source and flags, loaded with ctypes. Without a compiler, on a CPU without AVX2 + FMA, or with
DFLASH_CPU_KERNELS=off, `cpu_kernels()` is None and every caller keeps its PyTorch path.

Cache folder: $DFLASH_KERNEL_CACHE, else ~/.cache/dflash-serve/kernels. Compiler: $CXX, else c++.
"""

import contextlib
import ctypes
import functools
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.attention import cached_attention
from shared.cpu_kernels.arguments import KV_DTYPES, TILE, cache_pages, check_arguments
from shared.native_build import cached_library

if TYPE_CHECKING:  # layer_step imports this module
    from shared.cpu_kernels.draft_step import DraftBlockWeights, DraftContextInputs, DraftStepInputs
    from shared.cpu_kernels.draft_walk import DraftWalkWeights
    from shared.cpu_kernels.layer_step import StackStepInputs, StackWeights

SOURCES = [Path(__file__).with_name(name) for name in ("bf16_gemm.cpp", "bf16_gemm_avx512.cpp", "bf16_gemm_amx.cpp",
                                                        "attention.cpp", "layer_ops.cpp", "decoder_layer.cpp",
                                                        "draft_block.cpp", "draft_walk.cpp", "worker_pool.cpp",
                                                        "top_k.cpp", "top_p.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd_exp.h", "worker_pool.h", "pooled_jobs.h", "cache_pages.h",
                                                        "no_contraction.h")]
FLAGS = ["-std=c++17", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread"]


class CpuKernels:
    """The loaded library's functions, with tensor-level wrappers."""

    def __init__(self, library: ctypes.CDLL):
        self._gemm = library.dflash_bf16_gemm
        self._gemm.restype = None
        self._gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
        self._gemm_by_isa = {"avx2": library.dflash_bf16_gemm_avx2, "avx512": library.dflash_bf16_gemm_avx512,
                             "amx": library.dflash_amx_gemm}
        for function in self._gemm_by_isa.values():
            function.restype, function.argtypes = None, self._gemm.argtypes
        uses_avx512, amx_available = library.dflash_bf16_gemm_uses_avx512, library.dflash_amx_available
        for probe in (uses_avx512, amx_available):
            probe.restype, probe.argtypes = ctypes.c_int, []
        self.gemm_isa = "avx512" if uses_avx512() else "avx2"  # what bf16_matmul (and the float32 layers) run
        self.amx = bool(amx_available())  # whether the "amx" layout's bfloat16 product runs here (bf16_gemm_amx.cpp)
        self._attention = library.dflash_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] + \
            [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]  # (q, k, v, bf16, strides, ...)
        pointer, count, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._rms_norm = library.dflash_rms_norm
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [pointer, count, count, pointer, real, pointer]
        self._add_rms_norm = library.dflash_add_rms_norm
        self._add_rms_norm.restype = None
        self._add_rms_norm.argtypes = [pointer, pointer, count, count, pointer, real, pointer, pointer]
        self._qk_rotary_cache = library.dflash_qk_rotary_cache
        self._qk_rotary_cache.restype = ctypes.c_int
        self._qk_rotary_cache.argtypes = [pointer] + [count] * 5 + [pointer, real] + [pointer] * 6 + [count] + \
            [pointer] * 2  # (..., k_cache, v_cache, bf16, pages, q)
        self._attention_cache = library.dflash_attention_cache
        self._attention_cache.restype = ctypes.c_int
        self._attention_cache.argtypes = [pointer] * 3 + [count] + [pointer] * 3 + [count] * 6 + [real, pointer]

        self._decoder_stack = library.dflash_decoder_stack
        self._decoder_stack.restype = ctypes.c_int
        self._decoder_stack.argtypes = [pointer] * 7  # layers, shape, step, scratch (structs), x, h, pool
        self._draft_block = library.dflash_draft_block
        self._draft_block.restype = ctypes.c_int
        self._draft_block.argtypes = [pointer] * 7  # the same, for draft_block.cpp's structs
        self._draft_ingest = library.dflash_draft_ingest
        self._draft_ingest.restype = ctypes.c_int
        self._draft_ingest.argtypes = [pointer] * 4  # layers, shape, context (structs), pool
        self._draft_greedy_walk = library.dflash_draft_greedy_walk
        self._draft_greedy_walk.restype = ctypes.c_int
        self._draft_greedy_walk.argtypes = [pointer, pointer, count, count, count, pointer, pointer, pointer]
        self._gemm_pooled = library.dflash_bf16_gemm_pooled
        self._gemm_pooled.restype = None
        self._gemm_pooled.argtypes = [pointer, count] + self._gemm.argtypes  # (pool, amx, x, ...)
        self._pool_create = library.dflash_pool_create
        self._pool_create.restype, self._pool_create.argtypes = pointer, [count]
        self._pool_destroy = library.dflash_pool_destroy
        self._pool_destroy.restype, self._pool_destroy.argtypes = None, [pointer]
        self._pool_hold = library.dflash_pool_hold
        self._pool_hold.restype, self._pool_hold.argtypes = None, [pointer, count]
        self._silu_mul = library.dflash_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [pointer, count, count, pointer]

        self._top_k = library.dflash_top_k
        self._top_k.restype = None
        self._top_k.argtypes = [pointer, count, count, count, pointer, pointer]
        self._top_p_cut = library.dflash_top_p_cut
        self._top_p_cut.restype = ctypes.c_int
        self._top_p_cut.argtypes = [pointer, count, count, pointer, pointer, pointer]

    def __deepcopy__(self, memo) -> "CpuKernels":
        return self  # the loaded library is shared (ctypes functions cannot be copied)

    @staticmethod
    def bf16_tiles(weight: torch.Tensor, layout: str = "bf16") -> torch.Tensor:
        """weight [out, in] (float32 values exactly representable in bfloat16) -> a kernel's layout: "bf16" (the
        float32 kernels, bf16_gemm.cpp) [ceil(out / 16), in, 16] bfloat16, the last tile zero-padded; "amx"
        (bf16_gemm_amx.cpp) the same with each two rows k, k + 1 (k even) of a tile interleaved column by
        column, as the tile multiply reads them (an odd last row stays as it is)."""
        out_features, in_features = weight.shape
        tiles = -(-out_features // TILE)
        padded = weight.new_zeros(tiles * TILE, in_features, dtype=torch.bfloat16)
        padded[:out_features] = weight.to(torch.bfloat16)
        packed = padded.view(tiles, TILE, in_features).transpose(1, 2).contiguous()  # [tiles, in, 16]
        if layout == "amx":
            paired = in_features // 2 * 2
            pairs = packed[:, :paired].reshape(tiles, paired // 2, 2, TILE).transpose(2, 3)  # [tiles, in / 2, 16, 2]
            packed[:, :paired] = pairs.reshape(tiles, paired, TILE)
        return packed

    def worker_pool(self, threads: int) -> "WorkerPool":
        """Threads (the caller's included) that share the layer stack's projections and attention, and a pooled
        bf16_matmul's tiles (worker_pool.h); the same bits as one thread."""
        return WorkerPool(self, threads)

    def bf16_matmul(self, x: torch.Tensor, tiles: torch.Tensor, out_features: int, isa: str | None = None,
                    pool: "WorkerPool | None" = None) -> torch.Tensor:
        """x [..., in] float32 @ the tiled weight -> [..., out] float32 (rows computed independently). isa: None
        for this CPU's float32 kernel (gemm_isa), "avx2" or "avx512" to force one (the same sums bit for bit;
        "avx512" only where gemm_isa is), "amx" for the bfloat16 product on tiles packed in the "amx" layout (x
        rounded to bfloat16; only where self.amx). pool: output tiles shared between its threads (this CPU's
        float32 kernel, or "amx")."""
        gemm = self._gemm if isa is None else self._gemm_by_isa[isa]
        if pool is not None and isa in (None, "amx"):
            gemm = functools.partial(self._gemm_pooled, pool.handle, isa == "amx")
        if isa == "avx512" and self.gemm_isa != "avx512":
            raise RuntimeError("bf16_matmul: this CPU has no AVX-512F")
        if isa == "amx" and not self.amx:
            raise RuntimeError("bf16_matmul: this CPU (or this process) has no AMX")
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [m, in]
        check_arguments(rows.dtype == torch.float32 and tiles.dtype == torch.bfloat16
                        and tiles.shape[1] == rows.shape[1] and tiles.shape[0] * TILE >= out_features,
                        "bf16_matmul", rows, tiles)
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32, device=x.device)
        if rows.shape[0]:
            gemm(rows.data_ptr(), rows.shape[0], rows.shape[1], tiles.data_ptr(), out_features, out.data_ptr())
        return out.view(*x.shape[:-1], out_features)


    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
        """shared.attention.cached_attention's contract, computed row by row (see attention.cpp): q [batch, heads,
        queries, dim]; k, v [batch, kv_heads, keys, dim] (cache views: only the last two dims need be dense);
        mask [batch, 1, queries, keys]. Returns [batch, queries, heads * dim]. Float32 queries; keys and values
        float32 or bfloat16 (a bfloat16 KV cache, widened as read). Other head sizes (not a multiple of 8, or over
        256) take cached_attention."""
        batch, heads, queries, dim = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        if q.dtype != torch.float32 or dim % 8 or dim > 256:
            return cached_attention(q, k.to(q.dtype), v.to(q.dtype), mask, scale)
        check_arguments(k.shape == v.shape == (batch, kv_heads, keys, dim) and k.dtype == v.dtype
                        and k.dtype in KV_DTYPES and heads % kv_heads == 0 and mask.shape[-2:] == (queries, keys),
                        "attention", q, k, v, mask)
        q = q.contiguous()
        k, v = (t if t.stride(-1) == 1 and t.stride(-2) == dim else t.contiguous() for t in (k, v))
        visible = mask.expand(batch, 1, queries, keys)[:, 0].contiguous().view(torch.uint8)  # [batch, queries, keys]
        out = torch.empty(batch, queries, heads * dim, dtype=torch.float32, device=q.device)
        if out.numel():
            self._attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.dtype == torch.bfloat16, k.stride(0),
                            k.stride(1), v.stride(0), v.stride(1), visible.data_ptr(), batch, heads, kv_heads,
                            queries, keys, dim, scale, out.data_ptr())
        return out

    def top_k(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.topk(x, k) over the last dim of float32 x [..., n], best first, equal values in index order
        (top_k.cpp). NaN is never kept (torch.topk ranks it first); where a row has fewer than k numbers the
        call takes torch.topk."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        check_arguments(rows.dtype == torch.float32 and 1 <= k <= rows.shape[1], "top_k", rows)
        values = torch.empty(rows.shape[0], k, dtype=torch.float32)
        ids = torch.empty(rows.shape[0], k, dtype=torch.int64)
        if rows.shape[0]:
            self._top_k(rows.data_ptr(), rows.shape[0], rows.shape[1], k, values.data_ptr(), ids.data_ptr())
            if bool((ids[:, -1] < 0).any()):
                values, ids = rows.topk(k, dim=-1)
        return values.view(*x.shape[:-1], k), ids.view(*x.shape[:-1], k)

    def top_p_cut(self, probs: torch.Tensor, top_p: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """shared.sampling's top-k then top-p cut of float32 probability rows probs [R, vocab], top_p [R], k [R]
        (vocab: no top-k cut) -> [R, vocab] (top_p.cpp: sorts only the buckets of value the kept prefix reaches);
        None where a row holds a value that is not a finite number."""
        probs = probs.contiguous()
        top_p, k = top_p.float().contiguous(), k.to(torch.int64).contiguous()
        rows, vocab = probs.shape
        check_arguments(probs.dtype == torch.float32 and top_p.shape == k.shape == (rows,), "top_p_cut", probs,
                        top_p, k)
        out = torch.empty_like(probs)
        if rows and self._top_p_cut(probs.data_ptr(), rows, vocab, top_p.data_ptr(), k.data_ptr(), out.data_ptr()):
            return None
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """shared.layers.rms_normalize for float32 x [..., n] and weight [n]."""
        x, weight = x.contiguous(), weight.float().contiguous()
        check_arguments(x.dtype == torch.float32 and weight.shape == x.shape[-1:], "rms_norm", x, weight)
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        """(x + delta, rms_normalize(x + delta, weight, eps)): a residual add and the next sublayer's norm."""
        x, delta, weight = x.contiguous(), delta.contiguous(), weight.float().contiguous()
        check_arguments(x.dtype == delta.dtype == torch.float32 and x.shape == delta.shape
                        and weight.shape == x.shape[-1:], "add_rms_norm", x, delta, weight)
        summed, out = torch.empty_like(x), torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), delta.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(),
                           eps, summed.data_ptr(), out.data_ptr())
        return summed, out

    def qk_rotary_cache(self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, norm_weight, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        slots: torch.Tensor, positions: torch.Tensor,
                        table: torch.Tensor | None = None) -> torch.Tensor:
        """The attention input from a fused q/k/v projection qkv [b, s, (heads + 2 kv_heads) * dim]: q and k heads
        normalized (norm_weight [heads + kv_heads, dim], or None) and rotated by cos/sin [b, s, dim], k and v
        written into one layer's caches keys/values [pages, kv_heads, page_size, dim] (float32, or bfloat16 rounded
        as PyTorch rounds) at slots [b] and positions [b, s], through the page table [slots, pages_per_slot] (None:
        a page a slot, page = slot). Returns q [b, heads, s, dim]."""
        batch, seq = qkv.shape[0], qkv.shape[1]
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        width = (heads + 2 * kv_heads) * dim
        check_arguments(qkv.dtype == cos.dtype == sin.dtype == torch.float32 and keys.dtype == values.dtype
                        and keys.dtype in KV_DTYPES
                        and qkv.shape == (batch, seq, width) and cos.shape == sin.shape == (batch, seq, dim)
                        and slots.shape == (batch,) and positions.shape == (batch, seq) and keys.is_contiguous()
                        and values.is_contiguous() and keys.shape == values.shape
                        and (kv_heads == 0 or keys.shape[1] == kv_heads) and keys.shape[3] == dim,
                        "qk_rotary_cache", qkv, cos, sin, keys, values, slots, positions)
        if norm_weight is not None:
            check_arguments(norm_weight.shape == (heads + kv_heads, dim) and norm_weight.dtype == torch.float32,
                            "qk_rotary_cache", norm_weight)
        q = torch.empty(batch, heads, seq, dim, dtype=torch.float32)
        norm_weight = None if norm_weight is None else norm_weight.contiguous()  # held for the call
        norm = 0 if norm_weight is None else norm_weight.data_ptr()
        pages, table = cache_pages(keys, table)
        status = self._qk_rotary_cache(qkv.data_ptr(), batch, seq, heads, kv_heads, dim, norm, eps, cos.data_ptr(),
                                       sin.data_ptr(), slots.data_ptr(), positions.data_ptr(), keys.data_ptr(),
                                       values.data_ptr(), keys.dtype == torch.bfloat16, ctypes.addressof(pages),
                                       q.data_ptr())
        if status != 0:
            raise _outside_cache(keys, slots, positions)
        return q

    def cache_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor | None,
                        slots: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """attention() read straight from one layer's caches keys/values [pages, kv_heads, page_size, dim] through
        the page table [slots, pages_per_slot] (None: a page a slot): q [batch, heads, queries, dim] float32 over
        positions 0..keys-1 of slots [batch], mask [batch, 1, queries, keys]. Returns [batch, queries, heads *
        dim]."""
        batch, heads, queries, dim = q.shape
        keys_len = mask.shape[-1]
        slots = slots.to(torch.int64).contiguous()
        check_arguments(q.dtype == torch.float32 and keys.dtype == values.dtype and keys.dtype in KV_DTYPES
                        and keys.shape == values.shape and keys.is_contiguous() and values.is_contiguous()
                        and keys.shape[3] == dim and slots.shape == (batch,) and mask.shape[-2] == queries,
                        "cache_attention", q, keys, values, slots, mask)
        q = q.contiguous()
        visible = mask.expand(batch, 1, queries, keys_len)[:, 0].contiguous().view(torch.uint8)
        out = torch.empty(batch, queries, heads * dim, dtype=torch.float32)
        pages, table = cache_pages(keys, table)
        status = self._attention_cache(q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.dtype == torch.bfloat16,
                                       ctypes.addressof(pages), slots.data_ptr(), visible.data_ptr(), batch, heads,
                                       keys.shape[1], queries, keys_len, dim, scale, out.data_ptr())
        if status == -1:
            raise _outside_cache(keys, slots, torch.tensor([keys_len - 1]))
        if status != 0:
            raise ValueError(f"cache_attention: a shape the kernel does not take (head size {dim}, {heads} heads on "
                             f"{keys.shape[1]}, pages of {keys.shape[2]})")
        return out


    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2 * intermediate] float32 (gate then up, a fused projection's output) -> silu(gate) * up
        [..., intermediate] (layer_ops.cpp; equal to F.silu(gate) * up within a float32 rounding or two)."""
        rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        check_arguments(rows.dtype == torch.float32 and rows.shape[1] % 2 == 0, "silu_mul", rows)
        act = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=torch.float32)
        self._silu_mul(rows.data_ptr(), rows.shape[0], rows.shape[1] // 2, act.data_ptr())
        return act.view(*gate_up.shape[:-1], rows.shape[1] // 2)

    @staticmethod
    def _one_call(entry, name: str, x: torch.Tensor, c_layers, c_shape, step,
                  pool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A one-call forward (decoder_stack, draft_block): x [rows, hidden] float32, checked against the step, is
        copied and updated in place; h [rows, hidden] receives the final norm. Returns (x, h, the entry's status)."""
        x = x.contiguous().clone()
        check_arguments(x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] == step.c_step.batch * step.c_step.seq
                        and x.shape[1] == c_shape.hidden, name, x)
        h = torch.empty_like(x)
        status = entry(ctypes.addressof(c_layers), ctypes.addressof(c_shape), ctypes.addressof(step.c_step),
                       ctypes.addressof(step.c_scratch), x.data_ptr(), h.data_ptr(),
                       None if pool is None else pool.handle)
        return x, h, status

    def decoder_stack(self, x: torch.Tensor, stack: "StackWeights", step: "StackStepInputs",
                      pool: "WorkerPool | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer of a dense decoder in one call (decoder_layer.cpp): x [rows, hidden] float32 (the
        embeddings) -> (the last layer's residual, its final norm), each [rows, hidden]. Writes the rows' keys and
        values into every layer's caches and the tapped layers' outputs into step.taps. pool: the threads that
        share the work (None: this one)."""
        x, h, status = self._one_call(self._decoder_stack, "decoder_stack", x, stack.c_layers, stack.c_shape, step,
                                      pool)
        if status == -1:
            raise _outside_cache(step.first_keys, step.slots, step.positions)
        if status != 0:
            first = stack.layers[0]
            raise ValueError(f"decoder_stack: a shape the attention kernel does not take (head size {first.dim}, "
                             f"{first.heads} heads on {first.kv_heads}, {step.c_step.keys} keys)")
        return x, h

    def draft_block(self, x: torch.Tensor, weights: "DraftBlockWeights", step: "DraftStepInputs",
                    pool: "WorkerPool | None" = None) -> torch.Tensor:
        """A drafter's every layer over one block per request in one call (draft_block.cpp): x [rows, hidden]
        float32 (the block embeddings) -> the final norm's output [rows, hidden]. Writes the block rows' keys and
        values into every layer's cache (past the context: the cache keeps context rows only)."""
        _, h, status = self._one_call(self._draft_block, "draft_block", x, weights.c_layers, weights.c_shape, step,
                                      pool)
        if status == -1:
            raise _outside_cache(step.first_keys, step.slots, step.positions)
        if status != 0:
            shape = weights.c_shape
            raise ValueError(f"draft_block: a shape the kernels do not take (head size {shape.dim}, {shape.heads} "
                             f"heads on {shape.kv_heads}, {step.c_step.keys} keys, conv group {shape.conv_group})")
        return h


    def draft_ingest(self, weights: "DraftBlockWeights", context: "DraftContextInputs",
                     pool: "WorkerPool | None" = None) -> None:
        """A drafter's context rows into every layer's cache in one call (draft_block.cpp: fc, the hidden norm,
        each layer's k/v projection, k norm and rotary), the same bits as DFlashDraftModel's per-op ingest."""
        status = self._draft_ingest(ctypes.addressof(weights.c_layers), ctypes.addressof(weights.c_shape),
                                    ctypes.addressof(context.c_context), None if pool is None else pool.handle)
        if status == -1:
            raise _outside_cache(context.first_keys, context.slots, context.positions)
        if status != 0:
            raise ValueError(f"draft_ingest: a shape the kernels do not take (head size {weights.c_shape.dim})")

    def draft_greedy_walk(self, weights: "DraftWalkWeights", hidden: torch.Tensor, rows: int, anchors: torch.Tensor,
                          pool: "WorkerPool | None" = None) -> torch.Tensor | None:
        """A DFlash 2 drafter's greedy drafts in one call (draft_walk.cpp): hidden [batch, block, hidden] float32
        (a block's final norm, row 0 the anchor's), rows 1..rows of each block drafted; anchors [batch] -> tokens
        [batch, rows], the same as logits, top-k candidates and the host walk in separate calls. None where a row's
        logits hold fewer than top_k numbers (NaN): the caller takes those calls (torch.topk ranks NaN first)."""
        batch, block, width = hidden.shape
        hidden, anchors = hidden.contiguous(), anchors.to(torch.int64).contiguous()
        check_arguments(hidden.dtype == torch.float32 and width == weights.c_weights.hidden and 1 <= rows < block
                        and anchors.shape == (batch,), "draft_greedy_walk", hidden, anchors)
        tokens = torch.empty(batch, rows, dtype=torch.int64)
        status = self._draft_greedy_walk(ctypes.addressof(weights.c_weights), hidden.data_ptr(), batch, block, rows,
                                         anchors.data_ptr(), tokens.data_ptr(), None if pool is None else pool.handle)
        if status == -2:
            raise IndexError(f"dflash2_walk: a token id outside the vocabulary of the selector "
                             f"({weights.c_weights.selector_vocab})")
        if status == -1:
            raise ValueError(f"draft_greedy_walk: sizes the kernel does not take (rows {rows} of blocks of {block})")
        return None if status == 1 else tokens


class WorkerPool:
    """A worker_pool.h pool (CpuKernels.worker_pool): its helper threads live until close() or garbage collection."""

    def __init__(self, kernels: CpuKernels, threads: int):
        self.threads = max(1, int(threads))
        self._destroy, self._hold = kernels._pool_destroy, kernels._pool_hold
        self.handle = kernels._pool_create(self.threads)

    def __deepcopy__(self, memo) -> "WorkerPool":
        return self  # threads cannot be copied; a copied model shares them

    @contextlib.contextmanager
    def awake(self, on: bool = True):
        """Keep the helpers spinning between jobs for the block's duration (up to 2 ms without a job), where
        they would sleep 50 us after each: waking one costs tens of microseconds on a VM, which a step of many
        calls with Python between them pays every call (the demo pair in process, greedy: speculative 1177 ->
        1394 tok/s, plain 850 -> 980). The helpers hold their cores meanwhile, so hold a pool only while its owner
        computes, never while it waits on another process (they sleep 50 us after the last hold ends).
        on=False: one hold fewer for the block (inside an awake block: a wait). Nests; changes no result."""
        handle = self.handle
        if handle:
            self._hold(handle, int(on))
        try:
            yield
        finally:
            if handle and self.handle == handle:  # not closed meanwhile
                self._hold(handle, int(not on))

    def close(self) -> None:
        if self.handle:
            self._destroy(self.handle)
            self.handle = None

    def __del__(self):
        self.close()


def pool_awake(pool: WorkerPool | None, on: bool = True) -> contextlib.AbstractContextManager:
    """pool.awake(on), or nothing without a pool."""
    return contextlib.nullcontext() if pool is None else pool.awake(on)


def _outside_cache(keys: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> IndexError:
    """The error of a cache access the kernel refused: keys [pages, kv_heads, page_size, dim]."""
    return IndexError(f"outside the cache ({keys.shape[0]} pages x {keys.shape[2]} positions): "
                      f"slots {slots.tolist()}, positions {int(positions.min())}..{int(positions.max())}")














def _why_unavailable(compiler: str | None) -> str:
    """Why this machine cannot use the kernels ("" when it can)."""
    if os.environ.get("DFLASH_CPU_KERNELS", "auto").lower() in ("off", "0", "false", "no"):
        return "DFLASH_CPU_KERNELS=off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"a {platform.machine()} CPU (the kernels are AVX2)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "a CPU without AVX2"
    if compiler is None:
        return "no C++ compiler ($CXX or c++)"
    return ""


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built if needed (once per process); None where they cannot run (logged once)."""
    log = logging.getLogger("dflash.cpu_kernels")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    why = _why_unavailable(compiler)
    if why:
        log.info("C++ CPU kernels off (%s): float32 projections use PyTorch's GEMM", why)
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(cached_library("libdflash_cpu.so", [compiler, *FLAGS], SOURCES, HEADERS))))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("C++ CPU kernels unavailable (build or load failed: %s): float32 projections use PyTorch's GEMM",
                    str(detail).strip()[:500])
        return None
