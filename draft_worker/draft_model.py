"""The DFlash (v1) drafter: block denoising conditioned on target features through KV injection.

Module names are the published tensor names. The drafter has no embedding and no lm_head of its own: it
borrows the target's, passed in as tensors.
"""

import torch
from torch import nn

from cuda_ext.block_attention.op import block_attention
from cuda_ext.block_attention.op import kernel_available as block_attention_available
from cuda_ext.dispatch import kernel_entry
from shared.attention import cached_attention, visibility_mask
from shared.cpu_kernels.draft_step import (ContextWeights, ConvWeights, DraftBlockWeights, DraftContextInputs,
                                           DraftLayerWeights, DraftStepInputs)
from shared.cpu_kernels.library import cpu_kernels
from shared.draft_config import DraftConfig
from shared.kv_cache import CacheReads, PositionalKVCache
from shared.layers import GatedMLP, RMSNorm, project_rows
from shared.packed_linear import KERNEL_LAYOUTS, PackedLinear, common_layout, packing_layout
from shared.rope import apply_rotary, inverse_frequencies, rotary_cos_sin


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.causal = cfg.layer_is_causal(layer_index)
        self.window = cfg.layer_window(layer_index)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.kv_proj = None  # set by pack()
        self.kernels = None  # the C++ CPU kernels, with their layouts ("bf16", "amx"; set by pack())

    def pack(self, layout: str) -> None:
        """Inference: k and v as one GEMM (context rows need only those), q and o in the same layout; with the
        C++ kernels' layout, their attention too."""
        self.kv_proj = PackedLinear.of(self.k_proj, self.v_proj, layout=layout)
        self.q_proj = PackedLinear.of(self.q_proj, layout=layout)
        self.o_proj = PackedLinear.of(self.o_proj, layout=layout)
        del self.k_proj, self.v_proj
        self.kernels = cpu_kernels() if layout in KERNEL_LAYOUTS else None
        if self.kernels is not None:  # the C++ kernels: their attention, and norm + rotary + cache write fused
            self.register_buffer("q_norm_rows", self.q_norm.weight.detach().expand(self.num_heads, self.head_dim).contiguous())
            self.register_buffer("k_norm_rows",
                                 self.k_norm.weight.detach().expand(self.num_kv_heads, self.head_dim).contiguous())

    def write_keys_values(self, rows: torch.Tensor, cos, sin, cache: PositionalKVCache, slots, positions) -> None:
        """Keys and values of rows [b, s, hidden] at positions [b, s] of slots [b] into this layer's cache."""
        if self.kernels is None or rows.dtype != torch.float32 or rows.device.type != "cpu":
            k, v = self.keys_values(rows, cos, sin)  # [b, s, kv_heads, dim]
            cache.write(self.layer_index, slots, positions, k, v)
            return
        self.kernels.qk_rotary_cache(self.kv_proj(rows), 0, self.num_kv_heads, self.head_dim, self.k_norm_rows,
                                     self.k_norm.eps, cos, sin, cache.keys[self.layer_index],
                                     cache.values[self.layer_index], slots, positions)

    def _queries(self, x: torch.Tensor, cos, sin, cache: PositionalKVCache, slots, positions) -> torch.Tensor:
        """x [b, s, hidden] -> normalized, rotated queries [b, heads, s, dim]."""
        if self.kernels is None or x.dtype != torch.float32 or x.device.type != "cpu":
            b, s, _ = x.shape
            q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim))
            return apply_rotary(q.transpose(1, 2), cos, sin)
        return self.kernels.qk_rotary_cache(self.q_proj(x), self.num_heads, 0, self.head_dim, self.q_norm_rows,
                                            self.q_norm.eps, cos, sin, cache.keys[self.layer_index],
                                            cache.values[self.layer_index], slots, positions)

    def _keys_values_raw(self, rows: torch.Tensor):
        """rows [b, s, hidden] -> k, v [b, s, kv_heads * dim] before the norm and rotary."""
        if self.kv_proj is None:
            return self.k_proj(rows), self.v_proj(rows)
        return self.kv_proj(rows).chunk(2, -1)

    def keys_values(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """rows [b, s, hidden] -> rotated keys and values [b, s, kv_heads, dim]."""
        b, s, _ = rows.shape
        k, v = self._keys_values_raw(rows)
        k = self.k_norm(k.view(b, s, self.num_kv_heads, self.head_dim))
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        k = apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2)
        return k, v

    def forward(self, x, cos, sin, cache: PositionalKVCache, slots, positions, block_end, reads: CacheReads):
        q = self._queries(x, cos, sin, cache, slots, positions)  # [b, heads, block, dim]
        self.write_keys_values(x, cos, sin, cache, slots, positions)  # block rows join the cached context rows
        keys, values = cache.keys[self.layer_index], cache.values[self.layer_index]
        if block_attention_available(q, keys):  # the kernel: ragged lengths, no padding work
            return self.o_proj(block_attention(q, keys, values, slots, block_end, positions, self.window or 0,
                                               self.causal, self.head_dim**-0.5, use_kernel=True))
        kv_len = reads.length
        keys, values = cache.read(self.layer_index, reads.slots, kv_len)
        if self.causal:
            mask = visibility_mask(positions, kv_len, sliding_window=self.window)
        else:
            mask = visibility_mask(positions, kv_len, visible_end=block_end, sliding_window=self.window)
        attend = cached_attention if self.kernels is None else self.kernels.attention
        return self.o_proj(attend(q, keys, values, mask, self.head_dim**-0.5))


    def forward_rows(self, x, cos, sin, context_k, context_v, mask):
        """Training path without a cache: block rows x [1, R, hidden] attend to precomputed context keys/values
        [1, S, kv_heads, dim] and to block rows, as mask [1, 1, R, S + R] allows."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [1, heads, R, dim]
        k, v = self.keys_values(x, cos, sin)  # [1, R, kv_heads, dim]
        keys = torch.cat([context_k, k], 1).transpose(1, 2)  # [1, kv_heads, S + R, dim]
        values = torch.cat([context_v, v], 1).transpose(1, 2)
        return self.o_proj(cached_attention(q, keys, values, mask, self.head_dim**-0.5))


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def pack(self, layout: str) -> None:
        self.self_attn.pack(layout)
        self.mlp.pack(layout)

    def native_convs(self) -> "tuple[ConvWeights | None, ConvWeights | None] | None":
        """The dynamic convolutions as draft_block.cpp takes them: (None, None) for a layer without (DFlash)."""
        return None, None

    def native_weights(self, next_norm: RMSNorm) -> DraftLayerWeights | None:
        """This packed layer as draft_block.cpp takes it (next_norm: the norm after it), or None where a weight is
        not on the C++ kernels (not bfloat16-exact, or with a bias)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.q_proj, attn.kv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        convs = self.native_convs()
        if attn.kernels is None or convs is None or not all(native_tiles(m) for m in linears):
            return None
        return DraftLayerWeights(
            attn.q_proj.weight, attn.q_norm_rows.float().contiguous(), attn.q_norm.eps, attn.kv_proj.weight,
            attn.k_norm_rows.float().contiguous(), attn.k_norm.eps, attn.o_proj.weight, norm_weight(
                self.post_attention_layernorm), self.post_attention_layernorm.eps, mlp.gate_up_proj.weight,
            mlp.down_proj.weight, norm_weight(next_norm), next_norm.eps, *convs)

    def forward(self, x, cos, sin, cache, slots, positions, block_end, reads: CacheReads):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, positions, block_end, reads)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_rows(self, x, cos, sin, context_k, context_v, mask, block_size: int):
        """Training path: x [1, R, hidden] holds R // block_size whole blocks, one after another."""
        x = x + self.self_attn.forward_rows(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    layer_class = DraftDecoderLayer

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim), persistent=False)
        self.kernels = None  # the C++ CPU kernels, with their layouts ("bf16", "amx"; set by pack())
        self.native_block: DraftBlockWeights | None = None  # every layer in one kernel call (set by pack())
        self.pool = None  # the threads that share the one call's work (the proposer sets it)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [1, positions, dim] (_cos_sin)

    def pack(self, layout: str | None = "auto") -> "DFlashDraftModel":
        """For inference (the proposers call it): fuse k/v and gate/up and store the projections in `layout`
        ("auto": the one this device and dtype multiply fastest, see shared.packed_linear; None keeps the
        loaded modules). Idempotent; the module then no longer has the checkpoint's names, so save or train a
        drafter before packing it."""
        if layout == "auto":
            layout = packing_layout(self.fc.weight)
        if layout is None or isinstance(self.fc, PackedLinear):
            return self
        self.fc = PackedLinear.of(self.fc, layout=layout)
        self.kernels = cpu_kernels() if layout in KERNEL_LAYOUTS else None
        for layer in self.layers:
            layer.pack(layout)
        if self.kernels is not None:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.kernels = self.kernels
            self.native_block = self._native_block()
        return self

    def _native_block(self) -> DraftBlockWeights | None:
        """block_hidden as one draft_block.cpp call, where every layer's weights are on the C++ kernels."""
        cfg = self.config
        after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        layers = [layer.native_weights(norm) for layer, norm in zip(self.layers, after)]
        if not layers or any(w is None for w in layers) or self.hidden_norm.weight.dtype != torch.float32:
            return None
        d2 = cfg.dflash2
        first = self.layers[0].input_layernorm
        layout = common_layout(self.layers.modules())
        if layout is None:
            return None
        context = None  # the context projection joins the one call where it is packed alike (ingest_context)
        if native_tiles(self.fc) and self.fc.layout == layout:
            context = ContextWeights(self.fc.weight, norm_weight(self.hidden_norm), self.hidden_norm.eps)
        return DraftBlockWeights.of(layers, norm_weight(first), first.eps, cfg.num_heads, cfg.num_kv_heads,
                                    cfg.head_dim, cfg.intermediate_size, d2.conv_kernel_size if d2 else 0,
                                    d2.conv_group_size if d2 else 0, amx=layout == "amx", context=context)

    def new_cache(self, num_slots: int, capacity: int) -> PositionalKVCache:
        cfg, weight = self.config, self.hidden_norm.weight  # never packed: the activations' dtype
        return PositionalKVCache(
            cfg.num_layers, num_slots, cfg.num_kv_heads, capacity, cfg.head_dim, weight.dtype, weight.device
        )

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                 end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary_cos_sin(self.inv_freq, positions, dtype). On CPU read from a table of the first positions (grown
        by doubling, up to max_position_embeddings unless a position lies beyond): the same elementwise values, in
        one index where the computation is six small ops, whose dispatch costs more than the arithmetic there.
        Elsewhere computed (a table would hold 8 * head_dim bytes a position of device memory). end: one past the
        largest position, where the caller knows it."""
        if positions.device.type != "cpu":
            return rotary_cos_sin(self.inv_freq, positions, dtype)
        table = self.rope_table
        needed = end if end is not None else int(positions.max()) + 1 if positions.numel() else 1
        if table is None or table[0].shape[1] < needed or table[0].dtype != dtype:
            grown = 2 * table[0].shape[1] if table is not None else 1024
            size = max(needed, min(grown, self.config.max_position_embeddings))
            table = self.rope_table = rotary_cos_sin(self.inv_freq, torch.arange(size)[None], dtype)
        return table[0][0][positions], table[1][0][positions]  # [*positions.shape, dim] each

    def ingest_context(self, cache: PositionalKVCache, slots: torch.Tensor, positions: torch.Tensor,
                       features: torch.Tensor) -> None:
        """Cache every layer's keys/values of context rows: features [rows, taps * hidden] of the target,
        for cache slots [rows] at positions [rows]. Context rows are the same in every layer. On the C++ kernels one
        call (draft_block.cpp's dflash_draft_ingest: the demo drafter's ingest took 0.17 ms in per-op calls)."""
        features = features.to(self.hidden_norm.weight.dtype)
        native = self.native_block
        if (native is not None and native.context is not None and features.dtype == torch.float32
                and features.device.type == "cpu"):
            cos, sin = self._cos_sin(positions, torch.float32)  # [rows, dim]
            inputs = DraftContextInputs.build(features, cos, sin, slots, positions, cache.keys, cache.values, native)
            self.kernels.draft_ingest(native, inputs, self.pool)
            return
        context = self.hidden_norm(self.fc(features))[:, None]  # [rows, 1, hidden]
        cos, sin = self._cos_sin(positions[:, None], context.dtype)  # [rows, 1, dim]
        for layer in self.layers:
            layer.self_attn.write_keys_values(context, cos, sin, cache, slots, positions[:, None])

    def block_hidden(self, cache: PositionalKVCache, slots: torch.Tensor, block_start: torch.Tensor,
                     block_embeds: torch.Tensor, key_length: int | None = None,
                     slot_range: tuple[int, int] | None = None) -> torch.Tensor:
        """Denoise one block per slot. block_embeds [b, B, hidden] (anchor then masks) sit at positions
        block_start[b] + 0..B-1, right after the slot's cached context. Returns [b, B, hidden] after the final
        norm. The block's keys/values land past the context length, so the cache keeps context rows only.
        key_length (max(block_start) + B), slot_range (the slots are start..end-1 in order): the host's facts,
        where the caller has them; without key_length they are read back from the device, once for every layer."""
        batch, block, hidden = block_embeds.shape
        positions = block_start[:, None] + torch.arange(block, device=block_start.device)  # [b, B]
        block_end = block_start + block
        reads = CacheReads.of(slots, key_length, slot_range, positions)
        kv_len = reads.length  # one past the batch's last block position
        cos, sin = self._cos_sin(positions, block_embeds.dtype, end=kv_len)  # [b, B, dim]
        if self._runs_native(block_embeds):
            kinds = [(layer.self_attn.causal, layer.self_attn.window) for layer in self.layers]
            by_kind = {kind: visibility_mask(positions, kv_len, visible_end=None if kind[0] else block_end,
                                             sliding_window=kind[1]) for kind in dict.fromkeys(kinds)}
            masks = [by_kind[kind] for kind in kinds]  # layers alike share one mask (and its uint8 copy)
            step = DraftStepInputs.build(cos, sin, slots, positions, masks, cache.keys, cache.values,
                                         self.native_block)
            h = self.kernels.draft_block(block_embeds.reshape(batch * block, hidden), self.native_block, step,
                                         self.pool)
            return h.view(batch, block, hidden)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, cache, slots, positions, block_end, reads)
        return self.norm(x)

    def _runs_native(self, block_embeds: torch.Tensor) -> bool:
        """Whether block_hidden takes the one call: packed for it, float32 on CPU, and no block attention kernel
        chosen (DFLASH_KERNELS=host sends the per-op path to cuda_ext's host build instead)."""
        return (self.native_block is not None and block_embeds.dtype == torch.float32
                and block_embeds.device.type == "cpu" and kernel_entry("block_attention", block_embeds.device) is None)

    def train_hidden(self, features: torch.Tensor, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """The same maths as ingest_context + block_hidden, for many blocks at once and with autograd.

        features [S, taps * hidden] of context positions 0..S-1; block_embeds [R, hidden] (all blocks' rows);
        block_positions [R]; mask [R, S + R] (see training.masks). Returns [R, hidden].
        """
        context = self.hidden_norm(self.fc(features))[None]  # [1, S, hidden]
        cos_c, sin_c = rotary_cos_sin(self.inv_freq, torch.arange(features.shape[0], device=features.device)[None],
                                     context.dtype)
        cos, sin = rotary_cos_sin(self.inv_freq, block_positions[None], block_embeds.dtype)
        x = block_embeds[None]  # [1, R, hidden]
        for layer in self.layers:
            context_k, context_v = layer.self_attn.keys_values(context, cos_c, sin_c)
            x = layer.forward_rows(x, cos, sin, context_k, context_v, mask[None, None], self.config.block_size)
        return self.norm(x)[0]

    def logits(self, hidden: torch.Tensor, lm_head: "torch.Tensor | PackedLinear") -> torch.Tensor:
        """[..., hidden] through the target's lm_head (its weight [vocab, hidden], or packed) -> float32
        [..., vocab], with the published output multiplier and soft-capping."""
        logits = project_rows(hidden, lm_head).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def native_tiles(linear) -> bool:
    """Whether a packed projection is bfloat16 tiles on the C++ kernels, without a bias (what draft_block.cpp
    multiplies)."""
    return isinstance(linear, PackedLinear) and linear.kernels is not None and linear.bias is None


def norm_weight(norm: RMSNorm) -> torch.Tensor:
    return norm.weight.detach().float().contiguous()
