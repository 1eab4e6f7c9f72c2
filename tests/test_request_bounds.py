"""What one request may cost the gateway (gateway/request_bounds.py, gateway/body_limit.py): the body cap, read
while the body arrives; the character bound on every text before it is tokenised, and that it is safe (no text
it refuses fits the context); the chat template's output stopped at the bound. In process, no verify worker:
every refusal here comes before one is needed. tests/test_server_poison.py sends oversized bodies to a real
server beside running streams."""

import asyncio
import json
import random
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from gateway import launcher, main
from gateway.app import GatewaySettings, create_app
from gateway.body_limit import MIB, body_bytes, default_body_bytes
from gateway.request_bounds import RequestBounds
from gateway.schemas import ApiError, GenerationParams, Prompt
from gateway.tokenization import RenderedTooLong, TextCodec
from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer
from shared.settings.options import SETTINGS_ENV, to_json

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
CONTEXT = 512
EXPANDING_TEMPLATE = "{% for m in messages %}{% for i in range(100000) %}{{ m['content'] }}{% endfor %}{% endfor %}"


def test_the_default_cap_follows_the_context_with_a_floor():
    assert default_body_bytes(1024) == 4 * MIB  # the demo's context: the floor
    assert default_body_bytes(202752) == 32 * 202752  # a GLM-5.3-Flash context: 6.2 MiB
    assert body_bytes(None, 1024) == 4 * MIB and body_bytes(0.5, 1024) == MIB // 2


@pytest.mark.parametrize("parse", [main.parse_args, launcher.parse_args])
def test_the_flag_takes_a_positive_size_and_refuses_others(parse, capsys):
    extra = ["--target", "x"] if parse is main.parse_args else []
    assert parse([*extra, "--max-body-mb", "16"]).http.max_body_mb == 16.0
    assert parse(extra).http.max_body_mb is None
    for bad in ("0", "-0.0", "-1", "inf", "nan", "lots"):
        with pytest.raises(SystemExit) as stopped:
            parse([*extra, "--max-body-mb", bad])
        assert stopped.value.code == 2 and "--max-body-mb" in capsys.readouterr().err


def test_the_launcher_hands_the_cap_to_the_gateway(tmp_path, monkeypatch):
    args = launcher.parse_args(["--target", str(tmp_path), "--no-draft", "--max-body-mb", "2.5"])
    gateway = launcher.build_children(args)["gateway"]
    assert gateway.settings.http.max_body_mb == 2.5
    monkeypatch.setenv(SETTINGS_ENV, to_json(gateway.settings))  # as the gateway process receives them
    assert main.parse_args([]).http.max_body_mb == 2.5


def test_the_longest_token_bounds_every_token_of_the_vocabulary(tmp_path):
    write_byte_tokenizer(tmp_path)
    codec = TextCodec.from_folder(tmp_path)
    assert codec.longest_token_bytes == len(END_OF_TEXT)  # the byte tokens cover one byte; the added token more
    demo = TextCodec.from_folder(DEMO_TARGET)
    every = [len(demo.token_bytes(i)) for i in range(demo.tokenizer.get_vocab_size(with_added_tokens=True))]
    assert demo.longest_token_bytes == max(every) > 1


def test_no_text_the_bound_refuses_fits_the_context():
    """The bound's promise on the demo tokenizer (byte-level BPE): tokens >= characters / longest token, for
    texts made to tokenise as tightly as it allows (its longest tokens repeated, whitespace runs, code, CJK)."""
    codec = TextCodec.from_folder(DEMO_TARGET)
    longest = codec.longest_token_bytes
    vocabulary = codec.tokenizer.get_vocab_size(with_added_tokens=True)
    by_length = sorted(range(vocabulary), key=lambda i: -len(codec.token_bytes(i)))
    rng = random.Random(0)
    texts = [codec.tokenizer.decode([i] * 50, skip_special_tokens=False) for i in by_length[:40]]
    texts += [" " * 5000, "\n" * 3000, "    " * 800 + "return x\n", "def f(x):\n    return x\n" * 200,
              "汉字テスト" * 300, "😀" * 400]
    texts += [codec.tokenizer.decode(rng.choices(by_length[:200], k=300), skip_special_tokens=False)
              for _ in range(30)]
    for text in texts:
        tokens = len(codec.encode(text))
        assert tokens * longest >= codec.normalized_chars(text), (text[:40], tokens)


