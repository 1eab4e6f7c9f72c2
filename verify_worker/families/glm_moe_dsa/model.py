"""GLM-5.2 (GlmMoeDsaForCausalLM): MLA with a latent cache, the DSA indexer, MoE; our own code, with
transformers as the test oracle (tests/test_glm_moe_dsa.py).

Every layer attends only to the keys its indexer selects (a "shared" layer reuses the selection of the layer
before it). Module names mirror the checkpoint's, with the per-expert tensors stacked as transformers stacks
them, so the state dict is the loading table. Each token row is computed on its own (batched one-row
products, stable sorts for every top-k), so a verify block's rows equal one-token decode rows bit for bit:
that is what keeps speculative greedy decoding identical to plain decoding. This path is written for
correctness on small checkpoints; serving the real 744B model needs the GPU path (fused MLA and expert kernels).

At TP N (shard_plan.py) a rank holds its attention heads and its columns of every MLP and expert; o_proj, the
dense MLPs and each MoE block sum their partial outputs over the ranks.
"""

import torch
from torch import nn

from shared.attention import invariant_key_length, visibility_mask
from shared.layers import RMSNorm
from shared.rope import inverse_frequencies
from shared.rope_settings import RopeSettings
from verify_worker.families.common.dense import GatedMLP, Linear
from verify_worker.families.common.embedding_head import EmbeddingHead
from verify_worker.families.common.kernel_set import TorchKernels, keeps_fp8, kernels_for, use_kernels
from verify_worker.families.common.latent_cache import LatentCache
from verify_worker.families.common.mla import absorbed_attention, interleaved_rotary, rotary_angles
from verify_worker.families.common.moe import MoE
from verify_worker.families.common.sparse_indexer import select_top_keys
from verify_worker.families.glm_moe_dsa.config import INDEXER_NORM_EPS, LATENT_NORM_EPS, GlmMoeDsaConfig
from verify_worker.families.glm_moe_dsa.shard_plan import LocalShapes, local_shapes
from verify_worker.families.interface import DEFAULT_BLOCK_TOKENS, StepBatch, TargetOutput
from verify_worker.parallel.group import TensorParallel
from verify_worker.parallel.layers import VocabParallelEmbedding, gather_vocab_logits


class Indexer(nn.Module):
    def __init__(self, cfg: GlmMoeDsaConfig):
        super().__init__()
        self.heads, self.dim, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.top_k = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim)
        self.wk = Linear(cfg.hidden_size, self.dim)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, fp8=False)
        self.glm_kernels = TorchKernels()  # the scores' kernel, chosen again when the model is packed

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, s, hidden] -> indexer keys [b, s, dim] (normalised, the first rope dims rotated)."""
        k = self.k_norm(self.wk(x))
        return torch.cat([interleaved_rotary(k[..., : self.rope], cos, sin), k[..., self.rope:]], -1)

    def select(self, x, q_resid, cos, sin, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The keys each query row attends to: [b, s, T] bool, keys [b, T, dim] from the cache."""
        batch, seq, _ = x.shape
        q = self.wq_b(q_resid).view(batch, seq, self.heads, self.dim)
        q = torch.cat([interleaved_rotary(q[..., : self.rope], cos, sin), q[..., self.rope:]], -1)
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [b, s, heads]
        return select_top_keys(self.glm_kernels.index_scores(q, keys, weights, self.dim**-0.5), visible, self.top_k)


class LatentAttention(nn.Module):
    """This rank's heads (all of them at TP 1); the latent, the indexer and the selection are whole on every rank."""

    def __init__(self, cfg: GlmMoeDsaConfig, layer_index: int, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.cfg, self.layer_index, self.tp = cfg, layer_index, tp
        self.num_heads = heads = local.num_heads
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                fp8=False)  # read per head (bfloat16 views)
        self.o_proj = Linear(heads * cfg.v_head_dim, cfg.hidden_size)
        self.indexer = Indexer(cfg) if cfg.indexer_types[layer_index] == "full" else None
        self.scale = cfg.qk_head_dim**-0.5
        self.glm_kernels = TorchKernels()  # the attention's kernels, chosen again when the model is packed

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b split per head: w_uk [heads, nope, kv_lora], w_uv [heads, v, kv_lora]."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def forward(self, x, cos, sin, cache: LatentCache, slots, positions, kv_len, visible, selected):
        """x [b, s, hidden]. selected: the previous layer's selection for a shared layer, else None.
        Returns (output [b, s, hidden], this layer's selection [b, s, kv_len])."""
        cfg = self.cfg
        batch, seq, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [b, s, q_lora]
        q = self.q_b_proj(q_resid).view(batch, seq, self.num_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], interleaved_rotary(q[..., cfg.qk_nope_head_dim:], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)  # [b, s, kv_lora + rope]
        latent = self.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        key_rope = interleaved_rotary(kv[..., cfg.kv_lora_rank:], cos, sin)
        index_keys = self.indexer.keys(x, cos, sin) if self.indexer is not None else None
        cache.write(self.layer_index, slots, positions, latent, key_rope, index_keys)
        latents, key_ropes, cached_index_keys = cache.read(self.layer_index, slots, kv_len)
        if self.indexer is not None:
            selected = self.indexer.select(x, q_resid, cos, sin, cached_index_keys, visible)
        w_uk, w_uv = self.absorbed_weights()
        out = absorbed_attention(q_nope, q_rope, latents, key_ropes, w_uk, w_uv, selected, self.scale, self.glm_kernels,
                                 cfg.index_topk)  # a selection is at most index_topk keys
        return self.tp.all_reduce(self.o_proj(out)), selected


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GlmMoeDsaConfig, layer_index: int, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, layer_index, local, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = cfg.mlp_layer_types[layer_index] == "dense"
        self.mlp = GatedMLP(cfg.hidden_size, local.intermediate_size, tp.all_reduce) if dense else \
            MoE(cfg, local.moe_intermediate_size, tp)


