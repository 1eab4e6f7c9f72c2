"""No request may take another down, with the default flags: edge values of every numeric field and a
property-based fuzz of request bodies, each while greedy streams run beside them; the streams must complete
token-identical to the same requests served alone, and the server must stay ready."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from request_fuzz import fuzz
from server_harness import Server, write_server_models

VICTIMS = ["def add(a, b):", "import os\n", "class A:", "for x in y:"]
INTEGERS = {"2**63": 2**63, "2**64": 2**64, "10**30": 10**30, "-2**63": -2**63}
FLOATS = {"1e308": 1e308, "5e-324": 5e-324, "-0.0": -0.0}
# Values in range for their meaning are served: seed takes all of int64; a temperature below 1e-5 (5e-324, -0.0)
# is greedy; top_p 5e-324 keeps the most likely token alone.
SERVED = {("seed", "-2**63"), ("temperature", "5e-324"), ("temperature", "-0.0"), ("top_p", "5e-324")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("poison")
    target, draft = write_server_models(root)
    (target / "tokenizer_config.json").write_text("{}")  # no end-of-text token: victims run to max_tokens
    server = Server(target, draft, log_dir=root)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0


def complete(url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def stream(url: str, prompt: str, max_tokens: int, started: threading.Event) -> tuple[list[int], dict | None]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    tokens, error = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                error = chunk.get("error", error)
                if chunk.get("choices"):
                    tokens += chunk["choices"][0].get("token_ids", [])
                    started.set()
    return tokens, error


def beside_victims(server: Server, max_tokens: int, work) -> int:
    """Runs work() while the victims stream, each again and again until work() returns; every victim stream
    must end complete and as when served alone. Returns the number of victim streams."""
    alone = {p: complete(server.url, p, max_tokens).json()["choices"][0]["token_ids"] for p in VICTIMS}
    started = [threading.Event() for _ in VICTIMS]
    done = threading.Event()

    def victim(prompt: str, first: threading.Event) -> list:
        results = [stream(server.url, prompt, max_tokens, first)]
        while not done.is_set():
            results.append(stream(server.url, prompt, max_tokens, threading.Event()))
        return results

    with ThreadPoolExecutor(len(VICTIMS)) as pool:
        futures = [pool.submit(victim, p, e) for p, e in zip(VICTIMS, started)]
        assert all(e.wait(60) for e in started)
        try:
            work()
        finally:
            done.set()
        results = [f.result(timeout=300) for f in futures]
    for prompt, runs in zip(VICTIMS, results):
        for tokens, error in runs:
            assert error is None and len(tokens) == max_tokens
            server.assert_same_or_near_tie(prompt, tokens, alone[prompt])
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    return sum(len(runs) for runs in results)


def test_edge_values_beside_running_streams(server):
    cases = [(f, name, v) for f in ("top_k", "seed", "num_speculative_tokens", "n", "logprobs", "max_tokens")
             for name, v in INTEGERS.items()]
    cases += [(f, name, v) for f in ("temperature", "top_p") for name, v in FLOATS.items()]
    answers = {}

    def poison():
        for field, name, value in cases:
            for stream_it in (False, True):
                body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 1.0, "stream": stream_it,
                        field: value}
                response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
                answers[field, name, stream_it] = response

    beside_victims(server, 120, poison)
    greedy = complete(server.url, "x", 4).json()["choices"][0]["token_ids"]
    for (field, name, streamed), response in answers.items():
        if (field, name) not in SERVED:
            assert 400 <= response.status_code < 500, (field, name, streamed, response.text)
            error = response.json()["error"]
            assert error["param"] == field and field in error["message"], error
        else:
            assert response.status_code == 200, (field, name, streamed, response.text)
    served = complete(server.url, "x", 4, temperature=5e-324).json()["choices"][0]["token_ids"]
    assert served == greedy  # a temperature below 1e-5 is greedy


def test_fuzzed_bodies_beside_running_streams(server):
    """Hypothesis draws bodies from the gateway's field table (in range, at and past the bounds, int64 and float
    edges, wrong types, broken JSON); about a minute here. benchmarks/fault_drill.py fuzz runs thousands."""
    outcome = {}
    victims = beside_victims(server, 120, lambda: outcome.update(fuzz(server.url, "tiny", 700)))
    print(f"fuzz: {outcome['sent']} bodies, status codes {dict(sorted(outcome['codes'].items()))}; "
          f"{victims} victim streams beside them, all complete and identical")
    assert outcome["sent"] >= 700 and outcome["server_errors"] == 0 and outcome["connection_errors"] == 0
    assert outcome["codes"].get(200, 0) > 20  # valid bodies were served too, not only refused
