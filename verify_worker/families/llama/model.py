"""The target decoder (Qwen3 / Llama): a batched forward over new tokens with a positional KV cache.

Module names mirror the HF checkpoint's tensor names, so the state dict is the loading table.
"""

import torch
from torch import nn

from cuda_ext.row_attention.op import row_attention
from cuda_ext.row_norm.op import row_norm
from shared.attention import invariant_key_length, visibility_mask
from shared.cpu_kernels.layer_step import StackWeights
from shared.cpu_kernels.library import cpu_kernels
from shared.kv_cache import CacheReads, PositionalKVCache
from shared.layers import GatedMLP, RMSNorm, project_rows, rms_normalize
from shared.packed_linear import KERNEL_LAYOUTS, ROWS_LAYOUT, PackedLinear, packing_layout
from shared.rope import apply_rotary, inverse_frequencies, rotary_cos_sin
from verify_worker.families.common.embedding_head import EmbeddingHead
from verify_worker.families.common.row_invariant import exact_linear_rows
from verify_worker.families.interface import DEFAULT_BLOCK_TOKENS, StepBatch, TargetOutput
from verify_worker.families.llama.backends import EagerLayers, KernelLayers, WholeStack
from verify_worker.families.llama.config import TargetConfig
from verify_worker.families.llama.shard_plan import LocalShapes, local_shapes
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import RowParallelLinear, VocabParallelEmbedding, gather_vocab_logits


def _row_linear(in_local: int, out: int, tp: TensorParallel, bias: bool) -> nn.Linear:
    return RowParallelLinear(in_local, out, tp, bias) if tp.parallel else nn.Linear(in_local, out, bias=bias)


def _reduce_of(linear: nn.Module):
    """The all-reduce a packed copy of this layer must apply (a row-parallel layer's), else None."""
    return linear.tp.all_reduce if isinstance(linear, RowParallelLinear) else None


