"""Scheduling policy (pure CPU decisions, no tensors): which prompt chunks to prefill, how many drafts."""

from verify_worker.request import RequestState


def plan_prefill(prefilling: list[RequestState], budget: int) -> list[tuple[RequestState, int]]:
    """The next prompt chunk of each prefilling request, first come first served, at most budget tokens in all."""
    plan = []
    for state in prefilling:
        if budget <= 0:
            break
        n = min(len(state.request.prompt_ids) - state.prefilled, budget)
        plan.append((state, n))
        budget -= n
    return plan


def num_drafts(state: RequestState, block_size: int, has_proposer: bool) -> int:
    """Drafts to ask for: up to block_size - 1, capped by the request's knob and by the tokens it still needs
    (the verify step always adds one token of the target's own)."""
    if not has_proposer:
        return 0
    limit = block_size - 1
    if state.request.num_speculative_tokens is not None:
        limit = min(limit, state.request.num_speculative_tokens)
    return max(0, min(limit, state.remaining - 1))
