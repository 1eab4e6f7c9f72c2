"""Structured outputs through dflash-serve with its default flags (the demo pair, DFlash 2 drafter, adaptive
policy) and the official openai client: 20 JSON schemas, streamed and not, every output parses and validates; the
other constraint forms; bad constraints and a schema bomb get a 400 in bounded time while a stream beside them
is identical to its solo run; a tool-call loop whose calls tool_choice forces with a grammar."""

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from server_harness import demo_server
from structured_schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("structured") / "serve.log"


@pytest.fixture(scope="module")
def server(server_log):
    with demo_server(server_log) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def answer(client, schema, stream: bool) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    if not stream:
        response = client.chat.completions.create(model="dflash-demo", messages=MESSAGES, max_tokens=160,
                                                  temperature=0, response_format=fmt)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model="dflash-demo", messages=MESSAGES, max_tokens=160,
                                                temperature=0, response_format=fmt, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_twenty_json_schemas_through_the_openai_client_streamed_and_not(client):
    assert len(SCHEMAS) >= 20
    for index, schema in enumerate(SCHEMAS):
        whole, reason = answer(client, schema, stream=False)
        assert reason == "stop", (index, whole)
        jsonschema.validate(json.loads(whole), schema)
        streamed, _ = answer(client, schema, stream=True)
        assert streamed == whole, index


def test_the_draft_worker_drafts_under_the_grammar(server, server_log):
    """The draft worker builds the target's grammar vocabulary and says in its pong that it can draft under
    grammars (what --grammar-drafts masked and drafted use: tests/test_grammar_drafting.py drafts over its socket);
    with the default flags a constrained request's drafts are accepted (forced tokens among them)."""
    assert "drafting under grammars" in server_log.read_text()
    body = {"model": "dflash-demo", "messages": MESSAGES, "max_tokens": 160, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[0]}}}
    usage = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["speculative"]["accepted_tokens"] > 0, usage


def test_json_object_regex_choice_and_grammar_forms(server):
    forms = {
        "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"},
        "guided_choice": ["left", "right"],
        "guided_grammar": 'root ::= "x" [0-9] [0-9]?',
    }
    for name, value in forms.items():
        body = {"model": "dflash-demo", "prompt": "value = ", "max_tokens": 40, "temperature": 0, name: value}
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        if name == "response_format":
            assert isinstance(json.loads(text), dict), text
        elif name == "structured_outputs":
            assert len(text) == 6 and text[3] == "-" and text[4:].isdigit(), text
        elif name == "guided_choice":
            assert text in ("left", "right"), text
        else:
            assert text[0] == "x" and text[1:].isdigit() and len(text) in (2, 3), text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format",
     "must be an object with a 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format",
     "cannot be compiled"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be"),
    ({"guided_regex": "a(b"}, "guided_regex", "cannot be compiled"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar", "cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"json": {"type": "object"}}, "guided_regex": "a"}, "guided_regex", "one constraint"),
]


@pytest.mark.parametrize("extra,param,message", BAD)
def test_bad_constraints_get_a_400_naming_them(server, extra, param, message):
    body = {"model": "dflash-demo", "prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def bomb_schemas() -> dict:
    deep: dict = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    return {"deep nesting": deep,
            "huge enum": {"enum": [f"value-{i:06d}-" + "x" * 40 for i in range(6000)]},
            "pathological regex": {"type": "string", "pattern": "^((a+)+|(b+)+)+(c{1,1000}){1,1000}$"}}


def test_a_schema_bomb_is_refused_in_bounded_time_and_a_stream_beside_it_is_unchanged(server):
    body = {"model": "dflash-demo", "prompt": "def merge(a, b):", "max_tokens": 48, "temperature": 0,
            "stream": True}

    def stream() -> str:
        text = ""
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    alone = stream()
    beside: dict = {}
    runner = threading.Thread(target=lambda: beside.update(text=stream()))
    runner.start()
    for name, schema in bomb_schemas().items():
        started = time.monotonic()
        response = httpx.post(f"{server}/v1/completions", json={
            "model": "dflash-demo", "prompt": "x", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}},
            timeout=60)
        elapsed = time.monotonic() - started
        assert elapsed < 10, (name, elapsed)
        if response.status_code != 200:  # compiled within the bounds is served; past them, a 400 naming them
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == "response_format", response.text
    runner.join(120)
    assert beside["text"] == alone


