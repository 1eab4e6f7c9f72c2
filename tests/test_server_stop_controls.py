"""ignore_eos, min_tokens and stop_token_ids through a real dflash-serve (default flags, a drafter), both endpoints,
streamed and not, speculative and plain: the target's end-of-text token is set to one its greedy output emits a
few tokens in, so each control visibly changes where the output ends. Greedy outputs are compared with the engine
run in this process (plain decoding, the same stop tokens and min_tokens). Unknown fields are logged once per name."""

import json

import httpx
import pytest
from server_harness import CHAT_TEMPLATE, Server, write_server_models

from gateway.tokenization import TextCodec
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPT = "def add(a, b):"
MAX_TOKENS, EOS_AT, LEAST = 40, 6, 20


def plain(target, prompt_ids: list[int], stops: tuple[int, ...], least: int = 0, max_tokens: int = MAX_TOKENS):
    engine = SpeculativeEngine(target, None, max_requests=1, max_model_len=512)
    request = GenerationRequest(tuple(prompt_ids), max_tokens, stop_token_ids=stops, min_tokens=least)
    return engine.generate([request])[0].token_ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(server, target, codec, reference output without stops, the end-of-text id)."""
    root = tmp_path_factory.mktemp("stops")
    target_dir, draft_dir = write_server_models(root)
    target = load_target(target_dir)
    codec = TextCodec.from_folder(target_dir)
    free = plain(target, codec.encode(PROMPT), ())
    eos = next(t for i, t in enumerate(free) if i >= EOS_AT and t not in free[:i])
    (target_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": codec.tokenizer.id_to_token(eos), "chat_template": CHAT_TEMPLATE}))
    server = Server(target_dir, draft_dir, log_dir=root)
    try:
        server.wait_ready()
        yield server, target, codec, free, eos
    finally:
        assert server.stop() == 0


def ask(server, path: str, stream: bool, **body) -> tuple[list[int], str]:
    """(token ids, finish reason) of one greedy choice."""
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "stream": stream,
            **({"prompt": PROMPT} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": PROMPT}]}), **body}
    if not stream:
        response = httpx.post(server.url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]
    tokens, finish = [], None
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids") or []
                finish = choice["finish_reason"] or finish
    return tokens, finish


VARIANTS = [(path, stream, spec) for path in ("/v1/completions", "/v1/chat/completions") for stream in (False, True)
            for spec in (None, 0)]


def prompt_ids(codec: TextCodec, path: str) -> list[int]:
    if path == "/v1/completions":
        return codec.encode(PROMPT)
    return codec.encode(codec.render_chat([{"role": "user", "content": PROMPT}], 10**6))


@pytest.mark.parametrize("path,stream,spec", VARIANTS)
def test_each_control_moves_the_end_as_plain_decoding_does(setup, path, stream, spec):
    server, target, codec, _, eos = setup
    ids = prompt_ids(codec, path)
    extra = {} if spec is None else {"num_speculative_tokens": spec}
    # the end-of-text token ends the output where plain decoding meets it
    tokens, finish = ask(server, path, stream, **extra)
    want = plain(target, ids, (eos,))
    server.assert_same_or_near_tie(codec.tokenizer.decode(ids), tokens, want)
    # ignore_eos: generated to max_tokens, through the end-of-text token
    tokens, finish = ask(server, path, stream, ignore_eos=True, **extra)
    assert len(tokens) == MAX_TOKENS and finish == "length"
    server.assert_same_or_near_tie(codec.tokenizer.decode(ids), tokens, plain(target, ids, ()))
    # min_tokens: the end-of-text token is held back until then; the output equals plain decoding with it masked
    tokens, finish = ask(server, path, stream, min_tokens=LEAST, **extra)
    assert eos not in tokens[:LEAST] and len(tokens) > LEAST
    server.assert_same_or_near_tie(codec.tokenizer.decode(ids), tokens, plain(target, ids, (eos,), LEAST))
    # stop_token_ids beside ignore_eos: the first of them ends the output, the token kept
    free = plain(target, ids, ())
    stop = free[3]
    tokens, finish = ask(server, path, stream, ignore_eos=True, stop_token_ids=[stop], **extra)
    assert finish == "stop" and tokens == free[: free.index(stop) + 1]


def test_the_issue_case_ignore_eos_gives_the_length_asked(setup):
    """The end-of-text token comes EOS_AT tokens in; a harness asking for 300 tokens with ignore_eos gets 300."""
    server, _, _, free, eos = setup
    short, finish = ask(server, "/v1/completions", False, max_tokens=300)
    assert finish == "stop" and short[-1] == eos and len(short) == free.index(eos) + 1 <= EOS_AT + 1 + 30
    full, finish = ask(server, "/v1/completions", False, max_tokens=300, ignore_eos=True)
    assert len(full) == 300 and finish == "length"


@pytest.mark.parametrize("body,param", [
    ({"min_tokens": 41}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [258]}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_values_are_400s_naming_the_field(setup, body, param):
    server = setup[0]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, **body},
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_unknown_fields_are_logged_once_per_name(setup):
    server = setup[0]
    for _ in range(3):
        for name in ("best_effort_flag", "another_unknown"):
            body = {"prompt": PROMPT, "max_tokens": 2, name: 1}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    log = server.stderr_path.read_text()
    for name in ("best_effort_flag", "another_unknown"):
        assert log.count(f"request field '{name}' is not supported and is ignored") == 1


def test_stop_strings_act_only_past_min_tokens(setup):
    server, _, codec, free, _ = setup
    early = codec.tokenizer.decode(free[: LEAST // 2])
    stop = next(c for c in early[1:] if c != "\ufffd")  # a character of the text of the first tokens
    cut, finish = ask(server, "/v1/completions", False, ignore_eos=True, stop=[stop])
    assert finish == "stop" and len(cut) < LEAST
    held, _ = ask(server, "/v1/completions", False, ignore_eos=True, stop=[stop], min_tokens=LEAST)
    assert len(held) >= LEAST and held[:LEAST] == free[:LEAST]
