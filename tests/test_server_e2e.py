"""End to end through real processes on loopback: the OpenAI API, SSE, concurrency, metrics, bad input."""

import asyncio
import json

import httpx
import openai
import pytest
import torch
from server_harness import metric_value, serving

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The served product with every cuda_ext host build switched in (DFLASH_KERNELS=host: verification, the
    drafter's block attention, the walk), so these tests run the kernels' code through real processes; the other
    server tests run the defaults."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_KERNELS", "host")  # read by the child processes, which inherit it at start
        servers = serving(tmp_path_factory.mktemp("serve"), "--max-running", "16")
        server = next(servers)
    yield server
    next(servers, None)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def completion(server, **body):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(server, path, body):
    """Raw SSE: every event is one 'data: ' line; returns the parsed JSON chunks and whether [DONE] ended it."""
    chunks, done = [], False
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            assert not done, "data after [DONE]"
            if data == "[DONE]":
                done = True
            else:
                chunks.append(json.loads(data))
    return chunks, done


def test_models_health_ready(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert server.wait_ready()["drafter"] == "available"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["drafter"] == {"kind": "dflash", "available": True, "license": None}


def test_completion_through_openai_client_with_usage(server, client):
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    usage = result.usage
    assert usage.prompt_tokens == len(PROMPT.encode()) and 1 <= usage.completion_tokens <= 24
    spec = usage.model_extra["speculative"]
    assert spec["draft_tokens"] > 0 and spec["verify_steps"] >= 1
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec["accepted_tokens"]
    assert details.rejected_prediction_tokens == spec["draft_tokens"] - spec["accepted_tokens"]
    assert result.choices[0].finish_reason in ("length", "stop")


def test_streaming_equals_non_streaming_both_endpoints(server, client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == plain.choices[0].text
    assert usage.completion_tokens == plain.usage.completion_tokens
    messages = [{"role": "user", "content": "write a loop"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content and chat.choices[0].message.role == "assistant"


def test_raw_sse_format(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    chunks, done = sse_events(server, "/v1/completions", body)
    assert done
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert tokens == completion(server, max_tokens=16)["choices"][0]["token_ids"]
    chat_chunks, done = sse_events(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True})
    assert done and chat_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chat_chunks)


def test_stop_strings_cut_the_text(server):
    full = completion(server, max_tokens=40)["choices"][0]["text"]
    start = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i: i + 2])
    stop = full[start: start + 2]  # random models emit broken UTF-8; take a clean piece of the text
    cut = completion(server, max_tokens=40, stop=[stop])
    assert cut["choices"][0]["text"] == full[: full.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"


def test_sixteen_concurrent_streams_equal_requests_served_alone(server):
    prompts = [f"x = {i} * {i + 1}  # " + "ab" * (i % 5) for i in range(16)]
    alone = [completion(server, prompt=p, max_tokens=40)["choices"][0]["token_ids"] for p in prompts]

    async def one(client, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True,
                "return_token_ids": True}
        tokens = []
        async with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    tokens += chunk["choices"][0].get("token_ids", []) if chunk["choices"] else []
        return tokens

    async def run_all():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    together = asyncio.run(run_all())
    for prompt, got, want in zip(prompts, together, alone):
        server.assert_same_or_near_tie(prompt, got, want)  # batching must not change greedy output


def test_metrics_parse_and_speculative_counters_move(server):
    before = server.metrics("verify")
    answer = completion(server, max_tokens=20, num_speculative_tokens=3, return_meta_info=True)
    usage = answer["usage"]["speculative"]  # verified drafts
    after = server.metrics("verify")
    meta = answer["choices"][0]["meta_info"]  # the same counts in SGLang's per-choice form, asked for
    tokens = len(answer["choices"][0]["token_ids"])
    assert meta == {"completion_tokens": tokens, "spec_verify_ct": usage["verify_steps"],
                    "spec_draft_token_num": usage["draft_tokens"], "spec_accept_token_num": usage["accepted_tokens"],
                    "spec_accept_rate": round(usage["accepted_tokens"] / usage["draft_tokens"], 4),
                    "spec_accept_length": round(tokens / usage["verify_steps"], 4)}
    assert "meta_info" not in completion(server, max_tokens=2)["choices"][0]  # only when asked
    chunks, _ = sse_events(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
        "ignore_eos": True, "return_meta_info": True})
    assert [("meta_info" in c["choices"][0]) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["meta_info"]["completion_tokens"] == 8
    assert last["meta_info"]["spec_verify_ct"] > 0
    drafted = metric_value(after, "dflash_spec_draft_tokens_total") - metric_value(before, "dflash_spec_draft_tokens_total")
    accepted = metric_value(after, "dflash_spec_accepted_tokens_total") - metric_value(before, "dflash_spec_accepted_tokens_total")
    assert drafted >= usage["draft_tokens"] > 0 and accepted >= usage["accepted_tokens"]
    assert metric_value(after, "dflash_step_duration_seconds_count", {"phase": "verify"}) > 0
    assert metric_value(after, "dflash_drafter_available", {"kind": "dflash"}) == 1
    gateway = server.metrics("gateway")
    assert metric_value(gateway, "dflash_requests_total", {"outcome": "success"}) >= 1
    assert metric_value(gateway, "dflash_time_to_first_token_seconds_count") >= 1
    assert metric_value(server.metrics("draft"), "dflash_draft_calls_total") >= 1


def test_an_agents_resent_history_is_served_from_the_prefix_cache(server, client):
    """Turn 2 resends turn 1's messages, its answer and a new message: the prompt tokens turn 1 computed are
    reused (usage.prompt_tokens_details.cached_tokens, the verify worker's counters), and the answer to a resent
    prompt is the answer it had (greedy)."""
    before = server.metrics("verify")
    messages = [{"role": "user", "content": "def fib(n):"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and now in one line"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens, (first.usage, second.usage)
    assert again.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1  # all but the last
    assert again.choices[0].message.content == second.choices[0].message.content
    after = server.metrics("verify")
    hits = metric_value(after, "dflash_prefix_cache_hit_tokens_total") - \
        metric_value(before, "dflash_prefix_cache_hit_tokens_total")
    queries = metric_value(after, "dflash_prefix_cache_query_tokens_total") - \
        metric_value(before, "dflash_prefix_cache_query_tokens_total")
    assert hits >= cached + second.usage.prompt_tokens - 1 and queries >= first.usage.prompt_tokens + 2 * \
        second.usage.prompt_tokens


def test_logprobs_are_the_targets_and_stream_like_the_whole(server, client):
    body = {"max_tokens": 16, "logprobs": 2}
    whole = completion(server, **body)
    ids, logprobs = whole["choices"][0]["token_ids"], whole["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) == whole["usage"]["completion_tokens"]
    target, tokenizer = server.reference()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        cache = target.new_cache(1, len(prompt) + len(ids))
        out = target(torch.tensor([prompt + ids[:-1]]), torch.arange(len(prompt) + len(ids) - 1)[None], cache,
                     torch.tensor([0]))
        want = torch.log_softmax(target.logits(out.hidden[0, len(prompt) - 1:]), -1)  # [tokens, vocab]
    assert logprobs["token_logprobs"] == pytest.approx(want.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist(),
                                                       abs=1e-4)
    for token, chosen, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert token in top and len(top) <= 3 and top[token] == chosen
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(whole["choices"][0]["text"])
    chunks, done = sse_events(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "temperature": 0,
                                                          "stream": True, **body})
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert done and [x for p in parts for x in p["tokens"]] == logprobs["tokens"]
    assert [x for p in parts for x in p["token_logprobs"]] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    assert [x for p in parts for x in p["text_offset"]] == offsets
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert all(bytes(t.bytes).decode("utf-8", errors="replace") == t.token for t in content)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_with_or_without_a_completion(server):
    target, tokenizer = server.reference()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        out = target(torch.tensor([prompt]), torch.arange(len(prompt))[None], target.new_cache(1, len(prompt)),
                     torch.tensor([0]))
        want = torch.log_softmax(target.logits(out.hidden[0]), -1)  # [prompt, vocab]
    scored = completion(server, max_tokens=0, echo=True, logprobs=1)
    choice = scored["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and choice["token_ids"] == []
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(prompt)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        want[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=1e-4)
    tokens = logprobs["tokens"]  # an ASCII prompt: each token's text starts where the previous ones end
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    both = completion(server, max_tokens=6, echo=True, logprobs=1)
    assert both["choices"][0]["text"].startswith(PROMPT) and len(both["choices"][0]["logprobs"]["tokens"]) == \
        len(prompt) + both["usage"]["completion_tokens"]
    assert both["choices"][0]["logprobs"]["token_logprobs"][1:len(prompt)] == pytest.approx(
        logprobs["token_logprobs"][1:], abs=1e-5)
    chunks, done = sse_events(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "temperature": 0,
                                                          "max_tokens": 6, "echo": True, "logprobs": 1, "stream": True})
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert done and "".join(p["text"] for p in parts) == both["choices"][0]["text"]
    streamed = [x for p in parts if p["logprobs"] for x in p["logprobs"]["tokens"]]
    assert streamed == both["choices"][0]["logprobs"]["tokens"]
    assert [x for p in parts if p["logprobs"] for x in p["logprobs"]["text_offset"]] == \
        both["choices"][0]["logprobs"]["text_offset"]
    plain = completion(server, max_tokens=0, echo=True)
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    by_ids = completion(server, prompt=prompt, max_tokens=0, echo=True, logprobs=1)  # as evaluation harnesses ask
    again = by_ids["choices"][0]["logprobs"]  # float32: a readiness probe batched beside it may round differently
    assert by_ids["choices"][0]["text"] == PROMPT and again["tokens"] == tokens
    assert again["token_logprobs"][1:] == pytest.approx(logprobs["token_logprobs"][1:], abs=1e-5)


def test_a_batch_of_prompts_times_n_gives_every_choice_in_order(server, client):
    prompts = [PROMPT, "while True:"]
    alone = [completion(server, prompt=p, max_tokens=12)["choices"][0]["token_ids"] for p in prompts]
    succeeded = metric_value(server.metrics("gateway"), "dflash_requests_total", {"outcome": "success"})
    both = completion(server, prompt=prompts, n=2, max_tokens=12, logprobs=1)
    after = metric_value(server.metrics("gateway"), "dflash_requests_total", {"outcome": "success"})
    assert after == succeeded + 1  # one request, four choices
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    for c in both["choices"]:  # choice index = prompt index * n + j
        server.assert_same_or_near_tie(prompts[c["index"] // 2], c["token_ids"], alone[c["index"] // 2])
        assert len(c["logprobs"]["tokens"]) == len(c["token_ids"])
    usage = both["usage"]
    assert usage["prompt_tokens"] == sum(len(p.encode()) for p in prompts)  # each prompt counted once
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in both["choices"])
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 5,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    chunks, done = sse_events(server, "/v1/completions", body)
    streamed = {i: [t for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                    for t in c["choices"][0]["token_ids"]] for i in range(3)}
    finals = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert done and sorted(finals) == [0, 1, 2] and chunks[-1]["usage"]["completion_tokens"] == \
        sum(len(t) for t in streamed.values())
    assert len({tuple(t) for t in streamed.values()}) > 1  # sampled choices with seeds seed + index differ
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.finish_reason for c in chat.choices)


def test_neutral_values_of_unsupported_parameters_are_accepted(server):
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1, "echo": None,
               "logprobs": None, "suffix": "", "stream": None}
    assert completion(server, max_tokens=2, **neutral)["usage"]["completion_tokens"] == 2
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": None,
            "top_logprobs": None, "echo": False, "tools": [], "tool_choice": "auto",
            "response_format": {"type": "text"}, "user": "someone"}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["logprobs"] is None


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 65}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x", [1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["x"] * 9, "n": 9}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [1, 2]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "num_speculative_tokens": -1}, 400, "num_speculative_tokens"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True},
     400, "echo"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": 3},
     400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, "guided_regex"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_openai_error_bodies(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_speculation_knob_zero_is_plain_decoding(server):
    spec = completion(server, max_tokens=20)
    plain = completion(server, max_tokens=20, num_speculative_tokens=0)
    server.assert_same_or_near_tie(PROMPT, spec["choices"][0]["token_ids"], plain["choices"][0]["token_ids"])
    assert plain["usage"]["speculative"]["draft_tokens"] == 0
    assert plain["usage"]["speculative"]["acceptance_length"] == 1.0


def test_choice_seeds_stay_in_64_bits():
    from gateway.schemas import choice_seed

    assert choice_seed(None, 3, 4) is None and choice_seed(7, 0, 1) == 7
    assert [choice_seed(7, i, 3) for i in range(3)] == [7, 8, 9]
    assert choice_seed(2**63 - 1, 1, 2) == -2**63  # wrapped, still a valid int64 for the wire
