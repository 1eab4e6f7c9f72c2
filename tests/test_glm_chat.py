"""The agents' API on tiny GLM-5.3 (DFlash 2 drafter) and GLM-5.2 (DFlash drafter) checkpoints in GLM's chat
format (tests/glm_chat.py), served by dflash-serve with its default flags (the GLM call parser and the thinking
split chosen from the template) and read with the official openai client: a forced tool loop (required, then a
named function, then the tool results and an answer), streamed and not, speculative output equal to plain at every
turn; reasoning_content and content split where GLM-5.3's template opens <think> whatever enable_thinking says, and
content alone where GLM-5.2's closes the section for enable_thinking false."""

import json

import jsonschema
import openai
import pytest
from glm_chat import write_glm5_chat_pair, write_glm52_chat_pair
from server_harness import Server

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}


def serve(root, write_pair):
    target, draft = write_pair(root)
    server = Server(target, draft, log_dir=root)
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """GLM-5.3's."""
    yield from serve(tmp_path_factory.mktemp("glm_chat"), write_glm5_chat_pair)


@pytest.fixture(scope="module")
def glm52_client(tmp_path_factory):
    yield from serve(tmp_path_factory.mktemp("glm52_chat"), write_glm52_chat_pair)


def turn(client, messages, tool_choice, stream: bool, plain: bool, **extra):
    """(reasoning, content, [(name, arguments)], finish_reason) of one greedy turn with the two tools."""
    kwargs = dict(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                  tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=48, temperature=0,
                  extra_body={**({"num_speculative_tokens": 0} if plain else {}), **extra})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return (getattr(choice.message, "reasoning_content", None), choice.message.content, calls,
                choice.finish_reason)
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return reasoning or None, content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("served", ["client", "glm52_client"], ids=["glm5.3", "glm5.2"])
def test_a_forced_tool_loop_in_glm_format_speculative_equals_plain(served, request):
    """Whole answers for the required call, streamed ones for the named call and the last turn."""
    client = request.getfixturevalue(served)
    messages = [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
    for choice, stream in (("required", False), ({"type": "function", "function": {"name": "get_time"}}, True)):
        got = turn(client, messages, choice, stream, plain=False)
        assert got == turn(client, messages, choice, stream, plain=True)
        reasoning, content, calls, reason = got
        assert reason == "tool_calls" and len(calls) == 1 and reasoning is None, got
        name, arguments = calls[0]
        jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]
                            ["parameters"])
        if isinstance(choice, dict):
            assert name == "get_time"
        messages = messages + [
            {"role": "assistant", "content": content, "tool_calls": [
                {"id": f"call_{len(messages)}", "type": "function",
                 "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": f"call_{len(messages)}", "content": '{"ok": true}'}]
    answer = turn(client, messages, "auto", stream, plain=False, chat_template_kwargs={"enable_thinking": False})
    assert answer == turn(client, messages, "auto", stream, plain=True, chat_template_kwargs={"enable_thinking": False})
    reasoning, content, calls, reason = answer
    if served == "client":  # enable_thinking false, yet GLM-5.3's template opened <think>:
        assert reasoning and "</think>" not in reasoning, answer  # the answer is reasoning up to its </think>
    else:  # GLM-5.2's template closed the section: the answer is content (the tiny model writes no <think>)
        assert reasoning is None and content and "<think>" not in content, answer


def test_a_thinking_budget_closes_the_section_at_its_position(client):
    """thinking_token_budget 0 and 5: </think> is the first token, and at the latest the sixth, speculative as
    plain; the thinking before it is reasoning_content."""
    import httpx

    from glm_chat import ROLES

    close = 258 + len(ROLES) + 1  # </think>: the second tag after the role tokens
    for budget in (0, 5):
        answers = []
        for plain in (False, True):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Think briefly."}], "max_tokens": 12,
                    "temperature": 0, "thinking_token_budget": budget, "return_token_ids": True,
                    **({"num_speculative_tokens": 0} if plain else {})}
            response = httpx.post(f"{client.base_url}chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0])
        assert answers[0]["token_ids"] == answers[1]["token_ids"]
        ids = answers[0]["token_ids"]
        assert close in ids and ids.index(close) <= budget and (budget or ids[0] == close), ids
        assert (answers[0]["message"].get("reasoning_content") is None) == (ids.index(close) == 0)
