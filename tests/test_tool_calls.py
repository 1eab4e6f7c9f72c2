"""Tool-call parsing (gateway/tool_calls.py, tool_call_stream.py) on the failures users report of other servers: zero-argument calls,
names cut short and arguments lost when a step delivers several tokens at once, a partial tag leaking into content,
several calls in one answer, GLM's typed values read by the tool's schema; each streamed in pieces of 1, 3 and 8
tokens of the demo tokenizer and whole. The grammars that force a call accept the calls and nothing else."""

import json

import llguidance
import pytest
from tokenizers import Tokenizer

from gateway.schemas import ApiError
from gateway.tool_call_stream import ToolCallStream, parse_whole
from gateway.tool_calls import GlmFormat, HermesFormat, call_format, forced_call_grammar, tool_request
from shared.demo_models import DEMO_DIR
from shared.grammar import folder_vocabulary, new_matcher

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"enum": ["c", "f"]}, "detail": {"type": "object"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
TOKENIZER = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
GLM47 = ('Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days'
         '</arg_key><arg_value>3</arg_value></tool_call><tool_call>get_time</tool_call>')
GLM45 = ('Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days'
         '</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>')
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]


def pieces(text: str, tokens_a_step: int) -> list[str]:
    """The text as a server streams it: the demo tokenizer's tokens, `tokens_a_step` decoded at a time."""
    ids = TOKENIZER.encode(text).ids
    out, sent = [], ""
    for end in range(tokens_a_step, len(ids) + tokens_a_step, tokens_a_step):
        whole = TOKENIZER.decode(ids[:end])
        out.append(whole[len(sent):])
        sent = whole
    assert sent == text
    return out


@pytest.mark.parametrize("fmt,text", [(HermesFormat(), HERMES), (GlmFormat(spaced=False), GLM47),
                                      (GlmFormat(spaced=True), GLM45)], ids=["hermes", "glm47", "glm45"])
@pytest.mark.parametrize("tokens_a_step", [1, 3, 8, 10_000])
def test_a_call_starts_whole_and_its_arguments_stream_whatever_a_step_delivers(fmt, text, tokens_a_step):
    tools = tool_request({"tools": TOOLS})
    stream = ToolCallStream(fmt, tools)
    deltas = []
    for piece in pieces(text, tokens_a_step):
        deltas += stream.feed(piece)
        for delta in deltas:
            assert "<" not in delta.content, delta  # no part of a tag ever reaches content
    deltas += stream.finish()
    assert "".join(d.content for d in deltas if d.index is None) == "Let me check."
    starts = [d for d in deltas if d.id is not None]  # a call's id and name once, whole, before its arguments
    assert [(c.index, c.name, c.arguments) for c in starts] == [(0, "get_weather", ""), (1, "get_time", "")]
    assert all(c.id.startswith("call_") for c in starts) and len({c.id for c in starts}) == 2
    calls = [d for d in deltas if d.index is not None]
    assert all(d.name is None and d.id is None and d.arguments for d in calls if d not in starts)
    joined = ["".join(d.arguments for d in calls if d.index == i) for i in (0, 1)]
    assert [(c.name, json.loads(a)) for c, a in zip(starts, joined)] == WANT  # the zero-argument call too: "{}"
    assert stream.call_list == [(c.id, c.name, a) for c, a in zip(starts, joined)]
    pieces_of_first = [d for d in calls if d.index == 0 and d.id is None]
    if tokens_a_step == 1:  # the arguments came as they were generated, not at the call's end
        assert len(pieces_of_first) >= 3
    assert [c.as_openai() for c in starts][0] == {"index": 0, "id": starts[0].id, "type": "function",
                                                  "function": {"name": "get_weather", "arguments": ""}}


