"""Tool calls in a chat completion: the request's tools and tool_choice, the model's call formats (hermes/Qwen3
JSON and GLM's <arg_key>/<arg_value> form: a whole call's parse, and the grammar that forces a call where
tool_choice asks for one). The stream reader is tool_call_stream.py. Pure text: no torch, no tokens."""

import json
import re
from dataclasses import dataclass

from gateway.schemas import ApiError
from gateway.structured_outputs import JSON_OPTIONS


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict  # its JSON schema ({"type": "object"} where the tool sends none)


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...]
    raw: list  # the request's tools as sent (the chat template renders them)
    choice: str  # "none", "auto", "required", or "function" (one named tool: `named`)
    named: str | None = None
    parallel: bool = True

    def spec(self, name: str) -> ToolSpec | None:
        return next((tool for tool in self.tools if tool.name == name), None)

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls."""
        return self.choice != "none"

    @property
    def forced(self) -> tuple[ToolSpec, ...]:
        """The tools a call is forced among (none: the model chooses whether to call)."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.named) if self.choice == "function" else ()


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tools, tool_choice and parallel_tool_calls, checked (400 naming the field); None without
    tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' names a call but the request offers no 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    specs = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", name):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                           "with a "
                           "name of letters, digits, '_', '.', ':' or '-' (at most 128)", param="tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict) or not (
                isinstance(parameters.get("required", []), list)
                and all(isinstance(r, str) for r in parameters.get("required", []))):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object (its properties an "
                           "object, its required a list of names)", param="tools")
        specs.append(ToolSpec(name, parameters))
    if len({s.name for s in specs}) != len(specs):
        raise ApiError(400, "'tools' has two functions of the same name", param="tools")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tuple(specs), tools, choice or "auto", None, parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(named, str)):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice")
    if named not in {s.name for s in specs}:
        raise ApiError(400, f"'tool_choice' names {named!r}, which is not among 'tools'", param="tool_choice")
    return ToolRequest(tuple(specs), tools, "function", named, parallel)


def schema_says_string(schema) -> bool:
    """Whether a property's schema allows a string (its value is then written raw in GLM's format)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None  # a boolean schema (true: anything)
    return "string" in (kinds if isinstance(kinds, list) else [kinds])


def _compact(schema) -> str:
    """A schema as Lark's %json takes it, its JSON compact (no whitespace a model could repeat without end)."""
    return json.dumps({**(schema if isinstance(schema, dict) else {}), "x-guidance": JSON_OPTIONS})


