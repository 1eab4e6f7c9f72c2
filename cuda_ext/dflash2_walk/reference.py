"""The PyTorch reference of the DFlash 2 walk (the CPU path where the host build is off, and the kernels' test
oracle): the selector's scores and the B-1 sequential choices over each row's K candidates."""

import torch
from torch.nn import functional as F

from shared.sampling import sample_from


def pair_scores(unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor, projected: torch.Tensor,
                predecessor: torch.Tensor, successor: torch.Tensor) -> torch.Tensor:
    """score_k = unary_k + < predecessor[previous] * projected, successor[candidates_k] >.
    unary, candidates [..., K]; previous [...]; projected [..., r]; codebooks [vocab, r] -> float32 [..., K]."""
    query = predecessor[previous] * projected  # [..., r]
    if candidates.shape[-1] * 16 >= successor.shape[0]:  # many candidates: one matmul
        pair = (query @ successor.T).gather(-1, candidates)  # [..., V] -> [..., K]
    else:
        pair = (successor[candidates] * query[..., None, :]).sum(-1)  # [..., K]
    return unary.float() + pair.float()


def walk(unary: torch.Tensor, candidates: torch.Tensor, anchors: torch.Tensor, projected: torch.Tensor,
         predecessor: torch.Tensor, successor: torch.Tensor, temperatures: torch.Tensor,
         uniforms: torch.Tensor | None):
    """One path through the candidates of each block row: unary, candidates [b, n, K] (best first where a row is
    greedy); anchors [b] (the token before row 1); projected [b, n, r]; temperatures [b] (<= 0: greedy, the first
    best score); uniforms [b, n] float64 (for sampled rows). Returns (tokens [b, n], choices [b, n], q [b, n, K]:
    the distribution each token was drawn from, one-hot where greedy)."""
    greedy = temperatures <= 0
    sampling = uniforms is not None and not bool(greedy.all())
    previous = anchors
    tokens, choices, qs = [], [], []
    for t in range(candidates.shape[1]):
        score = pair_scores(unary[:, t], candidates[:, t], previous, projected[:, t], predecessor, successor)  # [b, K]
        choice = score.argmax(-1)
        if sampling:
            q = torch.softmax(score / temperatures.clamp(min=1e-6)[:, None], -1)
            choice = torch.where(greedy, choice, sample_from(q.double(), uniforms[:, t]))
            qs.append(q)
        previous = candidates[:, t].gather(1, choice[:, None])[:, 0]
        tokens.append(previous)
        choices.append(choice)
    choices = torch.stack(choices, 1) if choices else candidates.new_zeros(candidates.shape[0], 0)
    one_hot = F.one_hot(choices, candidates.shape[-1]).float()  # [b, n, K]
    q = torch.where(greedy[:, None, None], one_hot, torch.stack(qs, 1)) if sampling else one_hot
    tokens = torch.stack(tokens, 1) if tokens else choices.clone()
    return tokens, choices, q
