"""Faults with real processes: a killed drafter, a killed verify worker, a client that goes away, a full
queue, bad wire messages, and the API key."""

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
import zmq
from processes import process_alive
from server_harness import Server, metric_value, write_server_models

from shared.wire import SCHEMA_VERSION


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_models")
    return (*write_server_models(root), root)


def stream_tokens(url, prompt, max_tokens, started: threading.Event | None = None, timeout=120, times=None,
                  **extra):
    """Greedy stream; returns (token ids, the error body if the stream ended with one, saw [DONE]). With a
    list `times`, the arrival time of every chunk that carried tokens is appended to it; extra: more body fields."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, **extra}
    tokens, error, done = [], None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk["choices"]:
                new = chunk["choices"][0].get("token_ids", [])
                tokens += new
                if times is not None and new:
                    times.append(time.monotonic())
                if started is not None and tokens:
                    started.set()
    return tokens, error, done


def longest_gap(times: list[float], since: float) -> float:
    """The longest wait between two token chunks of a stream, counting from `since` (the fault)."""
    after = [since] + [t for t in times if t > since]
    return max(b - a for a, b in zip(after, after[1:])) if len(after) > 1 else float("inf")


def completion_tokens(url, prompt, max_tokens, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def default_server(models):
    """dflash-serve with its default flags (only ports and threads set by the harness), and the greedy output of
    each of 16 prompts served alone, 400 tokens each."""
    target, draft, root = models
    server = Server(target, draft, log_dir=root)
    try:
        server.wait_ready()
        prompts = [f"for i in range({i}):" for i in range(16)]
        alone = {p: completion_tokens(server.url, p, 400)["choices"][0]["token_ids"] for p in prompts}
        yield server, alone
    finally:
        assert server.stop() == 0


def streams_through(server, alone: dict, fault, label: str) -> None:
    """16 concurrent greedy streams of 400 tokens; `fault` runs once every stream has its first token. Every
    stream must complete, token-identical to the request served alone; prints the longest inter-token gap
    after the fault."""
    prompts = list(alone)
    events = [threading.Event() for _ in prompts]
    times = [[] for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_tokens, server.url, p, 400, e, times=t) for p, e, t in zip(prompts, events, times)]
        assert all(e.wait(60) for e in events), [f.exception() for f in futures if f.done()]
        began = time.monotonic()
        fault()
        results = [f.result(timeout=120) for f in futures]
    for prompt, (tokens, error, done) in zip(prompts, results):
        assert error is None and done, error
        server.assert_same_or_near_tie(prompt, tokens, alone[prompt])
    gaps = sorted(longest_gap(t, began) for t in times)
    print(f"{label}: 16/16 streams complete and identical; longest inter-token gap after the fault "
          f"{gaps[-1]:.3f} s (median stream {gaps[len(gaps) // 2]:.3f} s)")


def test_drafter_killed_mid_stream(default_server):
    """With the default flags a killed drafter costs speed, not a stream: the verify worker sees its connection
    close at once, decodes without drafts and keeps its heartbeat while it waits."""
    server, alone = default_server
    streams_through(server, alone, lambda: os.kill(server.child_pid("draft"), signal.SIGKILL), "drafter SIGKILL")
    verify = server.metrics("verify")
    assert metric_value(verify, "dflash_spec_fallback_steps_total") >= 1
    assert "draft worker exited" in server.stderr_path.read_text()
    assert server.wait_ready(60)["drafter"] == "available"  # restarted, and speculating again
    assert completion_tokens(server.url, "x", 30, num_speculative_tokens=3)["usage"]["speculative"]["draft_tokens"] > 0


def test_drafter_stopped_for_3_s_mid_stream(default_server):
    """A hung drafter (SIGSTOP) misses its deadline, a multiple of its measured latency, and the streams go on
    without drafts; once it runs again (SIGCONT) it answers a ping and speculation resumes. The drafter has been
    serving drafts before it hangs (its latency is measured: a drafter that hangs within its first calls after a
    start waits out the 5 s cap instead, see DraftDeadline)."""
    server, alone = default_server
    server.wait_ready(60)
    assert completion_tokens(server.url, "x", 30, num_speculative_tokens=3)["usage"]["speculative"]["draft_tokens"] > 0
    pid = server.child_pid("draft")
    fallback_before = metric_value(server.metrics("verify"), "dflash_spec_fallback_steps_total")

    def stop_for_3_s():
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(3.0, os.kill, (pid, signal.SIGCONT)).start()

    streams_through(server, alone, stop_for_3_s, "drafter SIGSTOP 3 s")
    assert metric_value(server.metrics("verify"), "dflash_spec_fallback_steps_total") > fallback_before
    assert server.child_pid("draft") == pid  # the same drafter, not a restarted one
    assert server.wait_ready(30)["drafter"] == "available"
    assert completion_tokens(server.url, "x", 30, num_speculative_tokens=3)["usage"]["speculative"]["draft_tokens"] > 0


def test_verify_worker_killed(models):
    target, draft, root = models
    server = Server(target, draft, log_dir=root)
    try:
        server.wait_ready()
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream_tokens, server.url, "while True:", 480, started)
            assert started.wait(60), future.exception(timeout=0) if future.done() else "no token in 60 s"
            os.kill(server.child_pid("verify"), signal.SIGKILL)
            tokens, error, done = future.result(timeout=30)  # nothing hangs
        assert error is not None and error["code"] == "verify_worker_down" and done
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 503
        began = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert response.status_code == 503 and time.monotonic() - began < 2
        assert response.json()["error"]["code"] == "service_unavailable"
        assert server.process.wait(30) != 0  # dflash-serve exits non-zero so a supervisor restarts it
    finally:
        server.stop()


def test_client_disconnect_aborts_and_frees_the_cache(tmp_path):
    """One choice, three choices, and a batch of two prompts of two choices, one server: a client that goes away
    mid-stream has every choice aborted and its cache freed, and the server serves on."""
    target, draft = write_server_models(tmp_path)
    (target / "tokenizer_config.json").write_text("{}")  # no end-of-text token: no choice ends before the abort
    server = Server(target, draft, log_dir=tmp_path)

    def aborted() -> int:
        return sum(" INFO aborted " in line for line in server.stderr_path.read_text().splitlines())

    try:
        server.wait_ready()
        expected = 0
        for round_, choices in enumerate([{}, {"n": 3}, {"prompt": ["import os", "import sys"], "n": 2}], 1):
            body = {"model": "tiny", "prompt": "import os", "max_tokens": 480, "temperature": 0, "stream": True,
                    **choices}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for _ in range(3):
                    next(lines)
            expected += choices.get("n", 1) * (len(choices["prompt"]) if "prompt" in choices else 1)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and aborted() < expected:
                time.sleep(0.1)
            assert aborted() == expected, choices  # the verify worker dropped every choice, none ran on
            # the running gauge is refreshed by the worker's heartbeat (every 0.25 s); a readiness probe's request
            # (every 2 s) may be running at one reading, never at every reading for 5 s
            deadline = time.monotonic() + 5
            while metric_value(server.metrics("verify"), "dflash_running_requests") and time.monotonic() < deadline:
                time.sleep(0.3)
            assert metric_value(server.metrics("verify"), "dflash_running_requests") == 0
            assert metric_value(server.metrics("gateway"), "dflash_requests_total", {"outcome": "aborted"}) == round_
            assert completion_tokens(server.url, "ok", 4)["usage"]["completion_tokens"] == 4  # and serving on
    finally:
        assert server.stop() == 0


def test_full_queue_gets_429_and_api_key_is_enforced(models):
    target, draft, root = models
    server = Server(target, draft, "--max-running", "1", "--max-waiting", "1", "--api-key", "sekret", log_dir=root)
    try:
        server.wait_ready()
        headers = {"Authorization": "Bearer sekret"}
        unauthorized = httpx.get(f"{server.url}/v1/models", timeout=10)
        assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10).status_code == 200

        def post(_):
            return httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120,
                              json={"model": "tiny", "prompt": "x", "max_tokens": 300, "temperature": 0})

        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(post, range(6)))
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 1 and 429 in codes, codes  # (a readiness probe may hold the one slot)
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert server.stop() == 0


def test_bad_wire_messages_are_rejected_and_workers_keep_running(default_server):
    server, _ = default_server
    verify_bad = metric_value(server.metrics("verify"), "dflash_bad_messages_total")
    draft_bad = metric_value(server.metrics("draft"), "dflash_bad_messages_total")
    context = zmq.Context()
    to_verify = context.socket(zmq.PUSH)
    to_verify.connect(f"tcp://127.0.0.1:{server.zmq_base}")
    to_drafter = context.socket(zmq.DEALER)
    to_drafter.connect(f"tcp://127.0.0.1:{server.zmq_base + 2}")
    bad = [
        [msgpack.packb({"v": 99, "type": "submit", "body": {}, "tensors": []})],
        [msgpack.packb({"v": SCHEMA_VERSION, "type": "submit", "body": {"request_id": "x"}, "tensors": []})],
        [b"\x00\x01garbage"],
    ]
    for frames in bad:
        to_verify.send_multipart(frames)
        to_drafter.send_multipart(frames)
    shapes = {"v": SCHEMA_VERSION, "type": "draft", "body": {"call_id": 1, "request_ids": ["a"], "context_starts": [0],
              "feature_rows": [3], "anchor_tokens": [1], "num_drafts": [2], "temperatures": [0.0],
              "top_ps": [1.0], "top_ks": [0], "seeds": [1]},
              "tensors": [{"field": "features", "dtype": "float32", "shape": [2, 4]}]}
    to_drafter.send_multipart([msgpack.packb(shapes), b"\x00" * 32])
    time.sleep(1.0)
    assert metric_value(server.metrics("verify"), "dflash_bad_messages_total") == verify_bad + 3
    assert metric_value(server.metrics("draft"), "dflash_bad_messages_total") == draft_bad + 4
    assert completion_tokens(server.url, "ok", 10)["usage"]["completion_tokens"] == 10  # both serve on
    assert metric_value(server.metrics("verify"), "dflash_drafter_available", {"kind": "dflash"}) == 1
    context.destroy(linger=0)


def test_sigterm_drains_the_streams_in_flight_refuses_new_ones_and_leaves_no_orphans(tmp_path):
    target, draft = write_server_models(tmp_path)
    (target / "tokenizer_config.json").write_text("{}")  # no end-of-text token: every stream runs to max_tokens
    server = Server(target, draft, "--shutdown-timeout", "60", log_dir=tmp_path)
    pids = [server.child_pid(role) for role in ("gateway", "verify", "draft")]
    try:
        server.wait_ready()
        events = [threading.Event() for _ in range(16)]
        with ThreadPoolExecutor(len(events)) as pool:
            futures = [pool.submit(stream_tokens, server.url, f"x = {i}", 480, e) for i, e in enumerate(events)]
            assert all(e.wait(60) for e in events)
            began = time.monotonic()
            server.process.send_signal(signal.SIGTERM)  # the launcher only, as a supervisor stops it
            refused = False
            while not refused and time.monotonic() - began < 10:  # draining: new connections are refused
                try:
                    httpx.get(f"{server.url}/health", timeout=2)
                    time.sleep(0.05)
                except httpx.TransportError:
                    refused = True
            assert refused
            results = [f.result(timeout=120) for f in futures]
        drained = time.monotonic() - began
        for tokens, error, done in results:  # every stream in flight finished, none was cut
            assert error is None and done and len(tokens) == 480
        assert server.process.wait(60) == 0
        time.sleep(0.5)
        assert not any(process_alive(pid) for pid in pids)  # SIGTERM leaves no orphans
    finally:
        server.stop()
    print(f"drained 16 streams in {drained:.1f} s")  # before the drain (a 2 s cap) all 16 were cut here
