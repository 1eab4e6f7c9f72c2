"""One generation request (a choice to generate), as the gateway sends it and the engine runs it, and the one
check of its values against a model. Torch-free: the gateway builds it, the wire carries it (it is the submit
message), the engine admits it."""

import uuid
from dataclasses import dataclass, field

from shared.errors import RequestError
from shared.request_limits import is_int64
from shared.sampling_params import SamplingParams
from shared.wire import Message, WireError

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for


@dataclass(frozen=True)
class GenerationRequest(Message):
    """stop_token_ids end it (the end-of-text ids unless the client asked ignore_eos, and the client's own); none
    of them is chosen before min_tokens tokens. Lists given for the tuple fields are kept as tuples."""

    TYPE = "submit"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int | None = None  # None = block size - 1; 0 = plain decoding
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    logprobs: int | None = None  # None: none; k: each token's log-probability and its top k alternatives
    prompt_logprobs: bool = False  # also for the prompt's tokens after the first
    min_tokens: int = 0  # no stop token is chosen before this many output tokens (their logits are masked)
    grammar: str | None = None  # an llguidance grammar the output obeys (shared/grammar.py), or None
    thinking_end: tuple[int, int] | None = None  # (budget, token): that token at output index budget, unless
    # it came before (a thinking section's end at its budget)

    def __post_init__(self):
        for name in ("prompt_ids", "stop_token_ids", "thinking_end"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def validate(self):
        """What the wire needs to answer it at all; its values are check_request's."""
        if not self.request_id:
            raise WireError("submit: empty request_id")


@dataclass(frozen=True)
class ModelBounds:
    """What a request is checked against: the target's vocabulary and context."""

    vocab_size: int
    max_model_len: int


def _count(value) -> bool:
    return is_int64(value) and value >= 0


def check_request(request: GenerationRequest, bounds: ModelBounds) -> None:
    """Raises RequestError naming the first value this model cannot serve (param: the API field at fault; code
    context_length_exceeded where the context is). The gateway runs it before sending, the engine on admission."""
    vocab, context = bounds.vocab_size, bounds.max_model_len
    prompt = request.prompt_ids
    if not prompt:
        raise RequestError("the prompt is empty", param="prompt")
    bad = next((t for t in prompt if not is_int64(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad!r} is outside the vocabulary (size {vocab})", param="prompt")
    limit = request.max_tokens
    if not _count(limit):
        raise RequestError(f"max_tokens must be an integer >= 0 (0: prefill only, e.g. to score the prompt), "
                           f"got {limit!r}", param="max_tokens")
    if len(prompt) > context - (1 if limit else 0):  # scoring a prompt (max_tokens 0) needs no room
        raise RequestError(f"the prompt has {len(prompt)} tokens; this model's context is {context} tokens",
                           param="prompt", code="context_length_exceeded")
    if len(prompt) + limit > context:
        raise RequestError(f"max_tokens ({limit}) plus the prompt ({len(prompt)} tokens) exceeds this model's "
                           f"context of {context} tokens", param="max_tokens", code="context_length_exceeded")
    if not is_int64(request.min_tokens) or not 0 <= request.min_tokens <= limit:
        raise RequestError(f"min_tokens must be an integer from 0 to max_tokens ({limit}), "
                           f"got {request.min_tokens!r}", param="min_tokens")
    spec = request.num_speculative_tokens
    if spec is not None and not _count(spec):
        raise RequestError(f"num_speculative_tokens must be an integer from 0 to 2**63 - 1, got {spec!r}",
                           param="num_speculative_tokens")
    if not all(is_int64(t) for t in request.stop_token_ids):
        raise RequestError("stop token ids must be 64-bit integers", param="stop_token_ids")
    end = request.thinking_end
    if end is not None and not (len(end) == 2 and _count(end[0]) and is_int64(end[1]) and 0 <= end[1] < vocab):
        raise RequestError(f"thinking_end must be (a budget >= 0, a token id below {vocab}), got {end!r}",
                           param="thinking_token_budget")
    if not isinstance(request.sampling, SamplingParams):
        raise RequestError("sampling must be SamplingParams")
    top = request.logprobs
    if top is not None and not (is_int64(top) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}",
                           param="logprobs")
    if request.prompt_logprobs and top is None:
        raise RequestError(f"prompt log-probabilities need logprobs (a count of alternatives, 0-{MAX_TOP_LOGPROBS})",
                           param="echo")
