"""Requests' per-request state in the engine (the request itself: shared/generation_request.py), and their
results."""

import secrets
from dataclasses import dataclass, field
from enum import Enum

import torch

from shared.generation_request import GenerationRequest
from shared.grammar_matcher import GrammarMatcher
from shared.sampling import request_generator
from verify_worker.logprobs import TokenLogprob

VERIFY_STREAM = 0  # random stream id of the verifier's draws


class Status(Enum):
    WAITING = "waiting"  # queued, no cache slot yet (or preempted: engine/paging.py)
    PREFILLING = "prefilling"  # holds a slot; its prompt (or a preempted request's tokens) prefilled in chunks
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class RequestStats:
    verify_steps: int = 0  # decode steps (target forwards) after the prefill
    draft_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0  # tokens committed by decode steps, bonus tokens included
    drafted_at: list[int] = field(default_factory=list)  # per block position: drafts made
    accepted_at: list[int] = field(default_factory=list)  # per block position: drafts accepted
    cached_tokens: int = 0  # prompt tokens a cached prefix gave it (engine/prefix_cache.py), not prefilled

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verify step, bonus included (1.0 for plain decoding)."""
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    def saved(self) -> tuple:
        """The counts as an immutable tuple, taken for every running request every step (a tuple costs a fraction
        of a new RequestStats); restored() makes an independent RequestStats of it."""
        return (self.verify_steps, self.draft_tokens, self.accepted_tokens, self.committed_tokens,
                tuple(self.drafted_at), tuple(self.accepted_at), self.cached_tokens)

    @classmethod
    def restored(cls, saved: tuple) -> "RequestStats":
        steps, drafts, accepted, committed, drafted_at, accepted_at, cached = saved
        return cls(steps, drafts, accepted, committed, list(drafted_at), list(accepted_at), cached)

    def record(self, num_drafts: int, accepted: int, committed: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += accepted
        self.committed_tokens += committed
        grow = num_drafts - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_drafts):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
        }


@dataclass
class RequestState:
    request: GenerationRequest
    seed: int
    generator: torch.Generator
    status: Status = Status.WAITING
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cache_len: int = 0  # target KV positions holding committed tokens (the anchor sits at this position)
    feature_chunks: list[torch.Tensor] = field(default_factory=list)  # tapped features of positions 0..cache_len-1
    sent_chunks: int = 0  # leading feature chunks the proposer already has
    drafter_context_len: int = 0  # positions whose features the proposer already has
    grammar_sent: int = 0  # output tokens the proposer's copy of the grammar state has taken
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked for
    error: str | None = None  # why it failed (finish reason "error"): a step raised with it alone
    grammar: GrammarMatcher | None = None  # the request's grammar state, advanced by its committed tokens
    rebuild: tuple[int, ...] | None = None  # preempted while decoding: the committed tokens whose KV it prefills
    #                                         again before it decodes on (engine/paging.py)
    admitted: int = 0  # the engine's admission count when it last took a slot (the newest is preempted first)

    @classmethod
    def create(cls, request: GenerationRequest) -> "RequestState":
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(62)
        return cls(request=request, seed=seed, generator=request_generator(seed, VERIFY_STREAM))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        """The tokens it prefills: its prompt, or after a preemption the committed tokens it rebuilds."""
        return self.request.prompt_ids if self.rebuild is None else self.rebuild

    @property
    def prefilled(self) -> int:
        """Tokens of prefill_ids already in the cache (while prefilling, cache_len counts only those)."""
        return min(self.cache_len, len(self.prefill_ids))

    def unsent_features(self) -> list[torch.Tensor]:
        return self.feature_chunks[self.sent_chunks:]

    def mark_features_sent(self) -> None:
        self.drafter_context_len += sum(len(c) for c in self.unsent_features())
        self.sent_chunks = len(self.feature_chunks)
        self.grammar_sent = len(self.output_ids)

    def resend_features(self) -> None:
        """The proposer lost this request's context (restart, timeout): send everything again next time (its
        grammar too)."""
        self.sent_chunks, self.drafter_context_len, self.grammar_sent = 0, 0, 0

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output_ids)

    def uniforms(self, count: int) -> torch.Tensor:
        return torch.rand(count, generator=self.generator, dtype=torch.float64)


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., when the request asked for them


@dataclass
class StepReport:
    """What one engine step did, for metrics: token counts and the time spent in each phase."""

    prefill_tokens: int = 0
    decode_requests: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per block position, this step
    accepted_at: list[int] = field(default_factory=list)
    fallback: bool = False  # drafts were wanted but the proposer was unavailable
    policy_plain: bool = False  # the speculation policy chose a plain step
    catch_up: bool = False  # the draft call carried more context than one step commits (slower than usual)
    forced_tokens: int = 0  # drafts a grammar forced (rows proposed them instead of the drafter's)
    seconds: dict[str, float] = field(default_factory=dict)  # draft, transfer, verify, prefill, cache, scheduling

    def decode_seconds(self) -> float:
        """The step's decode time, what the speculation policy compares between modes: draft, transfer, verify."""
        return sum(self.seconds.get(phase, 0.0) for phase in ("draft", "transfer", "verify"))


@dataclass
class StepEvent:
    """Tokens a request committed in one engine step; finish_reason set when it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats | None = None  # the request's running totals
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first event: prompt tokens 1.., when asked for
    error: str | None = None  # finish reason "error": this request failed a step on its own
