"""The DFlash 2 drafter: the DFlash backbone with a dual-tap dynamic convolution around every attention and MLP
sublayer, and a candidate path selector over the top-K tokens of each drafted position.

Module names are the published tensor names (layers.{i}.attention_conv / mlp_conv .base_kernel and
.kernel_projection.weight; candidate_selector.predecessor_codebook / successor_codebook / hidden_projection).
"""

import dataclasses

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from cuda_ext.dflash2_walk.op import walk
from cuda_ext.dflash2_walk.reference import pair_scores
from cuda_ext.dispatch import kernel_mode
from draft_worker.draft_model import DFlashDraftModel, DraftDecoderLayer, native_tiles
from shared.cpu_kernels.draft_step import ConvWeights
from shared.cpu_kernels.draft_walk import DraftWalkWeights
from shared.draft_config import DraftConfig
from shared.kv_cache import CacheReads
from shared.packed_linear import PackedLinear


class DynamicConv(nn.Module):
    """Per-channel causal convolution over a block's rows whose kernel is a learnt base plus a per-row,
    per-channel-group offset predicted from the sublayer input. prepare() filters the sublayer's input with
    tap set 0; finish() filters its output with tap set 1, using the offsets prepare() computed. Taps never
    reach across the block start (rows before it count as zero)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))  # [tap set, offset, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        """Offset 0 weighs 1, the others 0, no dynamic part: prepare and finish return their input."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def pack(self, layout: str) -> None:
        """Inference: the kernel projection in the layer's layout (on the C++ kernels, the same GEMM as
        draft_block.cpp's)."""
        self.kernel_projection = PackedLinear.of(self.kernel_projection, layout=layout)

    def native_weights(self) -> ConvWeights | None:
        if not native_tiles(self.kernel_projection):
            return None
        return ConvWeights(self.kernel_projection.weight, self.base_kernel.detach().float().contiguous())

    def _filter(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [n, B, H]; weights [n, B, kernel, H]: y_t = sum_o weights[t, o] * x_{t-o}."""
        block = x.shape[1]
        out = x * weights[:, :, 0]
        for offset in range(1, self.kernel):
            shifted = F.pad(x, (0, 0, offset, 0))[:, :block]  # [n, B, H]: x_{t-offset}, zero before the start
            out = out + shifted * weights[:, :, offset]
        return out

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, B, H] -> (filtered x, the offsets kept for finish [n, B, kernel, H])."""
        n, block, hidden = x.shape
        dynamic = self.kernel_projection(x).view(n, block, 2, self.kernel, hidden // self.group)
        dynamic = dynamic.repeat_interleave(self.group, -1)  # [n, B, 2, kernel, H]
        return self._filter(x, self.base_kernel[0] + dynamic[:, :, 0]), dynamic[:, :, 1]

    def finish(self, z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return self._filter(z, self.base_kernel[1] + kept)


class DFlash2DecoderLayer(DraftDecoderLayer):
    def __init__(self, cfg: DraftConfig, layer_index: int):
        super().__init__(cfg, layer_index)
        d2 = cfg.dflash2
        self.attention_conv = DynamicConv(cfg.hidden_size, d2.conv_kernel_size, d2.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, d2.conv_kernel_size, d2.conv_group_size)

    def pack(self, layout: str) -> None:
        super().pack(layout)
        self.attention_conv.pack(layout)
        self.mlp_conv.pack(layout)

    def native_convs(self) -> tuple[ConvWeights, ConvWeights] | None:
        convs = self.attention_conv.native_weights(), self.mlp_conv.native_weights()
        return None if None in convs else convs

    def _sublayers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """x [n, B, H] whole blocks; attend(h [n, B, H]) -> attention output [n, B, H]."""
        h, kept = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(attend(h), kept)
        h, kept = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kept)

    def forward(self, x, cos, sin, cache, slots, positions, block_end, reads: CacheReads):
        return self._sublayers(x, lambda h: self.self_attn(h, cos, sin, cache, slots, positions, block_end, reads))

    def forward_rows(self, x, cos, sin, context_k, context_v, mask, block_size: int):
        rows, hidden = x.shape[1], x.shape[2]
        blocks = x.view(rows // block_size, block_size, hidden)  # [A, B, H]

        def attend(h):
            out = self.self_attn.forward_rows(h.reshape(1, rows, hidden), cos, sin, context_k, context_v, mask)
            return out.view(rows // block_size, block_size, hidden)

        return self._sublayers(blocks, attend).reshape(1, rows, hidden)


class CandidateSelector(nn.Module):
    """Scores candidate k at a drafted row t, after the token prev chosen for row t-1:
    score = unary_k + < predecessor[prev] * hidden_projection(h_t), successor[cand_k] >."""

    def __init__(self, vocab: int, hidden: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def scores(self, unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor,
               projected: torch.Tensor) -> torch.Tensor:
        """unary, candidates [..., K]; previous [...]; projected [..., r] -> float32 scores [..., K]."""
        return pair_scores(unary, candidates, previous, projected, self.predecessor_codebook,
                           self.successor_codebook)


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2DecoderLayer

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.dflash2.selector_rank)

    def pack(self, layout: str | None = "auto") -> "DFlash2DraftModel":
        """The backbone's packing (DFlashDraftModel.pack), and the selector's hidden projection in the same layout:
        on the C++ kernels its product stays in the kernel the rest of the call runs (through torch it took 80 us
        of a demo draft call, MKL's path gone cold after the block, against 14 us back to back)."""
        super().pack(layout)
        selector = self.candidate_selector
        if isinstance(self.fc, PackedLinear) and not isinstance(selector.hidden_projection, PackedLinear):
            selector.hidden_projection = PackedLinear.of(selector.hidden_projection, layout=self.fc.layout)
        return self

    @property
    def top_k(self) -> int:
        return self.config.dflash2.selector_top_k

    @property
    def sample_top_k(self) -> int:
        return self.config.dflash2.sample_top_k

    def candidates(self, logits: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] -> (unary [..., K], candidate ids [..., K]), best first (equal logits in id order
        through the C++ kernel, where the packed drafter has it)."""
        k = min(k or self.top_k, logits.shape[-1])
        if self.kernels is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            return self.kernels.top_k(logits, k)
        return logits.topk(k, dim=-1)

    def candidate_set(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k of logits [..., V] in no particular order: (unary [..., K], ids [..., K]). A sampled walk
        needs the set only (any order of it gives the same q); on CPU numpy's partition takes 46 us where a
        sorted topk of 1024 among 4096 took 429 us (7 rows, one thread)."""
        k = min(k, logits.shape[-1])
        if logits.device.type != "cpu" or k == logits.shape[-1]:
            return logits.topk(k, dim=-1, sorted=False)
        ids = torch.from_numpy(np.argpartition(-logits.detach().float().numpy(), k - 1, axis=-1)[..., :k].copy())
        return logits.gather(-1, ids), ids

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor, temperatures: torch.Tensor,
             uniforms: torch.Tensor | None, k: int | None = None):
        """Choose one path through the candidates of rows 1..n of each block.

        hidden [b, n, H] and logits [b, n, V] of the drafted rows; anchors [b] (the token before row 1);
        temperatures [b] (0 = greedy: the best score); uniforms [b, n] float64 for the sampled rows.
        Returns (tokens [b, n], q [b, n, K] (the distribution each token was drawn from; one-hot where greedy),
        candidate ids [b, n, K]).
        """
        sampling, ordered = False, True  # without uniforms every row is greedy: no q is needed but the one-hot
        if uniforms is not None:
            greedy = temperatures <= 0
            sampling = not bool(greedy.all())
            # a greedy row's argmax breaks ties by candidate order (best first); an all-sampled walk needs the set only
            ordered = not sampling or bool(greedy.any())
        unary, candidates = self.candidates(logits, k) if ordered else self.candidate_set(logits, k or self.top_k)
        projected = self.candidate_selector.hidden_projection(hidden)  # [b, n, r]
        selector = self.candidate_selector
        tokens, _, q = walk(unary, candidates, anchors, projected, selector.predecessor_codebook,
                            selector.successor_codebook, temperatures, uniforms if sampling else None)
        return tokens, q, candidates

    def native_walk(self, lm_head: "torch.Tensor | PackedLinear") -> DraftWalkWeights | None:
        """The greedy walk from the block's hidden states in one C++ call (draft_walk.cpp), where it computes what
        logits() and walk() compute: the head and the selector's projection packed alike on the C++ kernels, no
        output multiplier or soft-capping, float32 codebooks. None elsewhere."""
        selector, cfg = self.candidate_selector, self.config
        projection = selector.hidden_projection
        if not (native_tiles(lm_head) and native_tiles(projection) and lm_head.layout == projection.layout
                and cfg.output_multiplier == 1.0 and not cfg.final_logit_softcapping
                and selector.predecessor_codebook.dtype == torch.float32):
            return None
        return DraftWalkWeights.of(lm_head.weight, lm_head.out_features, projection.weight,
                                   selector.predecessor_codebook.detach().contiguous(),
                                   selector.successor_codebook.detach().contiguous(),
                                   min(self.top_k, lm_head.out_features), amx=lm_head.layout == "amx")

    def greedy_walk(self, weights: DraftWalkWeights, hidden: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor | None:
        """walk()'s greedy tokens [b, B-1] of rows 1.. of each block, from hidden [b, B, H] (the block's final
        norm) and anchors [b], in one call (native_walk's weights). None where it does not run: a float32 CPU
        block with the default kernel choice (DFLASH_KERNELS=host or reference asks for walk()'s own path), and
        logits without top_k numbers in a row."""
        if kernel_mode() != "auto" or hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        return self.kernels.draft_greedy_walk(weights, hidden, hidden.shape[1] - 1, anchors, self.pool)

    def selector_loss(self, hidden: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor,
                      labels: torch.Tensor, target_logp: torch.Tensor | None = None) -> torch.Tensor:
        """The selector's loss per row (teacher forcing: previous is the true token before each row).

        hidden [R, H], logits [R, V], previous and labels [R]. Without target_logp: K-way cross-entropy over the
        top-K candidates, the gold label put in the last slot where it is missing (trains the greedy walk).
        With target_logp [R, V] (the target's log-distribution of each row's token): cross-entropy from the
        target's distribution to the selector's scores over the whole vocabulary, so the q it samples from
        under temperature approaches the target's p (what sampled acceptance rewards). Returns [R]."""
        selector = self.candidate_selector
        projected = selector.hidden_projection(hidden)  # [R, r]
        if target_logp is not None:
            everything = torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)  # [R, V]
            score = selector.scores(logits.detach(), everything, previous, projected)  # [R, V]
            return -(target_logp.exp() * torch.log_softmax(score, -1)).sum(-1)
        _, candidates = self.candidates(logits.detach())
        missing = ~(candidates == labels[:, None]).any(-1)
        candidates = candidates.clone()
        candidates[missing, -1] = labels[missing]
        unary = logits.detach().gather(1, candidates)
        score = selector.scores(unary, candidates, previous, projected)
        gold = (candidates == labels[:, None]).float().argmax(-1)
        return F.cross_entropy(score, gold, reduction="none")


def upgrade_to_dflash2(drafter: DFlashDraftModel, settings, seed: int = 0, std: float = 0.1) -> DFlash2DraftModel:
    """A DFlash 2 drafter that starts from a DFlash one: same backbone weights, identity convolutions, and a
    selector whose codebooks start small (so it begins as argmax drafting, up to the tiny pair term)."""
    cfg = dataclasses.replace(drafter.config, dflash2=settings)
    model = DFlash2DraftModel(cfg).to(next(drafter.parameters()).dtype)
    missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("conv" in m or "candidate_selector" in m for m in missing), missing
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        selector = model.candidate_selector
        for param in (selector.predecessor_codebook, selector.successor_codebook):
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        weight = selector.hidden_projection.weight
        weight.copy_(torch.randn(weight.shape, generator=generator) * weight.shape[1] ** -0.5)
    return model
