"""Log-probabilities of committed tokens under the target's own distribution (before temperature, top-p and
top-k, as vLLM reports them by default), for requests that ask for them."""

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprob:
    """One committed token: its log-probability and the `top` most likely tokens with theirs, best first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, vocab] (row i scores tokens[i]); top alternatives per token (0 = none)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    ids = torch.tensor(tokens, device=logits.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()  # [n]
    if top:
        best, best_ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [n, top]
        best, best_ids = best.tolist(), best_ids.tolist()
    else:
        best, best_ids = [[] for _ in tokens], [[] for _ in tokens]
    return [TokenLogprob(c, i, b) for c, i, b in zip(chosen, best_ids, best)]
