"""From a parsed request to the verify worker's messages: each prompt checked against the vocabulary and the
context (its max_tokens decided), then one SubmitRequest per choice. Pure functions."""

from dataclasses import dataclass

from gateway.schemas import ApiError, GenerationParams, Prompt, choice_seed
from shared.channel_gateway import SubmitRequest
from shared.errors import RequestError
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    default_max_tokens: int


def max_tokens_for(params: GenerationParams, prompt: Prompt, limits: ModelLimits) -> int:
    """The prompt's checks against the vocabulary and the context; returns its max_tokens."""
    prompt_len = len(prompt.ids)
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    bad = next((t for t in prompt.ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (size {limits.vocab_size})",
                       param="prompt")
    room = limits.max_model_len - prompt_len
    if room < (0 if params.max_tokens == 0 else 1):  # scoring a prompt (echo, max_tokens 0) needs no room
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                       f"{limits.max_model_len} tokens", param="prompt", code="context_length_exceeded")
    if params.max_tokens is not None and params.max_tokens > room:
        raise ApiError(400, f"max_tokens ({params.max_tokens}) plus the prompt ({prompt_len} tokens) exceeds "
                       f"this model's context of {limits.max_model_len} tokens", param="max_tokens",
                       code="context_length_exceeded")
    limit = min(limits.default_max_tokens, room) if params.max_tokens is None else params.max_tokens
    if params.min_tokens > limit:
        raise ApiError(400, f"min_tokens ({params.min_tokens}) exceeds max_tokens ({limit}"
                       f"{', the default within the context' if params.max_tokens is None else ''})",
                       param="min_tokens")
    return limit


def submit_messages(params: GenerationParams, limits: list[int], base: str, count: int,
                    eos_token_ids: tuple[int, ...]) -> list[SubmitRequest]:
    """One verify-worker request per choice, in choice order (index = prompt index * n + j)."""
    stop_ids = list(dict.fromkeys(([] if params.ignore_eos else list(eos_token_ids)) + params.stop_token_ids))
    messages = []
    for prompt_index, (prompt, limit) in enumerate(zip(params.prompts, limits)):
        for j in range(params.n):
            index = prompt_index * params.n + j
            try:
                sampling = SamplingParams(params.temperature, params.top_p, params.top_k,
                                          choice_seed(params.seed, index, count))
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
            messages.append(SubmitRequest(
                request_id=base if count == 1 else f"{base}-{index}", prompt_ids=prompt.ids, max_tokens=limit,
                sampling=sampling, stop_token_ids=stop_ids, min_tokens=params.min_tokens,
                num_speculative_tokens=params.num_speculative_tokens, logprobs=params.logprobs,
                prompt_logprobs=params.echo and params.logprobs is not None, grammar=params.grammar,
                thinking_end=params.thinking_end))
    return messages
