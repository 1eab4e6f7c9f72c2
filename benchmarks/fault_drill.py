"""Fault drills against a real dflash-serve with its DEFAULT flags (the embedded demo pair unless --target is
given): what a fault costs the streams beside it.

    python benchmarks/fault_drill.py drafter     # 16 greedy streams of 400 tokens; drafter SIGKILL, then SIGSTOP 3 s
    python benchmarks/fault_drill.py poison      # edge-value requests beside 4 running greedy streams
    python benchmarks/fault_drill.py fuzz --bodies 5000   # random request bodies beside running streams
    python benchmarks/fault_drill.py verify      # the verify worker SIGKILLed under 4 streams

Each drill starts its own server (ports from --port), compares every stream with the same request served
alone (greedy: token-identical), and prints its figures: completed streams, identical streams, the longest gap
between two token chunks of a stream after the fault, response codes.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's helpers: process lookup, request fuzzing

from processes import child_pid, stop_process  # noqa: E402

POISON_INTEGERS = {"2**63": 2**63, "2**64": 2**64, "10**30": 10**30, "-2**63": -2**63}
POISON_FLOATS = {"1e308": 1e308, "5e-324": 5e-324, "-0.0": -0.0}
INTEGER_FIELDS = ("top_k", "seed", "num_speculative_tokens", "n", "logprobs", "max_tokens")
FLOAT_FIELDS = ("temperature", "top_p")


class Serve:
    """dflash-serve with the default flags (plus ports and any --serve-args); the pid of each role's child."""

    def __init__(self, port: int, extra: list[str]):
        command = [sys.executable, "-m", "gateway.launcher", "--port", str(port), "--zmq-base-port", str(port + 1),
                   "--metrics-base-port", str(port + 4), "--tp-master-port", str(port + 6), "--feature-pair-port",
                   str(port + 7), *extra]
        self.log = open(ROOT / f"fault_drill_{port}.log", "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        line = self.process.stdout.readline()
        if not line.startswith("dflash-serve ready"):
            self.stop()
            raise SystemExit(f"dflash-serve did not start: {line!r} (see {self.log.name})")
        self.url = f"http://127.0.0.1:{port}"
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def wait_ready(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.url}/ready", timeout=5)
            if response.status_code == 200:
                return response.json()
            time.sleep(0.2)
        raise SystemExit(f"not ready: {httpx.get(f'{self.url}/ready', timeout=5).text}")

    def child_pid(self, role: str) -> int:
        return child_pid(self.process.pid, role)

    def stop(self) -> None:
        stop_process(self.process, 60)
        self.log.close()


def prompts(count: int) -> list[str]:
    return [p["prompt"] for p in json.loads((ROOT / "benchmarks/prompts_heldout.json").read_text())[:count]]


def complete(server: Serve, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def stream(server: Serve, prompt: str, max_tokens: int, started: threading.Event, times: list) -> tuple:
    """(token ids, error or None); the arrival time of every chunk with tokens goes to times."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    tokens, error = [], None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            return tokens, f"HTTP {response.status_code}: {response.read()[:200]!r}"
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk["choices"] and chunk["choices"][0].get("token_ids"):
                tokens += chunk["choices"][0]["token_ids"]
                times.append(time.monotonic())
                started.set()
    return tokens, error


def streams_with(server: Serve, alone: dict, max_tokens: int, fault, repeat: bool = False) -> dict:
    """Every prompt of `alone` streamed at once; `fault()` runs when each has its first token. With repeat,
    each prompt streams again and again until fault() has returned (victims beside a long drill)."""
    started = [threading.Event() for _ in alone]
    times = [[] for _ in alone]
    fault_done = threading.Event()

    def victim(prompt: str, first: threading.Event, arrivals: list) -> list:
        runs = [stream(server, prompt, max_tokens, first, arrivals)]
        while repeat and not fault_done.is_set():
            runs.append(stream(server, prompt, max_tokens, threading.Event(), arrivals))
        return runs

    with ThreadPoolExecutor(len(alone)) as pool:
        futures = [pool.submit(victim, p, e, t) for p, e, t in zip(alone, started, times)]
        for event in started:
            event.wait(120)
        fault_at = time.monotonic()
        try:
            fault()
        finally:
            fault_done.set()
        results = [(p, run) for p, f in zip(alone, futures) for run in f.result()]
    gaps = []
    for t in times:
        after = [fault_at] + [x for x in t if x > fault_at]
        gaps.append(max((b - a for a, b in zip(after, after[1:])), default=0.0))
    return {
        "complete": sum(error is None for _, (_, error) in results),
        "identical": sum(error is None and tokens == alone[p] for p, (tokens, error) in results),
        "streams": len(results),
        "tokens": sum(len(tokens) for _, (tokens, _) in results),
        "longest_gap_s": round(max(gaps), 3),
        "median_stream_longest_gap_s": round(sorted(gaps)[len(gaps) // 2], 3),
        "errors": [error for _, (_, error) in results if error is not None][:3],
    }


def speculative_tokens(server: Serve) -> int:
    body = {"model": server.model, "prompt": "def f(x):", "max_tokens": 32, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["usage"]["speculative"]["draft_tokens"]


def drill_drafter(server: Serve, args) -> None:
    alone = {p: complete(server, p, args.max_tokens) for p in prompts(args.streams)}
    kill = streams_with(server, alone, args.max_tokens, lambda: os.kill(server.child_pid("draft"), signal.SIGKILL))
    print(f"drafter SIGKILL: {json.dumps(kill)}", flush=True)
    server.wait_ready(120)
    print(f"  after the restart: ready, drafter speculating again ({speculative_tokens(server)} draft tokens "
          "in a 32-token request)", flush=True)
    pid = server.child_pid("draft")

    def stop_for_3_s():
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(3.0, os.kill, (pid, signal.SIGCONT)).start()

    stop = streams_with(server, alone, args.max_tokens, stop_for_3_s)
    print(f"drafter SIGSTOP 3 s then SIGCONT: {json.dumps(stop)}", flush=True)
    server.wait_ready(60)
    print(f"  afterwards: the same drafter (pid {pid} == {server.child_pid('draft')}), "
          f"{speculative_tokens(server)} draft tokens in a 32-token request", flush=True)


def drill_poison(server: Serve, args) -> None:
    victims = prompts(4)
    alone = {p: complete(server, p, 200) for p in victims}
    cases = [(f, name, v) for f in INTEGER_FIELDS for name, v in POISON_INTEGERS.items()]
    cases += [(f, name, v) for f in FLOAT_FIELDS for name, v in POISON_FLOATS.items()]
    codes = {}

    def poison_all():
        for field, name, value in cases:
            body = {"model": server.model, "prompt": "x", "max_tokens": 4, "temperature": 1.0, field: value}
            codes[f"{field}={name}"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code

    result = streams_with(server, alone, 200, poison_all, repeat=True)
    print(f"poison requests: {json.dumps(codes)}")
    print(f"  4xx: {sum(400 <= c < 500 for c in codes.values())} of {len(codes)}; >= 500: "
          f"{sum(c >= 500 for c in codes.values())}; 200: {sum(c == 200 for c in codes.values())}")
    print(f"victims: {json.dumps(result)}")


def drill_fuzz(server: Serve, args) -> None:
    from request_fuzz import fuzz  # the test suite's hypothesis strategies for request bodies

    alone = {p: complete(server, p, 300) for p in prompts(4)}
    outcome = {}

    def run_fuzz():
        outcome.update(fuzz(server.url, server.model, args.bodies, seed_value=args.seed))

    result = streams_with(server, alone, 300, run_fuzz, repeat=True)
    print(f"fuzz: {args.bodies} bodies: status codes {dict(sorted(outcome['codes'].items()))}; >= 500: "
          f"{outcome['server_errors']}; connection errors: {outcome['connection_errors']}")
    print(f"  /ready afterwards: {httpx.get(f'{server.url}/ready', timeout=10).status_code}")
    print(f"victims: {json.dumps(result)}")


def drill_verify(server: Serve, args) -> None:
    """The verify worker killed: how long until each open stream gets its error event, and what a new request
    gets."""
    started = [threading.Event() for _ in range(4)]
    ended = {}

    def watch(i: int, prompt: str):
        tokens, error = stream(server, prompt, args.max_tokens, started[i], [])
        ended[i] = (time.monotonic(), error)

    threads = [threading.Thread(target=watch, args=(i, p)) for i, p in enumerate(prompts(4))]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait(120)
    killed = time.monotonic()
    os.kill(server.child_pid("verify"), signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    waits = sorted(round(at - killed, 3) for at, _ in ended.values())
    codes = sorted({(error or {}).get("code") for _, error in ended.values()}, key=str)
    began = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x"}, timeout=10)
    print(f"verify worker SIGKILL: {len(ended)} streams ended with error codes {codes} after {waits} s; a new "
          f"request got {response.status_code} ({response.json()['error']['code']}) in "
          f"{time.monotonic() - began:.3f} s; dflash-serve exit code {server.process.wait(60)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drill", choices=["drafter", "poison", "fuzz", "verify"])
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--serve-args", default="", help="flags added to dflash-serve (default: none)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--bodies", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    server = Serve(args.port, args.serve_args.split())
    try:
        server.wait_ready()
        drills = {"drafter": drill_drafter, "poison": drill_poison, "fuzz": drill_fuzz, "verify": drill_verify}
        drills[args.drill](server, args)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
