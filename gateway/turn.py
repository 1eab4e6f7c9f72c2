"""One choice of a request while its token events arrive: text (stop strings cut, broken UTF-8 held back),
token ids, log-probabilities, speculative counts; and the usage of a whole request's choices."""

import time
from dataclasses import dataclass, field

from gateway.logprobs import TokenLogprobs
from gateway.metrics import GatewayMetrics
from gateway.schemas import GenerationParams, Prompt
from gateway.tokenization import IncrementalDetokenizer, StopMatcher
from shared.channel_gateway import TokenEvent


@dataclass
class Turn:
    """The state of one choice (one verify-worker request) while its events arrive."""

    request_id: str
    index: int  # the choice index: prompt index * n + j
    prompt: Prompt
    params: GenerationParams
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    started: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a cached prefix gave it (the verify worker's prefix cache)
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: TokenLogprobs | None = None  # every token's, when the request asked for them
    prompt_logprobs: TokenLogprobs | None = None  # the prompt's tokens 1.., with echo and logprobs

    def absorb(self, event: TokenEvent, metrics: GatewayMetrics) -> str:
        """Take one event; returns the text it adds (stop strings cut, broken UTF-8 held back)."""
        now = time.monotonic()
        if event.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.started)
            elif self.last_token_at is not None:
                per_token = (now - self.last_token_at) / len(event.token_ids)
                for _ in event.token_ids:
                    metrics.itl.observe(per_token)
            self.last_token_at = now
        self.token_ids.extend(event.token_ids)
        if event.prompt_logprobs is not None and self.params.logprobs is not None:
            self.prompt_logprobs = event_prompt_logprobs(event, self.prompt)
        run = event_logprobs(event)
        if run is not None and self.params.logprobs is not None:
            self.logprobs = self.logprobs or TokenLogprobs()
            self.logprobs.extend(run)
        self.verify_steps, self.draft_tokens = event.verify_steps, event.draft_tokens
        self.accepted_tokens, self.cached_tokens = event.accepted_tokens, event.cached_tokens
        delta = self.detokenizer.add(event.token_ids)
        if event.finish_reason is not None:
            delta += self.detokenizer.flush()
        if len(self.token_ids) > self.params.min_tokens:  # stop strings act only past min_tokens (as in vLLM)
            emitted, stopped = self.stops.feed(delta)
        else:
            emitted, stopped = delta, False
        if stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            emitted += self.stops.flush()
            self.finish_reason = event.finish_reason
        self.text += emitted
        return emitted


def usage(turns: list[Turn]) -> dict:
    """The usage object of a request's choices: each prompt counted once (its cached tokens: the most any of its
    choices reused), the completions and the speculative counts summed (acceptance length: tokens committed per
    verify step; a choice's first token comes from its prefill)."""
    prompt = sum(len(p.ids) for p in {id(t.prompt): t.prompt for t in turns}.values())
    cached: dict[int, int] = {}  # per prompt, the most any of its choices found cached
    for turn in turns:
        cached[id(turn.prompt)] = max(cached.get(id(turn.prompt), 0), turn.cached_tokens)
    completion = sum(len(t.token_ids) for t in turns)
    steps = sum(t.verify_steps for t in turns)
    drafted, accepted = sum(t.draft_tokens for t in turns), sum(t.accepted_tokens for t in turns)
    after_first = sum(max(0, len(t.token_ids) - 1) for t in turns)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        },
        "speculative": {
            "verify_steps": steps,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_length": round(after_first / steps, 4) if steps else 0.0,
        },
    }


def meta_info(turn: Turn) -> dict:
    """A choice's speculation counts in SGLang's meta_info form: verify steps, drafted and accepted tokens, their
    ratio, and the accept length as SGLang computes it (completion tokens per verify step, the prefill's first
    token included)."""
    steps, drafted, accepted = turn.verify_steps, turn.draft_tokens, turn.accepted_tokens
    return {"completion_tokens": len(turn.token_ids), "spec_verify_ct": steps, "spec_draft_token_num": drafted,
            "spec_accept_token_num": accepted, "spec_accept_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_accept_length": round(len(turn.token_ids) / steps, 4) if steps else 0.0}


def event_logprobs(event: TokenEvent) -> TokenLogprobs | None:
    if event.logprobs is None:
        return None
    return TokenLogprobs(list(event.token_ids), list(event.logprobs), list(event.top_ids), list(event.top_logprobs))


def event_prompt_logprobs(event, prompt: Prompt) -> TokenLogprobs | None:
    """The prompt's scored tokens (1..) carried by a request's first event, if it carries them."""
    if not isinstance(event, TokenEvent) or event.prompt_logprobs is None:
        return None
    return TokenLogprobs(prompt.ids[1:], list(event.prompt_logprobs), list(event.prompt_top_ids),
                         list(event.prompt_top_logprobs))
