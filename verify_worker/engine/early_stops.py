"""min_tokens at the target's logits: the stop tokens a request may not end on yet, masked in a verify block before
verification, so that greedy and sampled decoding, speculative and plain, all see the same rule. Where a request's
grammar allows nothing but a stop token (its end), the grammar wins: min_tokens cannot extend what it completed."""

import torch

from verify_worker.request import RequestState


def mask_early_stops(states: list[RequestState], logits: torch.Tensor) -> torch.Tensor:
    """logits [b, n+1, vocab] of a verify block (row j of request r predicts its output token len(output) + j)
    with every stop token at -inf where that output token comes before the request's min_tokens, so that neither
    the argmax nor the sampled distribution can end it early: the target's own rule, which verification then
    holds the drafts to. In place, unless a masked request asked for log-probabilities (they are the unmasked
    logits', as vLLM reports them): then on a copy."""
    masks = []
    for row, state in enumerate(states):
        early = state.request.min_tokens - len(state.output_ids)  # block rows still before min_tokens
        if early > 0 and state.request.stop_token_ids:
            masks.append((row, min(early, logits.shape[1]), state.request))
    if not masks:
        return logits
    if any(request.logprobs is not None for _, _, request in masks):
        logits = logits.clone()
    vocab = logits.shape[-1]
    for row, rows, request in masks:
        ids = torch.tensor([t for t in request.stop_token_ids if 0 <= t < vocab], dtype=torch.long,
                           device=logits.device)
        saved = logits[row, :rows, ids].clone()  # [rows, stops]
        logits[row, :rows, ids] = float("-inf")
        ended = ~torch.isfinite(logits[row, :rows]).any(-1)  # a grammar that allows nothing but its end: it wins
        for position in ended.nonzero().flatten().tolist():
            logits[row, position, ids] = saved[position]
    return logits