class DecoderStack(nn.Module):
    def __init__(self, cfg: GlmMoeDsaConfig, local: LocalShapes, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(local.vocab_shard, cfg.hidden_size, tp) if tp.parallel
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, local, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GlmMoeDsaModel(EmbeddingHead, nn.Module):
    """The family interface (verify_worker/families/interface.py) over a positional latent cache."""

    commits_state = False  # every cache is positional: rollback is the committed length
    graphable_steps = True  # padded rows and tokens leave committed entries alone (verify_worker/step_buckets.py)

    def __init__(self, cfg: GlmMoeDsaConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.local = local_shapes(cfg, tp)
        self.model = DecoderStack(cfg, self.local, tp)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, self.local.vocab_shard, fp8=False)
        self.glm_kernels = TorchKernels()  # the lm_head's product (tied or not), chosen again when the model is packed
        self.register_buffer("inv_freq", inverse_frequencies(RopeSettings(cfg.rope_theta), cfg.qk_rope_head_dim),
                             persistent=False)

    def new_state(self, num_slots: int, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> LatentCache:
        """block_tokens: not needed (a positional cache rolls back by its length)."""
        cfg = self.config
        indexed = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
        return LatentCache(range(cfg.num_layers), indexed, num_slots, capacity, cfg.kv_lora_rank,
                           cfg.qk_rope_head_dim, cfg.index_head_dim, self.embed_weight.dtype, self.embed_weight.device)

    def state_bytes_per_slot(self, capacity: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
        cfg = self.config
        per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + \
            cfg.indexer_types.count("full") * cfg.index_head_dim
        return per_token * capacity * self.embed_weight.element_size()

    def step(self, batch: StepBatch, state: LatentCache, taps: tuple[int, ...] = ()) -> TargetOutput:
        return self(batch.input_ids, batch.positions, state, batch.slots, taps, batch.key_length)

    def commit(self, state: LatentCache, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """Nothing to do: entries past a slot's committed length are masked by position before any top-k."""

    def reset(self, state: LatentCache, slot: int) -> None:
        """Nothing to do: a new request's positions start at 0 and overwrite what the slot held."""

    def copy_prefix(self, state: LatentCache, source: int, target: int, length: int) -> None:
        """Optional (engine/prefix_cache.py): a kept prefix copied to a request in another slot."""
        state.copy_prefix(source, target, length)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: LatentCache, slots: torch.Tensor,
                tap_layers: tuple[int, ...] = (), key_length: int | None = None) -> TargetOutput:
        """New tokens input_ids [b, s] at absolute positions [b, s] of cache rows slots [b] (rows may be
        right-padded: padding sits at later positions, so real queries never see it). key_length: at least
        max(positions) + 1, from the host (None: read from the device)."""
        key_length = key_length if key_length is not None else int(positions.max()) + 1
        # whole key chunks: masked keys past a row's own then only add exact zeros (see latent_attention)
        kv_len = invariant_key_length(key_length, cache.capacity)
        visible = visibility_mask(positions, kv_len)[:, 0]  # [b, s, kv_len]
        x = self.model.embed_tokens(input_ids)  # [b, s, hidden]
        cos, sin = rotary_angles(self.inv_freq, positions, x.dtype)
        taps, selected = {}, None
        for index, layer in enumerate(self.model.layers):
            attention, selected = layer.self_attn(layer.input_layernorm(x), cos, sin, cache, slots,
                                                  positions, kv_len, visible, selected)
            x = x + attention
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if index in tap_layers:
                taps[index] = x
        tapped = torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None
        return TargetOutput(hidden=self.model.norm(x), taps=tapped)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 [..., vocab] (gathered from the ranks' vocabulary shards)."""
        local = self.glm_kernels.rows(hidden, self.lm_head_weight).float()  # [..., vocab shard]
        return gather_vocab_logits(local, self.tp, self.config.vocab_size) if self.tp.parallel else local

    def pack(self, layout: str | None = "auto") -> "GlmMoeDsaModel":
        """The kernels for the device (kernel_set.py: experts, MLA heads, attention and the indexer's scores on
        Triton kernels on CUDA where Triton is installed, else PyTorch's); the projections read the loaded weights
        row by row (the kernel set's rows)."""
        use_kernels(self, kernels_for(self.embed_weight.device, self.embed_weight.dtype, keeps_fp8(self)))
        return self
