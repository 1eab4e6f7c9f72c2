"""A verify block's inputs assembled and verified in one call: greedy rows by prefix match, sampled rows by
rejection sampling against their proposals' q (dense, sparse or a point mass), each with the request's own
uniform draws."""

import torch

from cuda_ext.verify.op import verify_block, verify_greedy
from cuda_ext.verify.reference import DENSE, SPARSE
from shared.sampling import batch_sampling_probs
from verify_worker.engine.early_stops import mask_early_stops, mask_thinking_ends
from verify_worker.engine.grammar_masks import mask_grammars
from verify_worker.request import RequestState


def verify_block_rows(states: list[RequestState], drafts: torch.Tensor, counts: list[int], proposals,
                      logits: torch.Tensor, device: torch.device) -> tuple[list[int], list[int]]:
    """Greedy rows by prefix match, sampled rows by rejection sampling, in one call of the verify kernel (or its
    reference: cuda_ext/verify). drafts [b, n]; proposals[r]: (q_probs, q_ids) of a sampled row's drafts (None,
    None for a point mass); logits [b, n+1, vocab] (a constrained request's positions masked to its grammar, then
    the stop tokens before a request's min_tokens). Returns the accepted counts and next tokens."""
    b, n = drafts.shape
    logits = mask_grammars(states, drafts, counts, logits)
    logits = mask_early_stops(states, mask_thinking_ends(states, drafts, counts, logits))
    num = torch.tensor(counts, device=device)
    sampled_rows = [r for r, s in enumerate(states) if not s.request.sampling.greedy]
    if not sampled_rows and n == 0:  # greedy plain decoding: the argmax (the kernel's rule, first of ties)
        return [0] * b, logits[:, 0].argmax(-1).tolist()
    if not sampled_rows:
        return verify_greedy(logits, drafts.to(device), num)
    index = torch.tensor(sampled_rows, device=device)
    probs = batch_sampling_probs(logits[sampled_rows], [states[r].request.sampling for r in sampled_rows])
    scores = logits.float().index_copy(0, index, probs)  # [b, n+1, V]: logits, or p for sampled rows
    vocab = scores.shape[-1]
    forms, sparse, dense = torch.zeros(b, dtype=torch.int32), {}, {}
    accept_u, sample_u = torch.ones(b, n, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
    for r in sampled_rows:
        k = counts[r]
        q_probs, q_ids = proposals[r] if proposals[r] is not None else (None, None)
        if k and q_probs is not None:
            forms[r] = SPARSE if q_ids is not None else DENSE
            (sparse if q_ids is not None else dense)[r] = (q_probs[:k], None if q_ids is None else q_ids[:k])
        draws = states[r].uniforms(k + 1)  # k acceptance tests, then one draw
        accept_u[r, :k], sample_u[r] = draws[:k], draws[k]
    width = max((q.shape[-1] for q, _ in sparse.values()), default=0)
    q_ids = torch.zeros(b, n, width, dtype=torch.long, device=device)  # padding: id 0 with probability 0
    q_probs = torch.zeros(b, n, width, device=device)
    for r, (q, ids) in sparse.items():
        q_ids[r, : len(q), : ids.shape[-1]], q_probs[r, : len(q), : q.shape[-1]] = ids, q
    q_dense = torch.zeros(b, n, vocab, device=device) if dense else torch.zeros(0, device=device)
    for r, (q, _) in dense.items():
        q_dense[r, : len(q)] = q
    sampled = torch.zeros(b, dtype=torch.bool)
    sampled[sampled_rows] = True
    out = verify_block(scores, drafts.to(device), num, sampled.to(device), forms.to(device), q_dense, q_ids,
                       q_probs, accept_u.to(device), sample_u.to(device))
    return out[:, 0].tolist(), out[:, 1].tolist()
