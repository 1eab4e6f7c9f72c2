"""Scheduling policy (pure CPU decisions, no tensors): which prompt chunks to prefill, how many drafts."""

from verify_worker.request import RequestState


def plan_prefill(prefilling: list[RequestState], budget: int, align: int = 1) -> list[tuple[RequestState, int]]:
    """The next prompt chunk of each prefilling request, first come first served, at most budget tokens in all.
    align: a chunk that does not end its prompt is a multiple of align tokens, so every chunk starts at a multiple
    of align (a family whose prompt chunks' bits depend on where they start: its `prefill_align`); a request the
    budget left cannot give a whole multiple waits for the next step (the first in line always gets one: budget >=
    align)."""
    plan = []
    for state in prefilling:
        if budget <= 0:
            break
        remaining = len(state.prefill_ids) - state.prefilled
        n = remaining if remaining <= budget else budget // align * align
        if n:
            plan.append((state, n))
            budget -= n
    return plan


def padding_groups(chunks: list[tuple[RequestState, int]], waste: float = 0.25) -> list[list[tuple[RequestState, int]]]:
    """The prompt chunks of one step in forwards of similar lengths: a forward pads its rows to its longest
    chunk, and every padded position goes through every GEMM (16 demo prompts of 20-116 tokens padded to 116:
    1856 rows for 942 tokens, 1.8x the time of the chunks alone). Sorted by length, a group grows while its
    padded size stays within (1 + waste) of its tokens; chunks of one length stay in one forward (a forward
    costs about 0.1 ms on top of its rows)."""
    groups: list[list[tuple[RequestState, int]]] = []
    tokens = 0
    for chunk in sorted(chunks, key=lambda c: c[1]):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * chunk[1] <= (1 + waste) * (tokens + chunk[1]):
            group.append(chunk)
            tokens += chunk[1]
        else:
            groups.append([chunk])
            tokens = chunk[1]
    return groups


def num_drafts(state: RequestState, block_size: int, has_proposer: bool) -> int:
    """Drafts to ask for: up to block_size - 1, capped by the request's knob and by the tokens it still needs
    (the verify step always adds one token of the target's own)."""
    if not has_proposer:
        return 0
    limit = block_size - 1
    if state.request.num_speculative_tokens is not None:
        limit = min(limit, state.request.num_speculative_tokens)
    return max(0, min(limit, state.remaining - 1))