def test_a_long_string_argument_streams_escaped_as_it_is_generated():
    """A coding agent's file content: a GLM string value goes out piece by piece, JSON-escaped, before its end."""
    tools = tool_request({"tools": TOOLS})
    stream = ToolCallStream(GlmFormat(spaced=False), tools)
    value = 'line "one"\n\tline two </arg\u00e9'
    head = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>"
    got = stream.feed(head) + stream.feed(value[:10]) + stream.feed(value[10:])
    assert "".join(d.arguments or "" for d in got).startswith('{"city": "line ')  # before </arg_value> came
    got += stream.feed("</arg_value></tool_call>") + stream.finish()
    assert json.loads("".join(d.arguments or "" for d in got)) == {"city": value}


def test_a_call_cut_by_max_tokens_keeps_what_came():
    tools = tool_request({"tools": TOOLS})
    content, calls = parse_whole(GlmFormat(spaced=False), tools,
                                 "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par")
    assert content == "" and calls[0][1] == "get_weather" and json.loads(calls[0][2]) == {"city": "Par"}
    content, calls = parse_whole(HermesFormat(), tools, '<tool_call>{"name": "get_time", "arguments": {"a": ')
    assert content == "" and calls[0][1:] == ("get_time", '{"a": ')  # as generated: finish_reason says "length"


def test_glm_values_are_read_by_the_tool_schema():
    tools = tool_request({"tools": TOOLS})
    body = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value><arg_key>days</arg_key>"
            "<arg_value>7</arg_value><arg_key>detail</arg_key><arg_value>{\"wind\": true}</arg_value><arg_key>extra"
            "</arg_key><arg_value>not json</arg_value></tool_call>")
    content, calls = parse_whole(GlmFormat(spaced=False), tools, body)
    assert content == "" and json.loads(calls[0][2]) == {"city": "42", "days": 7, "detail": {"wind": True},
                                                          "extra": "not json"}


def test_an_unclosed_or_broken_call_is_content_not_a_call():
    tools = tool_request({"tools": TOOLS})
    content, calls = parse_whole(HermesFormat(), tools, 'a <tool_call>\n{"name": "get_wea')  # cut by max_tokens
    assert calls == [] and content == 'a <tool_call>\n{"name": "get_wea'
    content, calls = parse_whole(HermesFormat(), tools, "x <tool_call>not json</tool_call> y <tool")
    assert calls == [] and content == "x <tool_call>not json</tool_call> y <tool"


@pytest.mark.parametrize("body,message", [
    ({"tools": {"a": 1}}, "must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "JSON schema object"),
    ({"tools": TOOLS + TOOLS[:1]}, "same name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tool_choice": "required"}, "offers no 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "boolean"),
])
def test_bad_tool_fields_get_a_400_naming_them(body, message):
    with pytest.raises(ApiError) as caught:
        tool_request(body)
    assert caught.value.status == 400 and message in caught.value.message


def test_the_parser_follows_the_chat_template():
    assert isinstance(call_format("auto", "{{ messages }}"), HermesFormat)
    assert call_format("auto", "<tool_call>{{ name }}<arg_key>{{ k }}</arg_key><arg_value>").name == "glm47"
    assert call_format("auto", "<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>").name == "glm45"
    assert call_format("none", "") is None and call_format("glm45", "").name == "glm45"


@pytest.mark.parametrize("fmt,text", [(HermesFormat(), HERMES.replace(": ", ":").replace(", ", ",")),
                                      (GlmFormat(spaced=False), GLM47), (GlmFormat(spaced=True), GLM45)],
                         ids=["hermes", "glm47", "glm45"])
def test_a_forced_call_grammar_takes_calls_and_nothing_else(fmt, text):
    """The calls of a forced answer, JSON compact (as structured outputs: no whitespace to repeat without end)."""
    vocabulary = folder_vocabulary(DEMO_DIR / "target", 4096, (0,))
    required = tool_request({"tools": TOOLS, "tool_choice": "required"})
    named = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                          "parallel_tool_calls": False})
    calls = text[len("Let me check."):]
    second = calls[calls.index(fmt.start, 1):]
    for tools, good, bad in ((required, calls, "Let me check." + calls), (named, second, calls)):
        grammar = llguidance.LLMatcher.grammar_from_lark(forced_call_grammar(fmt, tools))
        ids = TOKENIZER.encode(good).ids
        matcher = new_matcher(vocabulary, grammar)
        assert matcher.validate_tokens(ids) == len(ids)
        matcher.consume_tokens(ids)
        assert matcher.is_accepting()
        ids = TOKENIZER.encode(bad).ids
        assert new_matcher(vocabulary, grammar).validate_tokens(ids) < len(ids)
    assert forced_call_grammar(fmt, tool_request({"tools": TOOLS})) is None  # "auto" forces nothing


