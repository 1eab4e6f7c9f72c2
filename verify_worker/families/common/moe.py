"""Mixture of experts: the sigmoid router with a score-correction bias and group-limited top-k
(DeepSeek-V3 `noaux_tc`, GLM-5.x), and the routed experts with their weights stacked at load."""

import torch
from torch import nn
from torch.nn import functional as F

from verify_worker.families.common.dense import GatedMLP, clamp_gate_up
from verify_worker.families.common.kernel_set import TorchKernels
from verify_worker.families.common.row_invariant import elementwise_rows
from verify_worker.parallel.group import TensorParallel


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int, normalise: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [tokens, experts] float32 -> (expert ids [tokens, top_k], weights [tokens, top_k] float32).

    Experts are chosen on sigmoid(logits) + bias, among the top_groups groups whose two best scores sum
    highest; weights are the chosen raw sigmoid scores, renormalised if asked, times scaling. Ties prefer the
    lower group / expert id (stable sorts), so a token routes alike in any batch.
    """
    tokens, experts = logits.shape
    scores = elementwise_rows(torch.sigmoid, logits)
    choice = scores + bias  # [tokens, experts]
    if groups > 1:
        grouped = choice.view(tokens, groups, experts // groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [tokens, groups]
        keep = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :top_groups]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~allowed[:, :, None].expand_as(grouped).reshape(tokens, experts), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [tokens, top_k]
    weights = scores.gather(1, ids)
    if normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


class RoutedExperts(nn.Module):
    """Experts' gate|up [experts, 2 * inner, hidden] and down [experts, hidden, inner], as transformers stacks
    them. The token-expert pairs are sorted by expert and each expert's rows multiplied by its weights in place
    (kernel_set.py: a row's result does not depend on the other rows); each token's output then sums its
    experts in its top-k order. The stacks may be kept as FP8 blocks (fp8_weights.keep_fp8: `*_scale_inv` hold
    their scales), multiplied as the kernel set's grouped product takes them."""

    def __init__(self, experts: int, hidden: int, inner: int, limit: float | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.register_parameter("gate_up_proj_scale_inv", None)  # FP8 blocks kept FP8 (fp8_weights.keep_fp8)
        self.register_parameter("down_proj_scale_inv", None)
        self.fp8_weights, self.fp8_block = ("gate_up_proj", "down_proj"), None
        self.limit = limit  # the swiglu clamp (see clamp_gate_up)
        self.glm_kernels = TorchKernels()  # chosen again when the model is packed

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], ids / weights [tokens, top_k] -> [tokens, hidden]."""
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)  # [tokens * top_k]
        order = torch.sort(flat, stable=True).indices  # [t*k] the pairs by expert, in token order within one
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # [experts] (no host synchronisation)
        rows = x[order // top_k]  # [t*k, hidden]
        gate, up = self.glm_kernels.grouped(rows, self.gate_up_proj, counts, self.gate_up_proj_scale_inv,
                                            self.fp8_block).chunk(2, -1)  # [t*k, inner] each
        gate, up = clamp_gate_up(gate, up, self.limit)
        down = self.glm_kernels.grouped(elementwise_rows(F.silu, gate) * up, self.down_proj, counts,
                                        self.down_proj_scale_inv, self.fp8_block)  # [t*k, hidden]
        out = torch.empty_like(down).index_copy_(0, order, down).view(tokens, top_k, -1)  # back in pair order
        out = out * weights[..., None].to(out.dtype)
        total = out[:, 0]
        for slot in range(1, top_k):  # a fixed order per token
            total = total + out[:, slot]
        return total


class Router(nn.Module):
    """cfg: a family config with n_routed_experts, hidden_size, num_experts_per_tok, n_group, topk_group,
    norm_topk_prob and routed_scaling_factor."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.glm_kernels = TorchKernels()  # the float32 router's product, chosen again when the model is packed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> expert ids, weights [tokens, top_k] (float32 router, as published)."""
        cfg = self.cfg
        logits = self.glm_kernels.rows(x.float(), self.weight.float())
        return route(logits, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                     cfg.norm_topk_prob, cfg.routed_scaling_factor)


class MoE(nn.Module):
    """The router whole on every rank; the routed and shared experts' columns split, one sum over the ranks."""

    def __init__(self, cfg, moe_inner: int, tp: TensorParallel, limit: float | None = None):
        """moe_inner: this rank's columns of each expert; limit: the swiglu clamp, if any."""
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, moe_inner, limit)
        inner = moe_inner * cfg.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, inner, limit=limit) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        ids, weights = self.gate(flat)
        out = self.experts(flat, ids, weights).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)

