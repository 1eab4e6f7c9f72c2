"""Anthropic's Messages API through dflash-serve (the demo pair, default flags, an API key) and the official
anthropic client: a message and its stream (the same greedy text, Anthropic's event sequence), a tool_use round
trip with tool_choice any, count_tokens, a request shaped as Claude Code sends it (system blocks and tools with
cache_control, thinking blocks with signatures, metadata) answered; an image refused and a wrong key answered in
Anthropic's error shape."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from server_harness import demo_server

KEY = "sk-test-key"
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with demo_server(tmp_path_factory.mktemp("anthropic") / "serve.log", "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def test_a_message_and_its_stream(client):
    ask = dict(model="dflash-demo", max_tokens=24, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": "Write a Python function."}])
    message = client.messages.create(**ask)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    count = client.messages.count_tokens(model="dflash-demo", messages=ask["messages"])
    assert count.input_tokens == message.usage.input_tokens > 0


def test_a_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    message = client.messages.create(model="dflash-demo", max_tokens=60, extra_body={"temperature": 0},
                                     messages=messages, tools=[WEATHER],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use", message
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    answer = client.messages.create(model="dflash-demo", max_tokens=16, extra_body={"temperature": 0},
                                    messages=messages, tools=[WEATHER], tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_a_claude_code_shaped_request_is_answered(server):
    body = {
        "model": "dflash-demo", "max_tokens": 8, "stream": False, "metadata": {"user_id": "u-1"},
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet", "signature": "EqQBCkYI..."},
                                              {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "Fix the bug."}],
    }
    response = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": KEY,
                                                                       "anthropic-version": "2023-06-01"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


def test_errors_come_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model="dflash-demo", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="dflash-demo", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "image blocks are not supported" in caught.value.message
    response = httpx.post(f"{server}/v1/messages", json={"model": "dflash-demo", "messages": []},
                          headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert json.loads(response.text)["type"] == "error"


def test_a_stop_sequence_is_named(client):
    ask = dict(model="dflash-demo", max_tokens=40, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": "Write a Python function."}])
    text = "".join(b.text for b in client.messages.create(**ask).content if b.type == "text")
    stop = text[len(text) // 2: len(text) // 2 + 2]
    message = client.messages.create(stop_sequences=[stop], **ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop), message
    with client.messages.stream(stop_sequences=[stop], **ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