def _definitions(schema: dict) -> dict:
    """A schema's $defs / definitions, for a schema that embeds it (its #/$defs/... references resolve at the
    root)."""
    return {key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def lark_tag(text: str, tokens: frozenset[str]) -> str:
    """A tag in a Lark grammar: the tokenizer's own token where it has one (llguidance reads an added token as a
    special token, named bare: `<tool_call>`, never spelled as text), else the text."""
    return text if text in tokens else _lark_string(text)


class HermesFormat:
    """hermes / Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, body: str, tools: ToolRequest) -> tuple[str, str] | None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # arguments sent as JSON text: an object too, or this is no call
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)

    def call_rule(self, tool: ToolSpec, tags: frozenset[str] = frozenset()) -> str:
        schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False, **_definitions(tool.parameters)}
        newline = _lark_string("\n")
        return (f"{lark_tag(self.start, tags)} {newline} %json {_compact(schema)} {newline} "
                f"{lark_tag(self.end, tags)}")


class GlmFormat:
    """GLM-4.5 (spaced: a newline after the name and after each tag pair) and GLM-4.7 / 5.x (compact):
    <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>. A value is the raw text where the
    tool's schema says string, else JSON (raw text where it does not parse)."""

    start, end = "<tool_call>", "</tool_call>"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def __init__(self, spaced: bool):
        self.spaced = spaced
        self.name = "glm45" if spaced else "glm47"

    def parse(self, body: str, tools: ToolRequest) -> tuple[str, str] | None:
        cut = body.find("<arg_key>")
        name = (body if cut < 0 else body[:cut]).strip()
        if not name:
            return None
        spec = tools.spec(name)
        properties = (spec.parameters.get("properties") or {}) if spec else {}
        arguments = {}
        for key, raw in self.PAIR.findall(body):
            key = key.strip()
            if schema_says_string(properties.get(key)):
                arguments[key] = raw
                continue
            try:
                arguments[key] = json.loads(raw)
            except json.JSONDecodeError:
                arguments[key] = raw
        return name, json.dumps(arguments, ensure_ascii=False)

    def call_rule(self, tool: ToolSpec, tags: frozenset[str] = frozenset()) -> str:
        gap = _lark_string("\n") if self.spaced else ""
        key_open, key_close, value_open, value_close = (lark_tag(t, tags) for t in (
            "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
        pairs = []
        properties = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or [])
        for key, schema in properties.items():
            value = (_raw_string(schema) if schema_says_string(schema) or not isinstance(schema, dict)
                     else f"%json {_compact({**schema, **_definitions(tool.parameters)})}")
            pair = f"{key_open} {_lark_string(key)} {key_close} {gap} {value_open} {value} {value_close} {gap}"
            pairs.append(pair if key in required else f"({pair})?")
        return (f"{lark_tag(self.start, tags)} {_lark_string(tool.name)} {gap} {' '.join(pairs)} "
                f"{lark_tag(self.end, tags)}")


def _raw_string(schema) -> str:
    """A string value written raw (GLM's format) as a Lark expression: one of its enum's strings, else text
    without a tag within its minLength and maxLength."""
    schema = schema if isinstance(schema, dict) else {}
    choices = schema.get("enum")
    if isinstance(choices, list) and choices and all(isinstance(c, str) and "<" not in c for c in choices):
        return "(" + " | ".join(_lark_string(c) for c in choices) + ")"
    least, most = schema.get("minLength", 0), schema.get("maxLength")
    least = least if isinstance(least, int) and not isinstance(least, bool) and least >= 0 else 0
    if isinstance(most, int) and not isinstance(most, bool) and most >= least:
        return f"/[^<]{{{least},{most}}}/"
    return f"/[^<]{{{least},}}/" if least else "/[^<]*/"


def call_format(parser: str, chat_template: str):
    """The format of `--tool-call-parser` (auto: from the chat template: GLM's tags, else hermes); None: "none"."""
    if parser == "none":
        return None
    if parser == "auto":
        if "<arg_key>" not in chat_template:
            return HermesFormat()
        parser = "glm45" if re.search(r"</arg_key>\s*\\?n|</arg_key>\n", chat_template) else "glm47"
    return HermesFormat() if parser == "hermes" else GlmFormat(spaced=parser == "glm45")


def json_expression(constraint) -> str:
    """A JSON response format (json_schema, json_object) as a Lark expression."""
    schema = constraint.spec if constraint.kind == "json_schema" else {"type": "object"}
    return f"%json {_compact(schema if isinstance(schema, dict) else {})}"


def forced_calls(fmt, tools: ToolRequest, tags: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """The calls tool_choice forces (one, or one or more where parallel calls are allowed) as (a Lark expression,
    its rules); None where it forces none. tags: the tokenizer's added tokens (lark_tag)."""
    forced = tools.forced
    if not forced:
        return None
    rules = " | ".join(f"({fmt.call_rule(tool, tags)})" for tool in forced)
    return ("call+" if tools.parallel and tools.choice == "required" else "call"), f"call: {rules}\n"


def forced_call_grammar(fmt, tools: ToolRequest, tags: frozenset[str] = frozenset()) -> str | None:
    """forced_calls as a whole Lark grammar."""
    calls = forced_calls(fmt, tools, tags)
    return None if calls is None else f"start: {calls[0]}\n{calls[1]}"