class TargetAttention(nn.Module):
    """This rank's heads (all of them at TP 1); o_proj sums the ranks' partial outputs."""

    def __init__(self, cfg: TargetConfig, layer_index: int, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = _row_linear(self.num_heads * cfg.head_dim, h, tp, bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = None  # set by pack()
        self.row_attention = False  # set by pack() in the rows layout: cuda_ext's row attention over the cache

    def pack(self, layout: str, multiply=None) -> None:
        """Inference: q, k and v as one GEMM, o_proj in the same layout (see shared.packed_linear; multiply: the
        rows layout's product)."""
        self.qkv_proj = PackedLinear.of(self.q_proj, self.k_proj, self.v_proj, layout=layout, multiply=multiply)
        self.o_proj = PackedLinear.of(self.o_proj, layout=layout, reduce=_reduce_of(self.o_proj), multiply=multiply)
        self.row_attention = multiply is not None
        del self.q_proj, self.k_proj, self.v_proj
        if self.q_norm is not None:  # q's and k's heads normalized in one go: each head row with its norm's weight
            dim = self.head_dim
            self.register_buffer("qk_norm_weight", torch.cat([self.q_norm.weight.detach().expand(self.num_heads, dim),
                                                              self.k_norm.weight.detach().expand(self.num_kv_heads, dim)]))

    def _queries_keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, s, hidden] -> normalized, rotated q [b, heads, s, dim] and k [b, kv_heads, s, dim]; v
        [b, s, kv_heads, dim]."""
        batch, seq, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:  # packed: q and k heads side by side through the norm and the rotary
            qkv = self.qkv_proj(x)  # [b, s, (heads + 2 kv_heads) * dim]
            qk = qkv[..., : (heads + kv_heads) * dim].view(batch, seq, heads + kv_heads, dim)
            if self.q_norm is not None:
                normalize = self.q_norm.normalize or rms_normalize  # (the rows layout's row norm, if set)
                qk = normalize(qk, self.qk_norm_weight, self.q_norm.eps)
            qk = apply_rotary(qk.transpose(1, 2), cos, sin)  # [b, heads + kv_heads, s, dim]
            v = qkv[..., (heads + kv_heads) * dim:].view(batch, seq, kv_heads, dim)
            return qk[:, :heads], qk[:, heads:], v
        q = self.q_proj(x).view(batch, seq, heads, dim)  # [b, s, heads, dim]
        k = self.k_proj(x).view(batch, seq, kv_heads, dim)  # [b, s, kv_heads, dim]
        v = self.v_proj(x).view(batch, seq, kv_heads, dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin), v

    def forward(self, x, cos, sin, cache: PositionalKVCache, slots, read_slots, positions, kv_len, mask, attend):
        q, k, v = self._queries_keys_values(x, cos, sin)  # [b, heads, s, dim], [b, kv_heads, s, dim], [b, s, kv_heads, dim]
        if cache is None:  # training / scoring: the tokens attend to themselves only
            keys, values = k, v.transpose(1, 2)
        elif self.row_attention:  # each row over its own keys in an order of its own (cuda_ext/row_attention)
            cache.write(self.layer_index, slots, positions, k.transpose(1, 2), v)
            out = row_attention(q, cache.keys[self.layer_index], cache.values[self.layer_index], slots, positions,
                                kv_len, self.head_dim**-0.5)  # [b, s, heads * dim]
            return self.o_proj(out)
        else:
            cache.write(self.layer_index, slots, positions, k.transpose(1, 2), v)
            keys, values = cache.read(self.layer_index, read_slots, kv_len)  # [b, kv_heads, kv_len, dim]
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # (a bfloat16 cache under float32 maths: widened)
        out = attend(q, keys, values, mask, self.head_dim**-0.5)  # [b, s, heads * dim]
        return self.o_proj(out)

class TargetDecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_index: int, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TargetAttention(cfg, layer_index, local, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, local.intermediate_size, bias=cfg.mlp_bias)  # gate/up: this rank's columns
        self.mlp.down_proj = _row_linear(local.intermediate_size, cfg.hidden_size, tp, cfg.mlp_bias)

    def forward(self, x, cos, sin, cache, slots, read_slots, positions, kv_len, mask, attend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, read_slots, positions, kv_len, mask,
                               attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    def __init__(self, cfg: TargetConfig, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(local.vocab_shard, cfg.hidden_size, tp) if tp.parallel
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(TargetDecoderLayer(cfg, i, local, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(EmbeddingHead, nn.Module):
    """The whole target at TP 1; at TP N, this rank's shard (embed_weight and lm_head_weight are then this
    rank's vocabulary rows, and the hidden states, taps and logits are whole on every rank)."""

    def __init__(self, cfg: TargetConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.local = local_shapes(cfg, tp)
        self.model = DecoderStack(cfg, self.local, tp)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.local.vocab_shard, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim), persistent=False)
        self.head = None  # the lm_head packed for inference (set by pack())
        self.kernels = None  # the C++ CPU kernels, with their layouts ("bf16", "amx"; set by pack())
        self.backend: KernelLayers | None = None  # the C++ kernels' backend, where they run (set by pack())
        self.pool = None  # the threads the layer stack and the lm_head share (set by pack(), with WholeStack)
        self.kv_dtype: torch.dtype | None = None  # the KV cache's element type; None: the weights' (set by the loader)
        self.rows_layout = False  # packed in the rows layout: every row's result independent of the batch

    @property
    def whole_layers(self) -> StackWeights | None:
        """Every layer as one kernel call takes them, where the backend is WholeStack."""
        return self.backend.weights if isinstance(self.backend, WholeStack) else None

    commits_state = False  # a positional KV cache: rollback is the committed length alone
    graphable_steps = True  # padded rows and tokens leave committed entries alone (verify_worker/step_buckets.py)

    def new_cache(self, num_slots: int, capacity: int) -> PositionalKVCache:
        cfg = self.config
        return PositionalKVCache(
            cfg.num_layers, num_slots, self.local.num_kv_heads, capacity, cfg.head_dim,
            dtype=self.kv_dtype or self.embed_weight.dtype, device=self.embed_weight.device,
        )

    @property
    def takes_pages(self) -> bool:
        """Whether its steps read a paged cache (new_paged_state): on a CPU, every backend but the rows layout,
        whose row attention reads a slot's positions in one piece."""
        return self.embed_weight.device.type == "cpu" and not self.rows_layout

    # the family interface (verify_worker/families/interface.py)
    def new_state(self, num_slots: int, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> PositionalKVCache:
        """block_tokens: not needed (a positional cache rolls back by its length)."""
        return self.new_cache(num_slots, capacity)

    def new_paged_state(self, num_slots: int, capacity: int, page_size: int, num_pages: int) -> PositionalKVCache:
        """Optional (where takes_pages): num_pages pages of page_size positions that num_slots slots of capacity
        positions share through a page table (engine/page_tables.py gives them out)."""
        cfg = self.config
        return PositionalKVCache(
            cfg.num_layers, num_slots, self.local.num_kv_heads, capacity, cfg.head_dim,
            dtype=self.kv_dtype or self.embed_weight.dtype, device=self.embed_weight.device,
            page_size=page_size, num_pages=num_pages,
        )

    def state_bytes_per_slot(self, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
        cfg = self.config
        element = (self.kv_dtype or self.embed_weight.dtype).itemsize
        return 2 * cfg.num_layers * self.local.num_kv_heads * capacity * cfg.head_dim * element

    def step(self, batch: StepBatch, state: PositionalKVCache, taps: tuple[int, ...] = ()) -> TargetOutput:
        return self(batch.input_ids, batch.positions, state, batch.slots, taps, batch.key_length, batch.slot_range)

    def commit(self, state: PositionalKVCache, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """Nothing to do: entries past a slot's committed length are never attended."""

    def reset(self, state: PositionalKVCache, slot: int) -> None:
        """Nothing to do: a new request's positions start at 0 and overwrite what the slot held."""

    def copy_prefix(self, state: PositionalKVCache, source: int, target: int, length: int) -> None:
        """Optional (engine/prefix_cache.py): a kept prefix copied to a request in another slot."""
        state.copy_prefix(source, target, length)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PositionalKVCache | None,
        slots: torch.Tensor | None,
        tap_layers: tuple[int, ...] = (),
        key_length: int | None = None,
        slot_range: tuple[int, int] | None = None,
    ) -> TargetOutput:
        """Run new tokens input_ids [batch, seq] at absolute positions [batch, seq] of cache rows slots [batch].

        Writes their keys/values into the cache; attends causally by absolute position over everything the
        slot holds below each query. Rows may be right-padded: padding sits at later positions, so real
        queries never see it. With cache None (training, scoring) the tokens attend causally among themselves,
        and positions must then be 0..seq-1.

        key_length, slot_range: the host's facts (StepBatch's): with key_length given nothing is read back from
        the device (a CUDA graph can capture the forward), and slots are read by index unless slot_range says
        they are consecutive. A larger key_length than needed gives the same rows (the mask hides the extra keys).
        """
        if cache is None:
            kv_len, read_slots = input_ids.shape[1], None
        else:
            reads = CacheReads.of(slots, key_length, slot_range, positions)
            kv_len, read_slots = min(reads.length, cache.capacity), reads.slots
        x = self.model.embed_tokens(input_ids)  # [b, s, hidden]
        backend = self.backend if cache is not None and self.backend is not None and self.backend.accepts(x) \
            else EagerLayers.of(x, self.rows_layout, cache is not None)
        if cache is not None and backend.invariant_keys:  # whole key chunks: see batch_invariant_attention
            kv_len = invariant_key_length(kv_len, cache.capacity)
        mask = visibility_mask(positions, kv_len) if backend.needs_mask else None  # [b, 1, s, kv_len]
        rope = rotary_cos_sin(self.inv_freq, positions, x.dtype)
        return backend.run(self, x, rope, cache, slots, read_slots, positions, kv_len, mask, tap_layers)

    def pack(self, layout: str | None = "auto", kernel_threads: int = 1) -> "TargetModel":
        """For inference: fuse q/k/v and gate/up into one GEMM each and store the projections (and the lm_head)
        in `layout` ("auto": the one this device and dtype multiply fastest, see shared.packed_linear; None
        keeps the loaded modules; "rows": every product through exact_linear_rows (cuda_ext's row GEMM on a GPU),
        every RMSNorm through cuda_ext's row norm and attention over the cache through its row attention, so that
        a row's result never depends on the batch: --batch-invariant, for a GPU, where cuBLAS's, SDPA's and
        PyTorch's reductions round a row by the row count). The loaded tensors are released; the module
        then no longer has the checkpoint's names. kernel_threads: the threads the C++ layer stack and lm_head
        share, where they run (the same bits whatever the count)."""
        if layout == "auto":
            layout = packing_layout(self.embed_weight)
        if layout is not None:
            multiply = exact_linear_rows if layout == ROWS_LAYOUT else None
            self.rows_layout = multiply is not None
            for norm in self.modules():
                if isinstance(norm, RMSNorm):
                    norm.normalize = row_norm if self.rows_layout else None
            self.head = PackedLinear(self.lm_head_weight.detach(), None, layout, multiply=multiply)
            self.kernels = cpu_kernels() if layout in KERNEL_LAYOUTS else None  # their layer ops and attention too
            for layer in self.model.layers:
                layer.self_attn.pack(layout, multiply)
                layer.mlp.pack(layout, _reduce_of(layer.mlp.down_proj), multiply)
            self.backend = self._backend()
            self.share_kernel_threads(kernel_threads)
        return self

    def _backend(self) -> KernelLayers | None:
        """The packed model's backend for steps over a cache: the C++ kernels' where they run (every layer in one
        call unless tensor parallel or a layer it does not take); None: PyTorch's ops, as the input's dtype and
        device call for (EagerLayers.of)."""
        if self.kernels is None:
            return None
        whole = None if self.tp.parallel else WholeStack.of(self, self.kernels)
        return whole or KernelLayers(self.kernels)

    def share_kernel_threads(self, threads: int) -> None:
        """Run the C++ layer stack and lm_head on `threads` threads (the caller's included; 1: the caller's
        alone). Nothing where the stack does not run (another layout, tensor parallelism)."""
        if self.pool is not None:
            self.pool.close()
        self.pool = self.kernels.worker_pool(threads) if self.whole_layers is not None and threads > 1 else None
        if isinstance(self.head, PackedLinear):
            self.head.pool = self.pool

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 [..., vocab] (gathered from the ranks' vocabulary shards)."""
        local = project_rows(hidden, self.head if self.head is not None else self.lm_head_weight).float()  # [..., vocab shard]
        return gather_vocab_logits(local, self.tp, self.config.vocab_size) if self.tp.parallel else local
