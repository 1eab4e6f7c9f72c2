"""GLM-5.3-Flash's text model (transformers `Glm5NextTextModel`): KDA linear attention with exact speculative
rollback, MLA without RoPE behind a pooled DSA indexer, mHC residual streams, SwiGLU-clamped MoE. Our own
code, transformers as the test oracle (tests/test_glm5_next.py).

Verify == decode by construction: a verify block goes through the same token-by-token KDA recurrence as one-token
decoding (PyTorch's ops, or fla's fused recurrent Triton kernel on CUDA: kda_recurrence.py; transformers runs
multi-token calls through its chunked form instead), and, as in the GLM-5.2 family, every token row is computed
on its own (one-row products, fixed-order sums over streams, stable top-k). Prefill uses the recurrent step
too, but for fla's chunk_kda on a GPU where it holds (docs/decisions/0025). A step changes the KDA state by
device operations alone (state.py), so it can be replayed from a CUDA graph.
"""

import torch
from torch import nn
from torch.nn import functional as F

from shared.attention import invariant_key_length
from shared.layers import RMSNorm
from verify_worker.families.common.dense import GatedMLP, Linear
from verify_worker.families.common.embedding_head import EmbeddingHead
from verify_worker.families.common.kernel_set import TorchKernels, keeps_fp8, kernels_for, use_kernels
from verify_worker.families.common.hyper_connection import HyperConnection, expand, stream_mean
from verify_worker.families.common.kda import causal_conv
from verify_worker.families.common.kda_recurrence import TorchRecurrence, recurrence_for
from verify_worker.families.common.latent_cache import LatentCache
from verify_worker.families.common.mla import absorbed_attention
from verify_worker.families.common.moe import MoE
from verify_worker.families.common.pooled_indexer import pool_keys, select_pooled
from verify_worker.families.common.row_invariant import elementwise_rows
from verify_worker.families.glm5_next.config import Glm5NextConfig
from verify_worker.families.glm5_next.shard_plan import LocalShapes, local_shapes
from verify_worker.families.glm5_next.state import Glm5NextState, RecurrentState, TokenInputs
from verify_worker.families.interface import DEFAULT_BLOCK_TOKENS, StepBatch, TargetOutput
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import VocabParallelEmbedding, gather_vocab_logits

INDEXER_NORM_EPS = 1e-6


