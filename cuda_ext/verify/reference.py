"""The PyTorch reference of the verify kernel, and the lossless acceptance rules it is made of, as pure functions:
tensors in, accepted counts and next tokens out. This is the CPU path and the kernels' test oracle.

All functions take a padded batch: row b drafted num_drafts[b] tokens (0 = plain decoding); draft positions
at or past num_drafts[b] are ignored. Position i of the target distributions scores the token that follows
the block's i-th token, so target[:, i] checks draft[:, i] and target[:, a] gives the token after a accepted.
"""

import torch

from shared.sampling import sample_from

POINT_MASS, SPARSE, DENSE = 0, 1, 2  # a sampled row's proposal form (rows.h: QForm)


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


def proposal_rows(draft: torch.Tensor, vocab: int, q_form: torch.Tensor, q_dense: torch.Tensor, q_ids: torch.Tensor,
                  q_probs: torch.Tensor) -> torch.Tensor:
    """The dense q [rows, n, vocab] of rows whose proposals come in the kernel's forms (see verify_block)."""
    rows = []
    for r, form in enumerate(q_form.tolist()):
        if form == POINT_MASS:
            rows.append(dense_proposal(draft[r], vocab, None, None))
        elif form == SPARSE:
            rows.append(dense_proposal(draft[r], vocab, q_probs[r], q_ids[r]))
        else:
            rows.append(q_dense[r].float())
    return torch.stack(rows) if rows else torch.zeros(0, draft.shape[1], vocab, device=draft.device)


def verify_block(scores: torch.Tensor, draft: torch.Tensor, num_drafts: torch.Tensor, sampled: torch.Tensor,
                 q_form: torch.Tensor, q_dense: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                 accept_u: torch.Tensor, sample_u: torch.Tensor) -> torch.Tensor:
    """One verify step for a batch, greedy and sampled rows mixed; the contract of the verify kernel.

    scores [b, n+1, vocab] float32: logits for greedy rows, probabilities after logits processing for sampled
    rows; draft [b, n]; num_drafts [b]; sampled [b] bool. Sampled rows' proposals: q_form [b] (POINT_MASS: the
    draft itself; SPARSE: q_ids, q_probs [b, n, K]; DENSE: q_dense [b, n, vocab]); accept_u [b, n] and
    sample_u [b] float64 uniforms. Returns [b, 2] int64: accepted count, next token.
    """
    accepted, next_tokens = verify_greedy(draft, num_drafts, scores)
    rows = sampled.nonzero()[:, 0]
    if len(rows):
        q = proposal_rows(draft[rows], scores.shape[-1], q_form[rows], q_dense[rows] if q_dense.dim() == 3 else
                          q_dense, q_ids[rows], q_probs[rows])
        acc_s, next_s = verify_sampled(draft[rows], num_drafts[rows], scores[rows], q, accept_u[rows], sample_u[rows])
        accepted, next_tokens = accepted.index_copy(0, rows, acc_s), next_tokens.index_copy(0, rows, next_s)
    return torch.stack([accepted, next_tokens], 1)
