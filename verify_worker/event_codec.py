"""A step's events as the messages the gateway reads: a TokenEvent for a request with log-probabilities, the
running speculation totals each event carries."""

from shared.channel_gateway import TokenEvent
from verify_worker.logprobs import TokenLogprob
from verify_worker.request import StepEvent


def event_totals(stats) -> tuple[int, int, int, int]:
    """A request's running (verify steps, draft tokens, accepted tokens) and its cached prompt tokens, as its token
    events carry them."""
    return (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens, stats.cached_tokens) if stats \
        else (0, 0, 0, 0)


def token_event(event: StepEvent) -> TokenEvent:
    """A step's event of a request that asked for log-probabilities, as a message of its own."""
    values, top_ids, top_values = logprob_lists(event.logprobs)
    prompt_values, prompt_top_ids, prompt_top_values = logprob_lists(event.prompt_logprobs)
    verify_steps, draft_tokens, accepted_tokens, cached_tokens = event_totals(event.stats)
    return TokenEvent(
        request_id=event.request_id, token_ids=event.new_token_ids, finish_reason=event.finish_reason,
        verify_steps=verify_steps, draft_tokens=draft_tokens, accepted_tokens=accepted_tokens,
        cached_tokens=cached_tokens, logprobs=values,
        top_ids=top_ids, top_logprobs=top_values, prompt_logprobs=prompt_values, prompt_top_ids=prompt_top_ids,
        prompt_top_logprobs=prompt_top_values,
    )


def logprob_lists(logprobs: list[TokenLogprob] | None) -> tuple:
    """TokenLogprobs as the three parallel lists of a token event (or three Nones)."""
    if logprobs is None:
        return None, None, None
    return [t.logprob for t in logprobs], [t.top_ids for t in logprobs], [t.top_logprobs for t in logprobs]
