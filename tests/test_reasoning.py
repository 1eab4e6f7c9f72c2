"""A thinking answer split into reasoning_content and content (gateway/reasoning.py, gateway/responses.ChatReader):
with the opening tag written by the model or left open by the template (GLM-5.3 always thinks, whatever
enable_thinking says), an answer that ends without </think>, a section the template closed (enable_thinking false),
a <tool_call> written inside the thinking kept as reasoning, each fed 1, 3 and 8 tokens at a time: no part of a tag
ever reaches either field."""

import json

import pytest
from test_tool_calls import pieces

from gateway.reasoning import ReasoningSplit, opens_thinking, reasoning_parser_on, split_whole
from gateway.responses import ChatReader
from gateway.schemas import GenerationParams
from gateway.tool_calls import GlmFormat, tool_request



CASES = [  # (the prompt left <think> open, the answer, reasoning, content)
    (False, "<think>plan a, then b</think>\nThe answer.", "plan a, then b", "The answer."),
    (True, "plan a, then b</think>The answer.", "plan a, then b", "The answer."),
    (True, "plan a, then b and no end", "plan a, then b and no end", ""),
    (False, "The answer, no thinking.", "", "The answer, no thinking."),
    (False, "  <think>x</think>y", "x", "y"),
]


@pytest.mark.parametrize("tokens_a_step", [1, 3, 8])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_reasoning_and_content_are_split_whatever_a_step_delivers(case, tokens_a_step):
    thinking, answer, want_reasoning, want_content = CASES[case]
    split, reasoning, content = ReasoningSplit(thinking=thinking), "", ""
    for piece in pieces(answer, tokens_a_step):
        r, c = split.feed(piece)
        assert "<" not in r + c or "<" in want_reasoning + want_content, (r, c)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    assert (reasoning + r, content + c) == (want_reasoning, want_content)
    assert split_whole(answer, thinking) == (want_reasoning, want_content)


def test_the_template_decides_whether_thinking_is_open():
    assert opens_thinking("<|user|>hi<|assistant|><think>") and not opens_thinking("<|assistant|><think></think>")
    assert not opens_thinking("<|assistant|>") and opens_thinking("<think>a</think>...<|assistant|>\n<think>\n")
    assert reasoning_parser_on("auto", "{{ '<think>' }}") and not reasoning_parser_on("auto", "{{ m }}")
    assert not reasoning_parser_on("none", "<think>") and reasoning_parser_on("think", "")


def test_a_tool_call_inside_the_thinking_stays_reasoning_and_the_one_after_is_a_call():
    tools = tool_request({"tools": [{"type": "function", "function": {"name": "f"}}]})
    params = GenerationParams(model="m", stream=True, include_usage=False, max_tokens=9, temperature=0, top_p=1,
                              top_k=0, seed=None, stop=[], num_speculative_tokens=None, tools=tools, thinking=True)
    turn = type("T", (), {"params": params})()
    answer = ("maybe <tool_call>f</tool_call> first</think>Calling.<tool_call>f<arg_key>a</arg_key><arg_value>1"
              "</arg_value></tool_call>")
    for tokens_a_step in (1, 3, 8):
        reader = ChatReader(turn, GlmFormat(spaced=False))
        deltas = []
        chunks = pieces(answer, tokens_a_step)
        for i, piece in enumerate(chunks):
            deltas += reader.feed(piece, final=i == len(chunks) - 1)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "maybe <tool_call>f</tool_call> first"
        assert "".join(d.get("content", "") for d in deltas) == "Calling."
        calls = [c for d in deltas for c in d.get("tool_calls", [])]  # a call's start, then its arguments' pieces
        assert [c["function"]["name"] for c in calls if "id" in c] == ["f"]
        assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"a": 1}
        assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
