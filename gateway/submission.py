"""From a parsed request to the verify worker's requests: one GenerationRequest per choice, its max_tokens decided
where the client left it out, checked against the model (shared/generation_request.check_request, the check the
engine runs too). Pure functions."""

from dataclasses import dataclass

from gateway.schemas import ApiError, GenerationParams, Prompt, choice_seed
from shared.errors import RequestError
from shared.generation_request import GenerationRequest, ModelBounds, check_request
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    default_max_tokens: int

    @property
    def bounds(self) -> ModelBounds:
        return ModelBounds(self.vocab_size, self.max_model_len)


def max_tokens_for(params: GenerationParams, prompt: Prompt, limits: ModelLimits) -> int:
    """The client's max_tokens, else the server's default within the room the prompt leaves (at least 1: a
    prompt that fills the context is then refused by the check, naming the prompt)."""
    if params.max_tokens is not None:
        return params.max_tokens
    return min(limits.default_max_tokens, max(limits.max_model_len - len(prompt.ids), 1))


def generation_requests(params: GenerationParams, limits: ModelLimits, base: str,
                        eos_token_ids: tuple[int, ...]) -> list[GenerationRequest]:
    """One checked verify-worker request per choice, in choice order (index = prompt index * n + j); an ApiError
    (400, naming the field) for the first value the model cannot serve."""
    count = len(params.prompts) * params.n
    stop_ids = tuple(dict.fromkeys(([] if params.ignore_eos else list(eos_token_ids)) + params.stop_token_ids))
    requests = []
    try:
        for prompt_index, prompt in enumerate(params.prompts):
            limit = max_tokens_for(params, prompt, limits)
            for j in range(params.n):
                index = prompt_index * params.n + j
                sampling = SamplingParams(params.temperature, params.top_p, params.top_k,
                                          choice_seed(params.seed, index, count))
                request = GenerationRequest(
                    tuple(prompt.ids), limit, sampling, stop_ids, params.num_speculative_tokens,
                    request_id=base if count == 1 else f"{base}-{index}", logprobs=params.logprobs,
                    prompt_logprobs=params.echo and params.logprobs is not None, min_tokens=params.min_tokens,
                    grammar=params.grammar, thinking_end=tuple(params.thinking_end) if params.thinking_end else None)
                if j == 0:  # the choices of one prompt differ only in their seeds, checked as they are built
                    check_request(request, limits.bounds)
                requests.append(request)
    except RequestError as exc:
        raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
    return requests
