"""The request fields of POST /v1/completions and POST /v1/chat/completions, in one table: each field's JSON
type, default, bounds and description. The validators in gateway/schemas.py take their types and bounds from
here and body_schema() builds the OpenAPI request bodies from it, so the checks and the docs cannot drift apart.
"""

import copy
from dataclasses import dataclass
from typing import Any

from shared.generation_request import MAX_TOP_LOGPROBS
from shared.request_limits import INT64_MAX, INT64_MIN, MIN_TEMPERATURE

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 64  # n per prompt

COMPLETIONS, CHAT = "completions", "chat"
ENDPOINTS = (COMPLETIONS, CHAT)


@dataclass(frozen=True)
class RequestField:
    """One request field. Scalars (integer, number, boolean) are checked against json_type and the bounds;
    complex fields carry their JSON-schema fragment and are checked by hand in gateway/schemas.py."""

    name: str
    json_type: str  # "integer", "number", "boolean", "string", "object", "array", or "any" (see fragment)
    description: str
    default: Any = None  # what an absent or null field means; None: no fixed default
    minimum: int | float | None = None
    maximum: int | float | None = None
    exclusive_minimum: int | float | None = None
    only: Any = None  # the one value a parameter this server does not implement may take
    fragment: dict | None = None  # the JSON schema of a complex field (copied on use, never changed)
    endpoints: tuple[str, ...] = ENDPOINTS
    required: bool = False
    example: Any = None  # the field's value in the documented example body

    def json_schema(self) -> dict:
        schema = copy.deepcopy(self.fragment) if self.fragment is not None else {"type": self.json_type}
        if self.json_type == "integer":
            schema["format"] = "int64"
        if self.minimum is not None:
            schema["minimum"] = self.minimum
        if self.exclusive_minimum is not None:
            schema["exclusiveMinimum"] = self.exclusive_minimum
        if self.maximum is not None:
            # FastAPI's OpenAPI model stores bounds as doubles: 2**63 - 1 is not one, so it is written as the
            # equivalent exclusive bound 2**63 (exact), which says the same for integers
            exact = float(self.maximum) == self.maximum
            schema["maximum" if exact else "exclusiveMaximum"] = self.maximum if exact else self.maximum + 1
        if self.only is not None:
            schema["const"] = self.only
        if self.default is not None:
            schema["default"] = self.default
        schema["description"] = self.description
        return schema

    def range_text(self) -> str:
        """The allowed range in words, for error messages."""
        low = f">= {_bound(self.minimum)}" if self.minimum is not None else \
            f"> {_bound(self.exclusive_minimum)}" if self.exclusive_minimum is not None else None
        high = f"<= {_bound(self.maximum)}" if self.maximum is not None else None
        return " and ".join(part for part in (low, high) if part)