class ConvWeight(nn.Module):
    """One of q/k/v's depthwise conv kernels, [channels, 1, kernel] float32 (the checkpoint's q_conv1d etc.)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32))


class KdaAttention(nn.Module):
    """This rank's KDA heads (all of them at TP 1); o_proj sums the ranks' partial outputs."""

    def __init__(self, cfg: Glm5NextConfig, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.heads, self.dim, self.eps = local.linear_num_heads, cfg.linear_head_dim, cfg.rms_norm_eps
        h, dim = cfg.hidden_size, cfg.linear_head_dim
        inner = self.heads * dim
        bf16 = dict(fp8=False)  # KDA's projections stay bfloat16 in GLM-5.3-Flash's FP8 checkpoints
        self.q_proj, self.k_proj = Linear(h, inner, **bf16), Linear(h, inner, **bf16)
        self.v_proj = Linear(h, inner, **bf16)
        self.q_conv1d, self.k_conv1d = ConvWeight(inner, cfg.conv_kernel), ConvWeight(inner, cfg.conv_kernel)
        self.v_conv1d = ConvWeight(inner, cfg.conv_kernel)
        self.f_a_proj, self.f_b_proj = Linear(h, dim, **bf16), Linear(dim, inner, **bf16)
        self.dt_bias = nn.Parameter(torch.empty(inner, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32))
        self.b_proj = Linear(h, self.heads, **bf16)
        self.g_a_proj, self.g_b_proj = Linear(h, dim, **bf16), Linear(dim, inner, **bf16)
        self.o_norm = RMSNorm(dim, cfg.rms_norm_eps)  # its weight; the gated norm is computed below
        self.o_proj = Linear(inner, h, **bf16)
        self.lower_bound = cfg.gate_lower_bound
        self.recurrence = TorchRecurrence()  # chosen again when the model is packed
        self.glm_kernels = TorchKernels()  # the norms' kernels, chosen again when the model is packed

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """The forget gate g [b, s, heads, dim] (float32): lb * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))."""
        batch, seq, _ = x.shape
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(batch, seq, self.heads, self.dim)
        rate = elementwise_rows(torch.exp, self.A_log.float()[None])[0][:, None]  # [heads, 1]
        if self.lower_bound is not None:
            return self.lower_bound * elementwise_rows(torch.sigmoid, rate * g)
        softplus = torch.where(g > 20.0, g, elementwise_rows(torch.log1p, elementwise_rows(torch.exp, g)))
        return -rate * softplus

    def forward(self, x: torch.Tensor, state: RecurrentState, slots: torch.Tensor, lengths: torch.Tensor,
                offsets: torch.Tensor, prefill: bool = False):
        """x [b, s, hidden] -> [b, s, hidden]. Starts each row from its slot's tip, leaves the tip after the row's
        real tokens (lengths [b]), and keeps their recurrence inputs for the commit at the slot's places from
        offsets [b] (its pending tokens before this forward). prefill: prompt chunks, which the recurrence may take
        in by its chunked form (kda_recurrence.py). Device operations only."""
        batch, seq, _ = x.shape
        heads, dim = self.heads, self.dim
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)  # [b, s, 3 * inner]
        kernel = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # [C, K]
        window = state.tip_window[slots]  # [b, C, K-1]
        mixed = elementwise_rows(F.silu, causal_conv(window, raw, kernel))  # [b, s, C] float32
        q, k, v = (part.reshape(batch, seq, heads, dim) for part in mixed.split(heads * dim, -1))
        q = self.glm_kernels.l2_norm(q) * dim**-0.5
        k = self.glm_kernels.l2_norm(k)
        g = self.log_decay(x)  # [b, s, heads, dim]
        decay = elementwise_rows(torch.exp, g)
        beta = elementwise_rows(torch.sigmoid, self.b_proj(x).float())  # [b, s, heads]
        live = torch.arange(seq, device=x.device)[None] < lengths[:, None]  # [b, s]
        # [b, heads, dk, dv], [b, s, heads, dv]: token by token from each row's tip (kda_recurrence.py)
        run = self.recurrence.run_prompt if prefill else self.recurrence.run
        state.tip[slots], out = run(state.tip[slots], q, k, v, decay, g, beta, live)
        series = torch.cat([window, raw.transpose(1, 2).float()], -1)  # [b, C, K-1+s]
        take = lengths[:, None] + torch.arange(window.shape[-1], device=x.device)  # the last K-1 real inputs
        state.tip_window[slots] = series.gather(-1, take[:, None].expand(-1, series.shape[1], -1))
        state.keep(slots, offsets, live, TokenInputs(k, v, decay, g, beta, raw))
        gate = self.g_b_proj(self.g_a_proj(x)).view(batch, seq, heads, dim).float()
        normed = self.glm_kernels.norm(out, self.o_norm.weight.float(), self.eps)  # [b, s, heads, dim]
        normed = normed * elementwise_rows(torch.sigmoid, gate)
        return self.tp.all_reduce(self.o_proj(normed.to(x.dtype).reshape(batch, seq, -1)))


class PooledIndexer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        self.heads, self.dim, self.kpool = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        self.top_pools, self.tail = cfg.index_topk // cfg.index_kpool, cfg.always_select_tail
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim)
        self.wk = Linear(cfg.hidden_size, self.dim)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, fp8=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(self.kpool, self.dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.dim, cfg.hidden_size))
        self.glm_kernels = TorchKernels()  # the scores' kernel, chosen again when the model is packed

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, hidden] -> what the cache keeps per token [b, s, 2 * dim]: the key, then the pooling gate."""
        return torch.cat([self.k_norm(self.wk(x)), self.glm_kernels.rows(x, self.index_kpool_compress_gate)], -1)

    def select(self, x, q_resid, cached: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """cached [b, T, 2 * dim] -> the keys each query attends to [b, s, T] (bool)."""
        batch, seq, _ = x.shape
        total = cached.shape[1]
        whole = total - total % self.kpool
        pooled = pool_keys(cached[:, :whole, : self.dim], cached[:, :whole, self.dim:], self.index_kpool_compress_ape)
        q = self.wq_b(q_resid).view(batch, seq, self.heads, self.dim)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        scores = self.glm_kernels.index_scores(q, pooled, weights, self.dim**-0.5)  # [b, s, pools]
        return select_pooled(scores, positions, self.kpool, self.top_pools, total, self.tail)


class NopeLatentAttention(nn.Module):
    """MLA without a rotary part: keys and values come from the normalised latent alone."""

    def __init__(self, cfg: Glm5NextConfig, layer_index: int, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.cfg, self.layer_index, self.tp = cfg, layer_index, tp
        self.num_heads = heads = local.num_heads
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_nope_head_dim)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                fp8=False)  # read per head (bfloat16 views)
        self.o_proj = Linear(heads * cfg.v_head_dim, cfg.hidden_size)
        self.indexer = PooledIndexer(cfg) if cfg.indexer_types[layer_index] == "full" else None
        self.glm_kernels = TorchKernels()  # the attention's kernels, chosen again when the model is packed

    def forward(self, x, cache: LatentCache, slots, positions, kv_len, selected):
        cfg = self.cfg
        batch, seq, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(batch, seq, self.num_heads, cfg.qk_nope_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))  # [b, s, kv_lora]
        no_rope = latent[..., :0]
        entries = self.indexer.entries(x) if self.indexer is not None else None
        cache.write(self.layer_index, slots, positions, latent, no_rope, entries)
        latents, key_ropes, cached = cache.read(self.layer_index, slots, kv_len)
        if self.indexer is not None:
            selected = self.indexer.select(x, q_resid, cached, positions)
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        kpool = cfg.index_kpool  # a selection: top_pools whole pools, and the query's own incomplete one
        width = cfg.index_topk // kpool * kpool + (kpool - 1 if cfg.always_select_tail else 0)
        out = absorbed_attention(q, q[..., :0], latents, key_ropes, w[:, : cfg.qk_nope_head_dim],
                                 w[:, cfg.qk_nope_head_dim:], selected, cfg.qk_nope_head_dim**-0.5, self.glm_kernels,
                                 width)
        return self.tp.all_reduce(self.o_proj(out)), selected


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, layer_index: int, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.linear = cfg.layer_types[layer_index] == "linear"
        hc = dict(streams=cfg.hc_mult, hidden=cfg.hidden_size, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                  norm_eps=cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(**hc), HyperConnection(**hc)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = KdaAttention(cfg, local, tp) if self.linear else \
            NopeLatentAttention(cfg, layer_index, local, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        limit = cfg.swiglu_limit
        self.mlp = GatedMLP(cfg.hidden_size, local.intermediate_size, tp.all_reduce, limit) \
            if cfg.mlp_layer_types[layer_index] == "dense" else MoE(cfg, local.moe_intermediate_size, tp, limit)


class DecoderStack(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(local.vocab_shard, cfg.hidden_size, tp) if tp.parallel
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, local, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm5NextModel(EmbeddingHead, nn.Module):
    """The family interface (verify_worker/families/interface.py); its commit restores KDA states exactly."""

    commits_state = True
    graphable_steps = True  # padded rows take in no token, a step's record is made on the device (state.py)

    def __init__(self, cfg: Glm5NextConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.local = local_shapes(cfg, tp)
        self.model = DecoderStack(cfg, self.local, tp)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, self.local.vocab_shard, fp8=False)
        self.glm_kernels = TorchKernels()  # the lm_head's product (tied or not), chosen again when the model is packed

    def _attention_layers(self) -> tuple[list[int], list[int]]:
        cfg = self.config
        attention = [i for i, t in enumerate(cfg.layer_types) if t == "indexed"]
        return attention, [i for i in attention if cfg.indexer_types[i] == "full"]

    def new_state(self, num_slots: int, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Glm5NextState:
        """block_tokens: the pending tokens a commit may roll back within (the verify block: a slot's tokens
        between two commits, where they follow no prompt chunk); their KDA inputs are kept for the replay."""
        cfg, device = self.config, self.embed_weight.device
        attention, indexed = self._attention_layers()
        latent = LatentCache(attention, indexed, num_slots, capacity, cfg.kv_lora_rank, 0, 2 * cfg.index_head_dim,
                             self.embed_weight.dtype, device)
        heads, dim = self.local.linear_num_heads, cfg.linear_head_dim
        recurrent = {i: RecurrentState(num_slots, heads, dim, dim, 3 * heads * dim, cfg.conv_kernel, block_tokens,
                                       self.embed_weight.dtype, device, self.model.layers[i].self_attn.recurrence)
                     for i, kind in enumerate(cfg.layer_types) if kind == "linear"}
        return Glm5NextState(latent, recurrent, block_tokens, device)

    def state_bytes_per_slot(self, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
        """The caches per request: latent and indexer entries per position, and per KDA layer two states and
        conv windows (whatever the block size) and the inputs of block_tokens pending tokens."""
        cfg = self.config
        attention, indexed = self._attention_layers()
        per_position = (len(attention) * cfg.kv_lora_rank + len(indexed) * 2 * cfg.index_head_dim) * \
            self.embed_weight.element_size()
        kda_layers = cfg.layer_types.count("linear")
        heads, dim = self.local.linear_num_heads, cfg.linear_head_dim
        channels = 3 * heads * dim
        states = 2 * 4 * (heads * dim**2 + channels * (cfg.conv_kernel - 1))
        per_token = 4 * (4 * heads * dim + heads) + channels * self.embed_weight.element_size()  # k v decay g beta raw
        pending_count = 8 if kda_layers else 0
        return per_position * capacity + kda_layers * (states + block_tokens * per_token) + pending_count

    def step(self, batch: StepBatch, state: Glm5NextState, taps: tuple[int, ...] = ()) -> TargetOutput:
        lengths = batch.lengths if batch.lengths is not None else \
            torch.full((batch.input_ids.shape[0],), batch.input_ids.shape[1], device=batch.input_ids.device)
        return self(batch.input_ids, batch.positions, state, batch.slots, taps, lengths, batch.key_length,
                    batch.prefill)

    def forward(self, input_ids, positions, state: Glm5NextState, slots, tap_layers=(), lengths=None,
                key_length: int | None = None, prefill: bool = False) -> TargetOutput:
        """key_length: at least max(positions) + 1, from the host (None: read from the device); prefill: prompt
        chunks (StepBatch.prefill)."""
        if lengths is None:
            lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], device=input_ids.device)
        key_length = key_length if key_length is not None else int(positions.max()) + 1
        kv_len = invariant_key_length(key_length, state.capacity)
        x = self.model.embed_tokens(input_ids)  # [b, s, hidden]
        streams = x[:, :, None].expand(-1, -1, self.config.hc_mult, -1).contiguous()  # [b, s, N, hidden]
        taps, selected = {}, None
        offsets = state.begin(slots)  # [b] each row's pending tokens: where the KDA layers keep its inputs
        for index, layer in enumerate(self.model.layers):
            post, comb, h = layer.attn_hc(streams)
            h = layer.input_layernorm(h)
            if layer.linear:
                h = layer.self_attn(h, state.recurrent[index], slots, lengths, offsets, prefill)
                selected = None
            else:
                h, selected = layer.self_attn(h, state.latent, slots, positions, kv_len, selected)
            streams = expand(post, comb, h, streams)
            post, comb, h = layer.ffn_hc(streams)
            streams = expand(post, comb, layer.mlp(layer.post_attention_layernorm(h)), streams)
            if index in tap_layers:
                taps[index] = stream_mean(streams)
        state.advance(slots, lengths)  # only a forward that reached its end (a failed one is undone by a commit of 0)
        tapped = torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None
        return TargetOutput(hidden=self.model.norm(stream_mean(streams)), taps=tapped)

    def commit(self, state: Glm5NextState, slots: torch.Tensor, kept: torch.Tensor) -> None:
        state.commit(slots, kept)  # worked out once for every KDA layer (their pending tokens are the same)

    def reset(self, state: Glm5NextState, slot: int) -> None:
        state.reset(slot)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 [..., vocab] (gathered from the ranks' vocabulary shards)."""
        local = self.glm_kernels.rows(hidden, self.lm_head_weight).float()
        return gather_vocab_logits(local, self.tp, self.config.vocab_size) if self.tp.parallel else local

    def pack(self, layout: str | None = "auto") -> "Glm5NextModel":
        """The kernels for the device: on CUDA, fla's Triton KDA recurrence where fla-core is installed (and its
        chunk_kda for prompt chunks where the check at pack holds, at this rank's KDA shapes, without tensor
        parallelism) and the kernel set of kernel_set.py where Triton is (experts, MLA heads, attention, the
        indexer's scores, projections and norms); else PyTorch's ops (kda_recurrence.py, kernel_set.py). Call before
        new_state: a state replays with its model's recurrence."""
        use_kernels(self, kernels_for(self.embed_weight.device, self.embed_weight.dtype, keeps_fp8(self)))
        shapes = (self.local.linear_num_heads, self.config.linear_head_dim)
        return self.use_recurrence(recurrence_for(self.embed_weight.device, shapes, self.tp.parallel))

    def use_recurrence(self, recurrence) -> "Glm5NextModel":
        for layer in self.model.layers:
            if layer.linear:
                layer.self_attn.recurrence = recurrence
        return self

    @property
    def prefill_align(self) -> int:
        """Prompt chunks start at multiples of this (the recurrence's chunked form's chunk; 1 without one)."""
        layer = next((layer for layer in self.model.layers if layer.linear), None)
        return layer.self_attn.recurrence.prefill_align if layer is not None else 1

    @property
    def recurrence_name(self) -> str:
        layer = next((layer for layer in self.model.layers if layer.linear), None)
        return layer.self_attn.recurrence.name if layer is not None else "none"
