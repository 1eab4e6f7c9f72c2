"""Request validation for the OpenAI-compatible endpoints, with errors that name the offending field."""

import gc
import json
import math
from dataclasses import dataclass, field

from gateway.request_fields import (CHAT, COMPLETIONS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE,
                                    RequestField, fields_of)


def _printable(text: str) -> str:
    """text with any lone surrogate escaped, so that it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        message = _printable(message)  # no lone surrogates in the body (a JSON escape can carry them)
        param = None if param is None else _printable(param)
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
    return_meta_info: bool = False  # extension (SGLang's): each choice's speculation counts (turn.meta_info)
    logprobs: int | None = None  # None: none; k: each token's log-probability and its top k alternatives
    echo: bool = False  # completions: the prompt leads the text (and the logprobs, when asked for)
    n: int = 1
    ignore_eos: bool = False  # extension: the end-of-text token(s) do not end a choice
    min_tokens: int = 0  # extension: no stop token is sampled, and no stop string acts, before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # extension: more token ids that end a choice
    grammar: str | None = None  # the compiled grammar of response_format / structured_outputs (structured_outputs.py)
    tools: "object | None" = None  # chat: the request's tool_calls.ToolRequest, or None
    template_kwargs: dict = field(default_factory=dict)  # chat: chat_template_kwargs and reasoning_effort
    thinking: bool | None = None  # chat: None: answers not split; else whether the prompt left <think> open
    thinking_budget: int | None = None  # chat: thinking tokens at most, where the prompt left <think> open
    thinking_end: list[int] | None = None  # [budget, </think>'s id] where the budget holds (the verify worker's)
    prompts: list[Prompt] = field(default_factory=list)
    messages: list[dict] | None = None


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object. NaN, Infinity and -Infinity (which Python's json reads, but JSON does
    not have) are refused naming the field that holds them; so are integers too long to read and nesting too
    deep to parse."""
    literals = []

    def non_finite(literal: str) -> float:
        literals.append(literal)
        return float(literal)

    collecting = gc.isenabled()
    gc.disable()  # JSON makes no reference cycles: the collector, run by every 700 new containers, would only walk
    try:  # the new objects (docs/decisions/0020-request-cost-bounded-before-work.md)
        body = json.loads(raw, parse_constant=non_finite)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError:  # an integer of more digits than int() converts (sys.get_int_max_str_digits())
        raise ApiError(400, "the request body is not valid JSON: a number in it has too many digits",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply", code="invalid_json") \
            from None
    finally:
        if collecting:
            gc.enable()
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if literals:
        name = next((key for key, value in body.items() if _holds_non_finite(value)), None)
        where = f"'{name}'" if name is not None else "the request body"
        raise ApiError(400, f"{where} holds {literals[0]}: numbers must be finite (NaN, Infinity and -Infinity "
                       "are not JSON)", param=name, code="invalid_json")
    return body


def _holds_non_finite(value) -> bool:
    """Whether a parsed JSON value holds NaN or an infinity anywhere (without recursion: nesting may be deep)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return False


def _shown(value) -> str:
    """A client's value, short enough for an error message."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"


def _invalid(spec: RequestField, requirement: str, value) -> ApiError:
    return ApiError(400, f"'{spec.name}' must be {requirement}, got {_shown(value)}", param=spec.name)


def _check_range(spec: RequestField, value: int | float) -> None:
    low_ok = (spec.minimum is None or value >= spec.minimum) and \
        (spec.exclusive_minimum is None or value > spec.exclusive_minimum)
    if not low_ok or (spec.maximum is not None and value > spec.maximum):
        raise _invalid(spec, spec.range_text(), value)
    if spec.only is not None and value != spec.only:
        raise ApiError(400, f"'{spec.name}' is not supported by this server (only {spec.only})", param=spec.name)


def _integer(body: dict, spec: RequestField) -> int | None:
    value = body.get(spec.name)
    if value is None:
        return spec.default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(spec, "an integer", value)
    _check_range(spec, value)
    return value


def _number(body: dict, spec: RequestField) -> float:
    value = body.get(spec.name)
    if value is None:
        return spec.default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(spec, "a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise _invalid(spec, "a finite number", value)
    _check_range(spec, value)
    return value


def _boolean(body: dict, spec: RequestField) -> bool:
    value = body.get(spec.name)
    if value is None:
        return spec.default
    if not isinstance(value, bool):
        raise _invalid(spec, "a boolean", value)
    return value


def field_value(body: dict, spec: RequestField):
    """A scalar field's value (its default when absent or null), checked against the field's type and bounds."""
    readers = {"integer": _integer, "number": _number, "boolean": _boolean}
    if spec.json_type not in readers:
        raise TypeError(f"'{spec.name}' is a complex field: it is checked by hand")
    return readers[spec.json_type](body, spec)


def choice_seed(seed: int | None, index: int, choices: int) -> int | None:
    """The seed of choice `index` of a request: the request's seed for a single choice, else seed + index
    (wrapped into 64 bits), so that the choices differ and each is reproducible."""
    if seed is None or choices == 1:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def _valid_text(text: str) -> bool:
    """Whether a string is valid Unicode (JSON's \\ud800-style escapes can leave lone surrogates, which the
    tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stop(body: dict) -> list[str]:
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
    return stop


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, each from 0 "
                       f"to {vocab_size - 1} (the vocabulary)", param="stop_token_ids")
    return list(dict.fromkeys(ids))


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ApiError(400, f"'stream_options.include_usage' must be a boolean, got {_shown(include)}",
                       param="stream_options")
    return bool(include)


def served_model_of(body: dict, served_model: str) -> str:
    """The body's model (the served one where it names none): a 404 naming the served model for any other."""
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model != served_model:
        raise ApiError(404, f"the model {_shown(model)} does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    return model


def parse_common(body: dict, served_model: str, vocab_size: int, endpoint: str) -> GenerationParams:
    """The fields both endpoints share. vocab_size: a top_k this large or larger cuts nothing (sent as 0)."""
    fields = fields_of(endpoint)
    model = served_model_of(body, served_model)
    for spec in fields.values():
        if spec.required and spec.name not in body:
            raise ApiError(400, f"'{spec.name}' is required", param=spec.name)
    n = field_value(body, fields["n"])
    stream = field_value(body, fields["stream"])
    include_usage = _include_usage(body)
    stop = _stop(body)
    top_k = field_value(body, fields["top_k"])
    reject_unsupported(body, fields)
    newer_max_tokens = field_value(body, fields["max_completion_tokens"])
    max_tokens = field_value(body, fields["max_tokens"])
    temperature = float(field_value(body, fields["temperature"]))
    return GenerationParams(
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=newer_max_tokens if max_tokens is None else max_tokens,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,  # -0.0 too
        top_p=float(field_value(body, fields["top_p"])),
        top_k=0 if top_k == -1 or top_k >= vocab_size else top_k,
        seed=field_value(body, fields["seed"]),
        stop=stop,
        num_speculative_tokens=field_value(body, fields["num_speculative_tokens"]),
        return_token_ids=field_value(body, fields["return_token_ids"]),
        return_meta_info=field_value(body, fields["return_meta_info"]),
        n=n,
        ignore_eos=field_value(body, fields["ignore_eos"]),
        min_tokens=field_value(body, fields["min_tokens"]),
        stop_token_ids=_stop_token_ids(body, vocab_size),
    )


def reject_unsupported(body: dict, fields: dict[str, RequestField]) -> None:
    """OpenAI parameters that would change the output and that this server does not implement: a clear 400
    rather than an answer that silently ignores them (their neutral values are accepted)."""
    for name in ("presence_penalty", "frequency_penalty", "best_of"):
        field_value(body, fields[name])
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by this server", param="logit_bias")
    chat = "parallel_tool_calls" in fields  # the chat endpoint: its tools are read by tool_calls.tool_request
    if body.get("functions") or (body.get("tools") and not chat):
        raise ApiError(400, "'functions' is not supported: send 'tools' to /v1/chat/completions" if
                       body.get("functions") else "'tools' is a chat parameter (/v1/chat/completions)",
                       param="functions" if body.get("functions") else "tools")
    neutral = (None, "none", "auto")  # with no tools offered, "auto" means no tool call either
    if (body.get("tool_choice") not in neutral and not chat) or body.get("function_call") not in neutral:
        raise ApiError(400, "'tool_choice' is a chat parameter (/v1/chat/completions)" if not chat and
                       body.get("tool_choice") not in neutral else "'function_call' is not supported: send "
                       "'tool_choice' with 'tools'", param="tool_choice" if not chat and body.get("tool_choice")
                       not in neutral else "function_call")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server", param="suffix")


def parse_completion(body: dict, served_model: str, vocab_size: int, max_prompts: int) -> GenerationParams:
    params = parse_common(body, served_model, vocab_size, COMPLETIONS)
    fields = fields_of(COMPLETIONS)
    params.logprobs = field_value(body, fields["logprobs"])  # the legacy form: a count of top alternatives
    params.echo = field_value(body, fields["echo"])
    if params.max_tokens == 0 and not params.echo:
        raise ApiError(400, "'max_tokens' must be >= 1 (0 only with echo, to score the prompt)", param="max_tokens")
    params.prompts = parse_prompts(body["prompt"], max_prompts)
    return params


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_prompts(prompt, max_prompts: int) -> list[Prompt]:
    """A string, a list of token ids, or a batch: a non-empty list of at most max_prompts strings or token-id
    lists (a longer batch is refused before any of it is read)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > max_prompts:
        raise ApiError(400, f"'prompt' is a batch of {len(prompt)} prompts; the server admits at most {max_prompts} "
                       "choices at once", param="prompt")
    if isinstance(prompt, str):
        prompts = [Prompt(prompt)]
    elif _token_ids(prompt):
        return [Prompt(None, list(prompt))]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [Prompt(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_token_ids(p) for p in prompt):
        return [Prompt(None, list(p)) for p in prompt]
    else:
        raise ApiError(400, "'prompt' must be a string, a non-empty list of token ids, or a non-empty list of "
                       "either (a batch of prompts)", param="prompt")
    if not all(_valid_text(p.text) for p in prompts):
        raise ApiError(400, "'prompt' is not valid Unicode (it holds a lone surrogate escape)", param="prompt")
    return prompts


def parse_chat(body: dict, served_model: str, vocab_size: int, max_messages: int) -> GenerationParams:
    params = parse_common(body, served_model, vocab_size, CHAT)
    fields = fields_of(CHAT)
    if field_value(body, fields["echo"]):
        raise ApiError(400, "'echo' is a completions parameter, not a chat one", param="echo")
    top = field_value(body, fields["top_logprobs"])
    if field_value(body, fields["logprobs"]):
        params.logprobs = top or 0
    elif top:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    params.messages = parse_messages(body["messages"], max_messages)
    from gateway.tool_calls import tool_request  # it raises this module's ApiError

    params.tools = tool_request(body)
    params.template_kwargs = template_kwargs(body)
    params.thinking_budget = field_value(body, fields["thinking_token_budget"])
    return params


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs (an object of at most 64 keys) and reasoning_effort (a string) for the template."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or len(kwargs) > 64 or not all(isinstance(k, str) for k in kwargs):
        raise ApiError(400, "'chat_template_kwargs' must be an object of at most 64 variables",
                       param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or len(effort) > 32:
            raise ApiError(400, "'reasoning_effort' must be a short string (low, medium, high, max)",
                           param="reasoning_effort")
        kwargs = {**kwargs, "reasoning_effort": effort}
    return kwargs


def parse_messages(messages, max_messages: int) -> list[dict]:
    """A non-empty list of at most max_messages {role, content} objects, content a string or a list of text
    parts; returns them with string contents."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if len(messages) > max_messages:
        raise ApiError(400, f"'messages' has {len(messages)} messages; at most {max_messages} are accepted (every "
                       "message takes at least one token of the context)", param="messages",
                       code="context_length_exceeded")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts (with a string 'text') are supported",
                               param="messages")
            content = "".join(p.get("text", "") for p in content)
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if content is None and calls:  # an assistant turn of calls alone
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        if not _valid_text(message["role"]) or not _valid_text(content):
            raise ApiError(400, f"messages[{i}] is not valid Unicode (it holds a lone surrogate escape)",
                           param="messages")
        cleaned.append({"role": message["role"], "content": content, **_tool_parts(message, i)})
    return cleaned


def _tool_parts(message: dict, i: int) -> dict:
    """What a chat template reads of a message besides its role and content: an assistant's tool_calls (their
    arguments as objects, as templates expect) and reasoning_content, a tool result's tool_call_id and name."""
    parts = {}
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        parts["tool_calls"] = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ApiError(400, f"messages[{i}].tool_calls[{j}] must hold a function with a name",
                               param="messages")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                                   param="messages") from None
            parts["tool_calls"].append({"id": call.get("id"), "type": "function",
                                        "function": {"name": function["name"], "arguments": arguments}})
    for name in ("reasoning_content", "tool_call_id", "name"):
        if isinstance(message.get(name), str):
            parts[name] = message[name]
    return parts