def _bound(value) -> str:
    return {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1"}.get(value, str(value)) if isinstance(value, int) \
        else f"{value:g}"


def integer(name: str, description: str, default: int | None = None, minimum: int = INT64_MIN,
            maximum: int = INT64_MAX, **rest) -> RequestField:
    """An integer field: every integer the engine computes with fits in int64."""
    if not INT64_MIN <= minimum <= maximum <= INT64_MAX:
        raise ValueError(f"{name}: the bounds of an integer field must lie within int64")
    return RequestField(name, "integer", description, default, minimum, maximum, **rest)


def number(name: str, description: str, default: float, **rest) -> RequestField:
    """A number field; NaN and the infinities are always refused."""
    return RequestField(name, "number", description, default, **rest)


def boolean(name: str, description: str, **rest) -> RequestField:
    return RequestField(name, "boolean", description, False, **rest)


def shaped(name: str, description: str, fragment: dict, **rest) -> RequestField:
    """A complex field, documented by its JSON-schema fragment."""
    return RequestField(name, fragment.get("type", "any"), description, fragment=fragment, **rest)


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_NEUTRAL_TOOL_CHOICE = {"type": "string", "enum": ["none", "auto"]}

FIELDS = (
    shaped("model", "The served model's name (the default); any other name is a 404.", {"type": "string"}),
    shaped("prompt", "A string, a list of token ids (each below the vocabulary size), or a batch: a non-empty "
           "list of strings or of token-id lists (at most as many as the server admits choices at once). Each "
           "prompt is refused unread past the context: token ids past its length, text past its length times the "
           "longest token of the vocabulary in bytes.",
           {"anyOf": [{"type": "string"}, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                      {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]},
           endpoints=(COMPLETIONS,), required=True, example="def add(a, b):"),
    shaped("messages", "The conversation, rendered with the target's chat template; content is a string or a "
           "list of text parts. At most one message a token of the context; each content, and the rendered "
           "conversation, within the characters the context can hold (as for a prompt).",
           {"type": "array", "minItems": 1, "items": {
               "type": "object", "required": ["role", "content"], "properties": {
                   "role": {"type": "string"},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                       "type": "object", "required": ["type"],
                       "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}},
           endpoints=(CHAT,), required=True, example=[{"role": "user", "content": "Write a haiku about tea."}]),
    integer("max_tokens", "Tokens to generate at most (default: the server's default, within the context); 0 "
            "only with echo, to score the prompt.", minimum=0, endpoints=(COMPLETIONS,), example=32),
    integer("max_tokens", "Tokens to generate at most (default: the server's default, within the context).",
            minimum=1, endpoints=(CHAT,), example=32),
    integer("max_completion_tokens", "The newer name of max_tokens; max_tokens wins when both are given.",
            minimum=1),
    number("temperature", f"Sampling temperature; 0 is greedy, and so is any value below {MIN_TEMPERATURE:g} "
           "(as vLLM and SGLang treat it).", 1.0, minimum=0, maximum=2, example=0.7),
    number("top_p", "Nucleus sampling: keep the most likely tokens whose mass reaches top_p (always at least the "
           "top one).", 1.0, exclusive_minimum=0, maximum=1, example=0.95),
    integer("top_k", "Keep the k most likely tokens; -1 or 0 is no cut, and so is any k >= the vocabulary size "
            "(extension).", default=0, minimum=-1, example=50),
    integer("seed", "Fixes the random draws; choice i of a request with several choices uses seed + i, wrapped "
            "into 64 bits.", example=1234),
    shaped("stop", f"Up to {MAX_STOP_STRINGS} strings that end a choice (not included in its text).",
           {"anyOf": [{"type": "string"},
                      {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string"}}]},
           example=["\n\n"]),
    shaped("stop_token_ids", f"Up to {MAX_STOP_TOKEN_IDS} token ids that end a choice besides the end-of-text "
           "token(s), each below the vocabulary size; the stop token is kept in the token ids (extension, as vLLM).",
           {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer", "minimum": 0}}),
    boolean("ignore_eos", "Generate past the end-of-text token(s): only max_tokens, stop strings and "
            "stop_token_ids end a choice (extension, as vLLM; for benchmarks of fixed output lengths)."),
    integer("min_tokens", "Tokens to generate at least: the end-of-text token(s) and stop_token_ids are masked "
            "until then, and stop strings act only after that many tokens (extension, as vLLM); at most max_tokens.",
            default=0, minimum=0),
    integer("n", "Choices per prompt.", default=1, minimum=1, maximum=MAX_CHOICES, example=1),
    boolean("stream", "Send server-sent events in OpenAI chunks, ending with data: [DONE]."),
    shaped("stream_options", "include_usage: a last chunk with the request's usage.",
           {"type": "object", "properties": {"include_usage": {"type": "boolean", "default": False}}}),
    integer("num_speculative_tokens", "Draft tokens per verify step at most (default and cap: the drafter's block "
            "size - 1); 0 is plain decoding (extension).", minimum=0),
    boolean("return_token_ids", "Include the generated token ids in each choice or chunk (extension)."),
    boolean("return_meta_info", "Include each choice's speculation counts in SGLang's meta_info form "
            "(spec_verify_ct, spec_draft_token_num, spec_accept_token_num, spec_accept_rate, spec_accept_length, "
            "completion_tokens): in the choice, or streamed in the choice's last chunk (extension, as SGLang)."),
    integer("logprobs", "Each token's log-probability and those of its k most likely alternatives.",
            minimum=0, maximum=MAX_TOP_LOGPROBS, endpoints=(COMPLETIONS,)),
    boolean("echo", "Put the prompt before the completion, in the text and in the log-probabilities.",
            endpoints=(COMPLETIONS,)),
    boolean("logprobs", "Each token's log-probability.", endpoints=(CHAT,)),
    integer("top_logprobs", "With logprobs: the k most likely alternatives of each token.",
            minimum=0, maximum=MAX_TOP_LOGPROBS, endpoints=(CHAT,)),
    boolean("echo", "A completions parameter: refused here when true.", endpoints=(CHAT,)),
    number("presence_penalty", "Not implemented: only 0 is accepted.", 0, minimum=-2, maximum=2, only=0),
    number("frequency_penalty", "Not implemented: only 0 is accepted.", 0, minimum=-2, maximum=2, only=0),
    integer("best_of", "Not implemented: only 1 is accepted.", default=1, minimum=1, only=1),
    shaped("logit_bias", "Not implemented: only an empty object is accepted.", {"type": "object", "maxProperties": 0}),
    shaped("suffix", "Not implemented: only an empty string is accepted.", {"type": "string", "maxLength": 0}),
    shaped("tools", "Functions the model may call: {\"type\": \"function\", \"function\": {\"name\", "
           "\"description\", \"parameters\": a JSON schema}}; rendered by the chat template, and the output's calls "
           "parsed in the model's format (--tool-call-parser) into message.tool_calls.",
           {"type": "array", "items": {"type": "object"}}, endpoints=(CHAT,)),
    shaped("tools", "A chat parameter: only an empty list is accepted here.", {"type": "array", "maxItems": 0},
           endpoints=(COMPLETIONS,)),
    shaped("tool_choice", "none (no call is parsed), auto (the model chooses), required (at least one call, forced "
           "by a grammar in the model's call format) or {\"type\": \"function\", \"function\": {\"name\": ...}} "
           "(that call, forced).",
           {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object"}]},
           endpoints=(CHAT,)),
    shaped("tool_choice", "A chat parameter: only none or auto.", _NEUTRAL_TOOL_CHOICE, endpoints=(COMPLETIONS,)),
    RequestField("parallel_tool_calls", "boolean", "Whether a forced (required) answer may hold several calls.",
                 True, endpoints=(CHAT,)),
    shaped("chat_template_kwargs", "Variables for the chat template (e.g. enable_thinking); they never replace "
           "messages, tools or the generation prompt (extension, as vLLM).", {"type": "object"}, endpoints=(CHAT,)),
    integer("thinking_token_budget", "Where the chat template opens a thinking section: its tokens at most; "
            "the closing </think> is then forced at that position (extension).", minimum=0, endpoints=(CHAT,)),
    shaped("reasoning_effort", "Passed to the chat template as reasoning_effort (e.g. low, high, max: GLM-5.3's "
           "thinking depth).", {"type": "string"}, endpoints=(CHAT,)),
    shaped("functions", "The deprecated form of tools: not implemented, only an empty list is accepted.",
           {"type": "array", "maxItems": 0}),
    shaped("function_call", "The deprecated form of tool_choice: only none or auto.", _NEUTRAL_TOOL_CHOICE),
    shaped("response_format", "text, json_object (any JSON object) or json_schema ({\"json_schema\": {\"name\": ..., "
           "\"schema\": {...}, \"strict\": true}}): the output obeys it (compact JSON, no free whitespace).",
           {"type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {"type": "object"}}}),
    shaped("structured_outputs", "vLLM's constraints, one of: json (a schema), regex, choice (strings), grammar "
           "(EBNF with ::=, else Lark), json_object (true).", {"type": "object"}),
    shaped("guided_json", "vLLM's older form of structured_outputs.json (a schema, or its JSON text).",
           {"anyOf": [{"type": "object"}, {"type": "string"}]}),
    shaped("guided_regex", "vLLM's older form of structured_outputs.regex.", {"type": "string"}),
    shaped("guided_choice", "vLLM's older form of structured_outputs.choice.", {"type": "array",
                                                                               "items": {"type": "string"}}),
    shaped("guided_grammar", "vLLM's older form of structured_outputs.grammar.", {"type": "string"}),
)


def fields_of(endpoint: str) -> dict[str, RequestField]:
    """The fields of one endpoint's body, by name."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    return {spec.name: spec for spec in FIELDS if endpoint in spec.endpoints}


def example_body(endpoint: str) -> dict:
    """The documented example body of an endpoint: every field's example."""
    return {spec.name: copy.deepcopy(spec.example) for spec in fields_of(endpoint).values()
            if spec.example is not None}


def unknown_fields(body: dict, endpoint: str) -> list[str]:
    """The names in a body that no field of the endpoint has (they are ignored)."""
    known = fields_of(endpoint)
    return [name for name in body if name not in known]


def body_schema(endpoint: str) -> dict:
    """The JSON schema of an endpoint's request body."""
    fields = fields_of(endpoint).values()
    return {
        "type": "object",
        "description": "A null field means its default; fields not listed here are ignored. A body over the "
                       "server's --max-body-mb is refused with a 413 before it is read.",
        "required": [spec.name for spec in fields if spec.required],
        "properties": {spec.name: spec.json_schema() for spec in fields},
        "examples": [example_body(endpoint)],
    }
