"""Lossless acceptance rules as pure functions: tensors in, accepted counts and next tokens out.

All functions take a padded batch: row b drafted num_drafts[b] tokens (0 = plain decoding); draft positions
at or past num_drafts[b] are ignored. Position i of the target distributions scores the token that follows
the block's i-th token, so target[:, i] checks draft[:, i] and target[:, a] gives the token after a accepted.
"""

import torch

from shared.sampling import sample_from


def _accepted_prefix(matches: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """matches [b, n] bool -> length of the leading run of True within the first num_drafts [b]."""
    valid = torch.arange(matches.shape[1], device=matches.device)[None] < num_drafts[:, None]
    return (matches & valid).long().cumprod(-1).sum(-1)  # [b]


def verify_greedy(draft: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor):
    """Greedy prefix match. draft [b, n]; target_logits [b, n+1, vocab] -> (accepted [b], next_token [b])."""
    target_argmax = target_logits.argmax(-1)  # [b, n+1]
    accepted = _accepted_prefix(draft == target_argmax[:, :-1], num_drafts)
    next_token = target_argmax.gather(1, accepted[:, None])[:, 0]
    return accepted, next_token


def dense_proposal(
    draft: torch.Tensor, vocab: int, q_probs: torch.Tensor | None, q_ids: torch.Tensor | None
) -> torch.Tensor:
    """Any proposal form as dense q [n, vocab]: a point mass on the draft when q is unknown (deterministic
    proposal), the given q when dense, or q scattered onto its K-candidate support when sparse."""
    if q_probs is None:
        return torch.nn.functional.one_hot(draft, vocab).float()
    if q_ids is None:
        return q_probs.float()
    return torch.zeros(q_probs.shape[0], vocab, device=q_probs.device).scatter_add_(1, q_ids, q_probs.float())


def verify_sampled(
    draft: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
):
    """Speculative rejection sampling.

    draft [b, n] drawn from draft_probs q [b, n, vocab] (a one-hot row for a deterministic proposal);
    target_probs p [b, n+1, vocab] after the request's logits processing; accept_uniforms [b, n] and
    sample_uniforms [b] in [0, 1).
    Accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from
    norm(max(0, p_i - q_i)); if all are accepted draw the bonus token from p_n.
    Returns (accepted [b], next_token [b]).
    """
    n = draft.shape[1]
    p_draft = target_probs[:, :n].gather(-1, draft[..., None])[..., 0]  # [b, n]
    q_draft = draft_probs.gather(-1, draft[..., None])[..., 0]  # [b, n]
    accepted = _accepted_prefix(accept_uniforms * q_draft < p_draft, num_drafts)  # [b]
    rows = torch.arange(draft.shape[0], device=draft.device)
    p_next = target_probs[rows, accepted]  # [b, vocab]
    rejected = accepted < num_drafts
    q_next = draft_probs[rows, accepted.clamp(max=max(n - 1, 0))] if n else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp_min(0)  # [b, vocab]
    usable = residual.sum(-1, keepdim=True) > 0
    residual = torch.where(usable, residual, p_next)
    distribution = torch.where(rejected[:, None], residual, p_next)
    return accepted, sample_from(distribution, sample_uniforms)
