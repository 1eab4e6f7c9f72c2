"""/tokenize and /detokenize answer in vLLM's shapes (count, max_model_len, tokens, token_strs; prompt): a prompt's
ids are the ids a completion sends, chat messages (with tools) go through the chat template as a chat completion's
do, the ids decode back to the text; bad bodies get a 400 naming the field, an unknown model a 404, and the API key
guards both."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewaySettings, create_app
from gateway.tokenization import TextCodec
from shared.demo_models import DEMO_DIR

TARGET = DEMO_DIR / "target"
MODEL, VOCAB, CONTEXT = "dflash-demo", 4096, 1024


@pytest.fixture(scope="module")
def client():
    settings = GatewaySettings(MODEL, VOCAB, CONTEXT, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", api_key="k",
                               dead_after_s=600)
    app = create_app(settings, TextCodec.from_folder(TARGET))
    yield TestClient(app, headers={"authorization": "Bearer k"})  # no `with`: the verify channel is not started
    asyncio.run(app.state.client.close())


def test_a_prompt_and_messages_tokenize_as_requests_would(client):
    codec = TextCodec.from_folder(TARGET)
    answer = client.post("/tokenize", json={"model": MODEL, "prompt": "def f(x):", "return_token_strs": True}).json()
    assert answer["tokens"] == codec.encode("def f(x):") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == CONTEXT and len(answer["token_strs"]) == answer["count"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": answer["tokens"]}).json() == {
        "prompt": "def f(x):"}
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = client.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    assert chat["tokens"] == codec.encode(codec.render_chat(messages, 10**6, tools=tools))
    assert chat["token_strs"] is None
    bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert codec.decode(bare["tokens"]) == codec.decode(codec.encode("<|user|>\nhi\n"))


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x" * 10**6}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
])
def test_bad_bodies_name_the_field(client, path, body, status, param):
    response = client.post(path, json=body)
    assert response.status_code == status and response.json()["error"]["param"] == param, response.text


def test_the_api_key_guards_them(client):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        response = client.post(path, content=json.dumps(body), headers={"authorization": "Bearer wrong"})
        assert response.status_code == 401