def test_a_stop_string_inside_a_forced_block_cuts_the_text(server):
    """The grammar forces "abc1" in one verify block; the stop string "c1" inside it ends the text there."""
    body = {"model": "dflash-demo", "prompt": "x = ", "max_tokens": 20, "temperature": 0, "stop": ["c1"],
            "structured_outputs": {"regex": "abc1[0-9]{3}z"}}
    for stream in (False, True):
        if not stream:
            choice = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == ("ab", "stop"), choice
            continue
        text = ""
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == "ab"


def test_a_target_without_an_end_of_text_token_refuses_constraints_with_a_400():
    import asyncio

    from gateway.schemas import ApiError
    from gateway.structured_outputs import Constraint, GrammarCompiler
    from shared.byte_tokenizer import build_byte_tokenizer

    compiler = GrammarCompiler(build_byte_tokenizer(), 258, ())
    with pytest.raises(ApiError, match="end-of-text token") as refused:
        asyncio.run(compiler.grammar(Constraint("regex", "a+", "guided_regex")))
    assert refused.value.status == 400 and refused.value.param == "guided_regex"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}


def tool_turn(client, messages, tool_choice, stream: bool, plain: bool):
    """One chat turn with the two tools: (content, [(id, name, arguments)], finish_reason)."""
    extra = {"num_speculative_tokens": 0} if plain else {}
    kwargs = dict(model="dflash-demo", messages=messages, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=80, temperature=0, extra_body=extra)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", ""])
            entry[0] = call.id or entry[0]
            entry[1] += call.function.name or ""
            entry[2] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_loop_through_the_openai_client(client, stream):
    """tool_choice "required", then a named function: a parsed call whose arguments validate against the tool's
    schema, finish_reason "tool_calls"; its result sent back as a tool message and the next turn answered;
    speculative greedy output equal to plain greedy output (num_speculative_tokens 0) at every turn."""
    messages = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        content, calls, reason = tool_turn(client, messages, choice, stream, plain=False)
        plain = tool_turn(client, messages, choice, stream, plain=True)  # call ids differ: the rest is equal
        assert [c[1:] for c in calls] == [c[1:] for c in plain[1]] and (content, reason) == (plain[0], plain[2])
        assert reason == "tool_calls" and calls and content is None, (content, calls)
        for call_id, name, arguments in calls:
            assert call_id.startswith("call_")
            schema = {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]["parameters"]
            jsonschema.validate(json.loads(arguments), schema)
        if isinstance(choice, dict):
            assert [c[1] for c in calls] == ["get_time"]
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]},
            *({"role": "tool", "tool_call_id": i, "content": '{"ok": true}'} for i, _, _ in calls)]
    content, calls, reason = tool_turn(client, messages, "none", stream, plain=False)
    assert calls == [] and reason in ("stop", "length") and content
    assert tool_turn(client, messages, "none", stream, plain=True) == (content, calls, reason)


def test_tool_fields_that_are_wrong_get_a_400(server):
    body = {"model": "dflash-demo", "messages": MESSAGES, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    body = {**body, "tool_choice": "required", "response_format": {"type": "json_object"}}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and "both constrain" in response.json()["error"]["message"]


def test_two_streamed_choices_each_end_once_with_their_call(server):
    """n 2, streamed, a forced call: each choice sends its call (its id and name once, then its arguments in pieces)
    and one finish chunk, "tool_calls" (the first choice may end while the second has not yet started: its replayed
    events end it once)."""
    body = {"model": "dflash-demo", "messages": MESSAGES, "tools": [WEATHER, CLOCK], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 80, "temperature": 1.0, "seed": 3, "n": 2, "stream": True}
    finishes, calls = {0: [], 1: []}, {0: [], 1: []}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice["finish_reason"]:
                    finishes[choice["index"]].append(choice["finish_reason"])
                calls[choice["index"]] += choice["delta"].get("tool_calls") or []
                assert not choice["delta"].get("content"), choice
    assert finishes == {0: ["tool_calls"], 1: ["tool_calls"]}, finishes
    for index in (0, 1):
        start, *pieces = calls[index]
        assert start["id"].startswith("call_") and start["function"]["arguments"] == ""
        assert all("id" not in p and "name" not in p["function"] and p["index"] == start["index"] for p in pieces)
        arguments = "".join(p["function"]["arguments"] for p in pieces)
        schema = {"get_weather": WEATHER, "get_time": CLOCK}[start["function"]["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)
