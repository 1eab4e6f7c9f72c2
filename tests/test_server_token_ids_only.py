"""A target folder without tokenizer.json, served as users run it (dflash-serve, default flags): token-id prompts
only. Text prompts, chat and stop strings get a 400 naming the reason; outputs carry token ids (their text is
empty), equal to plain decoding of the same prompt, streamed and not."""

import json
import shutil

import httpx
import pytest
from greedy_check import assert_same_or_near_tie
from server_harness import Server, write_server_models

from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPT = [72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def ids_only(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids_only")
    target, draft = write_server_models(root)
    bare = root / "bare"
    shutil.copytree(target, bare)
    (bare / "tokenizer.json").unlink()
    server = Server(bare, draft, log_dir=root)
    server.wait_ready()
    yield server
    assert server.stop() == 0
    assert "serving token-id prompts only" in server.stderr_path.read_text()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["\n"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_what_needs_text_gets_a_400_naming_the_reason(ids_only, path, body, param):
    response = post(ids_only, path, {**body, "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "no tokenizer.json" in error["message"]


def test_token_id_prompts_are_served_and_equal_plain_decoding(ids_only):
    target = load_target(ids_only.target)
    want = SpeculativeEngine(target, None, max_requests=1).generate(
        [GenerationRequest(tuple(PROMPT), 16, stop_token_ids=())])[0].token_ids
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = post(ids_only, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 16
    assert_same_or_near_tie(target, PROMPT, choice["token_ids"], want)
    streamed = []
    with httpx.stream("POST", f"{ids_only.url}/v1/completions", json={**body, "model": "tiny", "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for chunk_choice in json.loads(line[6:])["choices"]:
                    assert chunk_choice["text"] == ""
                    streamed += chunk_choice.get("token_ids") or []
    assert streamed == choice["token_ids"]
    scored = post(ids_only, "/v1/completions", {**body, "max_tokens": 3, "logprobs": 2}).json()["choices"][0]
    assert scored["logprobs"]["tokens"] == [f"token_id:{t}" for t in scored["token_ids"]]