def test_a_normalizer_is_applied_before_the_count():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    codec = TextCodec(tokenizer, "", (), None, None)
    composed = "e\u0301" * 10  # 20 characters, 10 once composed
    assert codec.normalized_chars(composed) == 10
    bounds = RequestBounds(body_bytes=MIB, context_tokens=5, token_bytes=3, max_choices=4)  # 15 characters
    bounds.check_text(composed, codec.normalized_chars, "prompt", "the prompt")  # fits once normalised
    with pytest.raises(ApiError) as refused:
        bounds.check_text("e" * 16, codec.normalized_chars, "prompt", "the prompt")
    assert refused.value.status == 400 and "16 characters" in refused.value.message
    assert "at most 15" in refused.value.message and refused.value.code == "context_length_exceeded"


def params(**fields) -> GenerationParams:
    base = dict(model="m", stream=False, include_usage=False, max_tokens=4, temperature=0.0, top_p=1.0, top_k=0,
                seed=None, stop=[], num_speculative_tokens=None)
    return GenerationParams(**{**base, **fields})


def test_every_text_list_and_count_is_checked_before_tokenising():
    bounds = RequestBounds(body_bytes=MIB, context_tokens=8, token_bytes=2, max_choices=6)
    length = len

    def refusal(request: GenerationParams) -> ApiError:
        with pytest.raises(ApiError) as refused:
            bounds.check_params(request, length)
        return refused.value

    bounds.check_params(params(prompts=[Prompt("x" * 16), Prompt(None, list(range(8)))], n=3, stop=["y" * 16]),
                        length)
    assert refusal(params(prompts=[Prompt("x" * 17)])).param == "prompt"
    assert "prompt 1 has 17" in refusal(params(prompts=[Prompt("x"), Prompt("x" * 17)])).message
    assert "9 tokens" in refusal(params(prompts=[Prompt(None, list(range(9)))])).message
    assert refusal(params(prompts=[Prompt("x")], stop=["y" * 17])).param == "stop"
    assert "7 choices" in refusal(params(prompts=[Prompt("x")], n=7)).message
    assert "8 choices" in refusal(params(prompts=[Prompt("x")] * 4, n=2)).message
    chat = refusal(params(messages=[{"role": "user", "content": "x"}, {"role": "user", "content": "x" * 17}]))
    assert chat.param == "messages" and "messages[1].content has 17" in chat.message


def test_the_chat_template_is_stopped_at_the_bound(tmp_path):
    write_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": EXPANDING_TEMPLATE}))
    codec = TextCodec.from_folder(tmp_path)
    messages = [{"role": "user", "content": "x" * 100}]
    with pytest.raises(RenderedTooLong):
        codec.render_chat(messages, 10_000)  # the whole rendering would be 10 million characters
    assert codec.render_chat([{"role": "user", "content": "ab"}], 200_000) == "ab" * 100_000


@pytest.fixture
def client(tmp_path):
    write_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": EXPANDING_TEMPLATE}))
    settings = GatewaySettings("tiny", 258, CONTEXT, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", dead_after_s=600,
                               max_body_bytes=100_000)
    application = create_app(settings, TextCodec.from_folder(tmp_path))
    yield TestClient(application)  # no `with`: the lifespan (the verify channel) is not run
    asyncio.run(application.state.client.close())


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_over_the_cap_is_a_413_naming_the_limit(client, path):
    body = json.dumps({"prompt": "x" * 200_000, "messages": [{"role": "user", "content": "x"}]}).encode()
    declared = error_of(client.post(path, content=body, headers={"content-type": "application/json"}), 413)
    assert declared["code"] == "request_too_large" and "100000 bytes" in declared["message"]
    assert f"has {len(body)} bytes" in declared["message"] and "--max-body-mb" in declared["message"]
    chunked = error_of(client.post(path, content=iter([body[:60_000], body[60_000:]]),
                                   headers={"content-type": "application/json"}), 413)
    assert "passes this server's limit of 100000 bytes" in chunked["message"]


def test_texts_past_the_bound_are_400s_before_tokenising(client):
    chars = CONTEXT * len(END_OF_TEXT)  # the byte tokenizer's longest token: 13 bytes
    prompt = error_of(client.post("/v1/completions", json={"prompt": "x" * (chars + 1)}), 400)
    assert prompt["param"] == "prompt" and f"holds at most {chars}" in prompt["message"]
    ids = error_of(client.post("/v1/completions", json={"prompt": [1] * (CONTEXT + 1)}), 400)
    assert ids["code"] == "context_length_exceeded" and f"{CONTEXT + 1} tokens" in ids["message"]
    batch = error_of(client.post("/v1/completions", json={"prompt": ["x"] * 65}), 400)
    assert batch["param"] == "prompt" and "batch of 65 prompts" in batch["message"]
    many = error_of(client.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": ""}] * (CONTEXT + 1)}), 400)
    assert many["param"] == "messages" and f"at most {CONTEXT}" in many["message"]
    expanded = error_of(client.post("/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "x"}]}), 400)
    assert expanded["code"] == "context_length_exceeded" and "chat template" in expanded["message"]
