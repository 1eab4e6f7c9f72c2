"""min_tokens at the target's logits: the stop tokens a request may not end on yet, masked in a verify block before
verification, so that greedy and sampled decoding, speculative and plain, all see the same rule. Where a request's
grammar allows nothing but a stop token (its end), the grammar wins: min_tokens cannot extend what it completed."""

import torch

from verify_worker.request import RequestState


def mask_thinking_ends(states: list[RequestState], drafts: torch.Tensor, counts: list[int],
                       logits: torch.Tensor) -> torch.Tensor:
    """logits [b, n+1, vocab] with a thinking budget held: where row j of a request predicts its output token at
    index `budget` of its thinking_end (budget, token) and the token has not come before (in its output, or in the
    drafts before row j), every other token is at -inf, so that the section ends at that exact position, greedy or
    sampled, speculative or plain. In place, unless the request asked for log-probabilities (then on a copy)."""
    masks = []
    for row, state in enumerate(states):
        end = state.request.thinking_end
        if end is None:
            continue
        budget, token = end
        position = budget - len(state.output_ids)  # the block row that predicts output index budget
        if 0 <= position < logits.shape[1] and token not in state.output_ids and \
                token not in drafts[row, : min(position, counts[row])].tolist():
            masks.append((row, position, token, state.request.logprobs is not None))
    if not masks:
        return logits
    if any(copy for *_, copy in masks):
        logits = logits.clone()
    for row, position, token, _ in masks:
        kept = logits[row, position, token].clone() if 0 <= token < logits.shape[-1] else None
        if kept is not None and torch.isfinite(kept):  # never a token another mask (a grammar) refuses
            logits[row, position] = float("-inf")
            logits[row, position, token] = kept
    return logits


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
