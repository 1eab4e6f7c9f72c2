"""Channel gateway <-> verify worker: requests (shared/generation_request.py) and aborts one way; token events,
rejections and heartbeats the other. No tensors travel here (the gateway does not import torch)."""

from dataclasses import dataclass

from shared.generation_request import GenerationRequest
from shared.wire import Message, WireError, channel


@dataclass(kw_only=True)
class AbortRequest(Message):
    TYPE = "abort"
    request_id: str


@dataclass(kw_only=True)
class TokenEvent(Message):
    """New tokens of one request; finish_reason and the stats are set on its last event. When the request asked
    for log-probabilities: one per token, and per token its top alternatives (ids and log-probabilities); the
    first event also carries the prompt's (tokens 1..), when asked for."""

    TYPE = "tokens"
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    cached_tokens: int = 0  # prompt tokens a cached prefix gave the request (not prefilled)
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None

    def validate(self):
        _check_logprobs("", self.logprobs, self.top_ids, self.top_logprobs, len(self.token_ids))
        _check_logprobs("prompt ", self.prompt_logprobs, self.prompt_top_ids, self.prompt_top_logprobs, None)


def _check_logprobs(what: str, values, top_ids, top_values, count: int | None) -> None:
    """Log-probabilities travel as three parallel lists (count long when given), or not at all."""
    if values is None:
        if top_ids is not None or top_values is not None:
            raise WireError(f"tokens: {what}top alternatives without log-probabilities")
        return
    if top_ids is None or top_values is None:
        raise WireError(f"tokens: {what}log-probabilities without their top alternatives")
    if not len(values) == len(top_ids) == len(top_values) or (count is not None and len(values) != count):
        raise WireError(f"tokens: one {what}log-probability and one list of alternatives per token expected")
    if any(len(i) != len(p) for i, p in zip(top_ids, top_values)):
        raise WireError(f"tokens: {what}alternative ids and log-probabilities differ in length")


@dataclass(kw_only=True)
class TokenBatch(Message):
    """One step's token events of the requests that asked for no log-probabilities, as parallel lists (one
    message where TokenEvents were one each: at 16 streams their encoding, sending and decoding cost more than
    the events' contents). The gateway routes `events()` as it routes TokenEvents."""

    TYPE = "token_batch"
    request_ids: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    verify_steps: list[int]
    draft_tokens: list[int]
    accepted_tokens: list[int]
    cached_tokens: list[int]

    def validate(self):
        n = len(self.request_ids)
        lists = (self.token_ids, self.finish_reasons, self.verify_steps, self.draft_tokens, self.accepted_tokens,
                 self.cached_tokens)
        if any(len(values) != n for values in lists):
            raise WireError("token_batch: per-request lists differ in length")

    @classmethod
    def of(cls, events: list[TokenEvent]) -> "TokenBatch":
        """Events without log-probabilities, in one message."""
        return cls(request_ids=[e.request_id for e in events], token_ids=[e.token_ids for e in events],
                   finish_reasons=[e.finish_reason for e in events], verify_steps=[e.verify_steps for e in events],
                   draft_tokens=[e.draft_tokens for e in events], accepted_tokens=[e.accepted_tokens for e in events],
                   cached_tokens=[e.cached_tokens for e in events])

    def events(self) -> list[TokenEvent]:
        columns = zip(self.request_ids, self.token_ids, self.finish_reasons, self.verify_steps, self.draft_tokens,
                      self.accepted_tokens, self.cached_tokens)
        return [TokenEvent(request_id=r, token_ids=t, finish_reason=f, verify_steps=v, draft_tokens=d,
                           accepted_tokens=a, cached_tokens=c) for r, t, f, v, d, a, c in columns]


@dataclass(kw_only=True)
class RequestFailed(Message):
    """The verify worker refused or lost a request. code: invalid_request, queue_full, internal."""

    TYPE = "failed"
    request_id: str
    code: str
    message: str


@dataclass(kw_only=True)
class Heartbeat(Message):
    TYPE = "heartbeat"
    running: int
    waiting: int
    drafter_kind: str  # "dflash", or "none" when no drafter is configured
    drafter_available: bool


@dataclass(kw_only=True)
class WorkerStopping(Message):
    """The verify worker is going down (e.g. it lost a tensor-parallel rank): stop routing to it now."""

    TYPE = "stopping"
    reason: str


TO_VERIFY = channel(GenerationRequest, AbortRequest)
TO_GATEWAY = channel(TokenEvent, TokenBatch, RequestFailed, Heartbeat, WorkerStopping)
