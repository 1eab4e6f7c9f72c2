"""dflash-serve --tp 2 on CPU (gloo): the whole server gives the greedy tokens the model gives decoding alone (and
so does the torch.distributed feature pair in place of ZeroMQ frames), and a rank that dies or hangs fails the
open streams, turns /ready and new requests into 503 and stops the service."""

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from greedy_check import assert_same_or_near_tie, plain_greedy
from server_harness import Server, metric_value, write_server_models
from test_server_faults import completion_tokens, stream_tokens
from tokenizers import Tokenizer

from llguidance import LLMatcher

from shared.byte_tokenizer import END_OF_TEXT
from shared.generation_request import GenerationRequest
from shared.grammar import folder_vocabulary
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPTS = ["def add(a, b):", "while True:", "x = [i for i in", "import os\n"]
MAX_TOKENS = 40
CONSTRAINT = "(ab|cd)[0-9]{2,6}x+y"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # a bfloat16 checkpoint: served on a row-invariant path (the C++ kernels, or batch-invariant bfloat16), so a
    # request batched with others commits the tokens it commits alone, bit for bit. A float32 checkpoint that is not
    # bfloat16-exact runs PyTorch's GEMMs, whose rounding depends on the batch: near-ties flipped between the
    # streamed (batched) and the whole (alone) answer once (a fresh-clone suite run, 2026-12-03)
    root = tmp_path_factory.mktemp("tp_models")
    return (*write_server_models(root, dtype=torch.bfloat16), root)


def served_tokens(server: Server) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: batched verify steps across the ranks
        streamed = list(pool.map(lambda p: stream_tokens(server.url, p, MAX_TOKENS), PROMPTS))
    tokens = []
    for prompt, (stream, error, done) in zip(PROMPTS, streamed):
        assert error is None and done
        whole = completion_tokens(server.url, prompt, MAX_TOKENS)["choices"][0]["token_ids"]
        assert whole == stream  # streaming and not streaming agree
        tokens.append(stream)
    return tokens


def test_tp2_and_the_feature_pair_serve_the_same_greedy_tokens_as_tp1(models):
    """Served at TP 2 (ZeroMQ frames, then the torch.distributed pair), batched and speculative, against the whole
    model's own greedy decoding in this process (TP 1's answer: test_server_e2e serves TP 1 the same way)."""
    target, draft, root = models
    results = {}
    setups = {"tp2": ("--tp", "2"), "tp2+pair": ("--tp", "2", "--feature-transport", "pair")}
    for name, flags in setups.items():
        server = Server(target, draft, *flags, log_dir=root)
        try:
            server.wait_ready()
            results[name] = served_tokens(server)
            if name == "tp2":  # a constrained request: the leader masks the logits it verifies
                results["constrained"] = constrained_tokens(server)
            verify = server.metrics("verify")
            assert metric_value(verify, "dflash_spec_draft_tokens_total") > 0  # drafts came back
            assert metric_value(verify, "dflash_spec_fallback_steps_total") == 0  # every draft call answered
        finally:
            assert server.stop() == 0
    whole = load_target(target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    stop = (tokenizer.token_to_id(END_OF_TEXT),)
    for index, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        want = plain_greedy(whole, ids, MAX_TOKENS, stop)
        for name in setups:
            assert_same_or_near_tie(whole, ids, results[name][index], want)
    vocabulary = folder_vocabulary(target, whole.config.vocab_size, stop)
    request = GenerationRequest(tuple(tokenizer.encode(PROMPTS[0], add_special_tokens=False).ids), MAX_TOKENS,
                                stop_token_ids=stop, grammar=LLMatcher.grammar_from_regex(CONSTRAINT))
    alone = SpeculativeEngine(whole, None, max_model_len=512, grammar_vocabulary=vocabulary).generate([request])[0]
    assert results["constrained"] == alone.token_ids


def constrained_tokens(server: Server) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "guided_regex": CONSTRAINT}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert re.fullmatch(CONSTRAINT, choice["text"]), choice
    return choice["token_ids"]


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_rank_fails_fast_and_visibly(models, fault):
    target, draft, root = models
    server = Server(target, draft, "--tp", "2", "--tp-timeout", "4", log_dir=root)
    rank1 = None
    try:
        server.wait_ready()
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream_tokens, server.url, "while True:", 480, started)
            assert started.wait(60), "no token in 60 s"
            rank1 = server.child_pid("verify", rank=1)
            began = time.monotonic()
            os.kill(rank1, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            tokens, error, done = future.result(timeout=30)
        assert error is not None and done and time.monotonic() - began < 15
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 503
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert response.status_code == 503
        assert server.process.wait(30) != 0
        assert "tensor-parallel" in server.stderr_path.read_text()
    finally:
        if rank1 is not None and fault == "hung":
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop()