@pytest.mark.parametrize("choice", [{"type": "function", "function": "get_time"}, {"type": "function", "function": None},
                                    {"type": "function"}])
def test_a_malformed_named_choice_is_a_400(choice):
    with pytest.raises(ApiError) as caught:
        tool_request({"tools": TOOLS, "tool_choice": choice})
    assert caught.value.status == 400 and caught.value.param == "tool_choice"


def test_arguments_that_are_no_object_are_no_call():
    tools = tool_request({"tools": TOOLS})
    for body in ('{"name": "get_time", "arguments": "oops"}', '{"name": "get_time", "arguments": [1]}',
                 '{"name": "get_time", "arguments": null}'):
        content, calls = parse_whole(HermesFormat(), tools, f"<tool_call>{body}</tool_call>")
        assert calls == [] and body in content
    content, calls = parse_whole(HermesFormat(), tools, '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    assert content == "" and calls[0][1:] == ("get_time", "{}")


def test_schemas_with_definitions_and_boolean_properties_force_calls():
    vocabulary = folder_vocabulary(DEMO_DIR / "target", 4096, (0,))
    parameters = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}},
                  "properties": {"unit": {"$ref": "#/$defs/Unit"}, "note": True}, "required": ["unit"],
                  "additionalProperties": False}
    tools = tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                          "tool_choice": "required", "parallel_tool_calls": False})
    for fmt, text in ((HermesFormat(), '<tool_call>\n{"name":"f","arguments":{"unit":"c"}}\n</tool_call>'),
                      (GlmFormat(spaced=False), '<tool_call>f<arg_key>unit</arg_key><arg_value>"c"</arg_value>'
                                                 '</tool_call>')):
        grammar = llguidance.LLMatcher.grammar_from_lark(forced_call_grammar(fmt, tools))
        ids = TOKENIZER.encode(text).ids
        assert new_matcher(vocabulary, grammar).validate_tokens(ids) == len(ids), fmt.name
    with pytest.raises(ApiError) as caught:
        tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": ["x"]}}}]})
    assert caught.value.param == "tools"


def test_glm_string_values_keep_their_length_bounds_and_enums():
    """A raw string value is bounded by its schema's maxLength (a random model would otherwise write until
    max_tokens) and chosen among its enum."""
    vocabulary = folder_vocabulary(DEMO_DIR / "target", 4096, (0,))
    parameters = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 3},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}},
                  "required": ["city", "unit"]}
    tools = tool_request({"tools": [{"type": "function", "function": {"name": "w", "parameters": parameters}}],
                          "tool_choice": "required", "parallel_tool_calls": False})
    grammar = llguidance.LLMatcher.grammar_from_lark(forced_call_grammar(GlmFormat(spaced=False), tools))

    def takes(city: str, unit: str) -> bool:
        text = (f"<tool_call>w<arg_key>city</arg_key><arg_value>{city}</arg_value><arg_key>unit</arg_key>"
                f"<arg_value>{unit}</arg_value></tool_call>")
        ids = TOKENIZER.encode(text).ids
        return new_matcher(vocabulary, grammar).validate_tokens(ids) == len(ids)

    assert takes("Oslo"[:3], "c") and takes("x", "f")
    assert not takes("Oslo", "c") and not takes("", "c") and not takes("Osl", "k")
