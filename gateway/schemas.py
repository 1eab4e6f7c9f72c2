"""Request validation for the OpenAI-compatible endpoints, with errors that name the offending field."""

import json
from dataclasses import dataclass, field

from shared.channel_gateway import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_CHOICES = 64  # n per prompt


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Prompt:
    """One prompt of a request: the client's text (None when it sent token ids) and its token ids (filled in by
    the app for text)."""

    text: str | None
    ids: list[int] = field(default_factory=list)


@dataclass
class GenerationParams:
    """Everything a completion or chat request asks for, validated; each prompt's ids are filled in by the app.
    The response has n choices per prompt, choice index = prompt index * n + j."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    num_speculative_tokens: int | None
    return_token_ids: bool = False  # extension: include the generated token ids in the response
    logprobs: int | None = None  # None: none; k: each token's log-probability and its top k alternatives
    echo: bool = False  # completions: the prompt leads the text (and the logprobs, when asked for)
    n: int = 1
    prompts: list[Prompt] = field(default_factory=list)
    messages: list[dict] | None = None


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _number(body, name, default, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {json.dumps(value)}", param=name)
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ApiError(400, f"'{name}' must be {bound}{f' and <= {high}' if high is not None else ''}, got {value}",
                       param=name)
    if high is not None and value > high:
        raise ApiError(400, f"'{name}' must be <= {high}, got {value}", param=name)
    return value


def _integer(body, name, default=None, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)}", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"'{name}' must be >= {low}, got {value}", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"'{name}' must be <= {high}, got {value}", param=name)
    return value


def _seed(body) -> int | None:
    seed = _integer(body, "seed", None)
    if seed is not None and not -2**63 <= seed < 2**63:
        raise ApiError(400, f"'seed' must fit in 64 bits (from -2**63 to 2**63 - 1), got {seed}", param="seed")
    return seed


def choice_seed(seed: int | None, index: int, choices: int) -> int | None:
    """The seed of choice `index` of a request: the request's seed for a single choice, else seed + index
    (wrapped into 64 bits), so that the choices differ and each is reproducible."""
    if seed is None or choices == 1:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def _boolean(body, name, default=False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {json.dumps(value)}", param=name)
    return value


def parse_common(body: dict, served_model: str) -> GenerationParams:
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    n = _integer(body, "n", 1, low=1, high=MAX_CHOICES)
    stream = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
    top_k = _integer(body, "top_k", 0)
    if top_k is not None and top_k < -1:
        raise ApiError(400, f"'top_k' must be -1 (off), 0 (off) or positive, got {top_k}", param="top_k")
    reject_unsupported(body)
    max_tokens = _integer(body, "max_completion_tokens", None, low=1)
    max_tokens = _integer(body, "max_tokens", max_tokens, low=0)  # 0: with echo, to score the prompt only
    return GenerationParams(
        model=model,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, low=0, high=2)),
        top_p=float(_number(body, "top_p", 1.0, low=0, high=1, low_open=True)),
        top_k=max(top_k, 0),
        seed=_seed(body),
        stop=stop,
        num_speculative_tokens=_integer(body, "num_speculative_tokens", None, low=0),
        return_token_ids=_boolean(body, "return_token_ids"),
        n=n,
    )


def reject_unsupported(body: dict) -> None:
    """OpenAI parameters that would change the output and that this server does not implement: a clear 400
    rather than an answer that silently ignores them (their neutral values are accepted)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0, low=-2, high=2) != 0:
            raise ApiError(400, f"'{name}' is not supported by this server (only 0)", param=name)
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by this server", param="logit_bias")
    if _integer(body, "best_of", 1) != 1:
        raise ApiError(400, "only best_of=1 is supported", param="best_of")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tool calling is not supported by this server", param="tools" if body.get("tools")
                       else "functions")
    neutral = (None, "none", "auto")  # with no tools offered, "auto" means no tool call either
    if body.get("tool_choice") not in neutral or body.get("function_call") not in neutral:
        raise ApiError(400, "tool calling is not supported by this server", param="tool_choice"
                       if body.get("tool_choice") not in neutral else "function_call")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported (no JSON mode or schema)",
                       param="response_format")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server", param="suffix")


def parse_completion(body: dict, served_model: str) -> GenerationParams:
    params = parse_common(body, served_model)
    if body.get("logprobs") is not None:  # the legacy form: an integer count of top alternatives
        params.logprobs = _integer(body, "logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
    params.echo = _boolean(body, "echo")
    if params.max_tokens == 0 and not params.echo:
        raise ApiError(400, "'max_tokens' must be >= 1 (0 only with echo, to score the prompt)", param="max_tokens")
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt")
    params.prompts = parse_prompts(body["prompt"])
    return params


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_prompts(prompt) -> list[Prompt]:
    """A string, a list of token ids, or a batch: a non-empty list of strings or of token-id lists."""
    if isinstance(prompt, str):
        return [Prompt(prompt)]
    if _token_ids(prompt):
        return [Prompt(None, list(prompt))]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [Prompt(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(_token_ids(p) for p in prompt):
        return [Prompt(None, list(p)) for p in prompt]
    raise ApiError(400, "'prompt' must be a string, a non-empty list of token ids, or a non-empty list of either "
                   "(a batch of prompts)", param="prompt")


def parse_chat(body: dict, served_model: str) -> GenerationParams:
    params = parse_common(body, served_model)
    if params.max_tokens == 0:
        raise ApiError(400, "'max_tokens' must be >= 1", param="max_tokens")
    if body.get("echo"):
        raise ApiError(400, "'echo' is a completions parameter, not a chat one", param="echo")
    top = _integer(body, "top_logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    if _boolean(body, "logprobs"):
        params.logprobs = top or 0
    elif top:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        cleaned.append({"role": message["role"], "content": content})
    params.messages = cleaned
    return params
