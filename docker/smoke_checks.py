"""The checks docker/smoke.sh runs against the deployed stacks, one subcommand each; each prints one line of
figures (the table's) and exits non-zero with the reason on stderr when the check fails.

    python docker/smoke_checks.py ready URL [--timeout S]
    python docker/smoke_checks.py openai URL                  # a completion and a streamed chat, openai client
    python docker/smoke_checks.py reference URL OUT.json      # greedy outputs of the prompts, each served alone
    python docker/smoke_checks.py during URL REF.json CMD     # concurrent streams; CMD runs once they all stream
    python docker/smoke_checks.py drafts-again URL CONTAINER  # the container restarted and the drafter drafts
    python docker/smoke_checks.py docker-kill CONTAINER       # what `docker kill` leaves (restart policy)
    python docker/smoke_checks.py drain URL CMD               # streams in flight while CMD stops the stack
    python docker/smoke_checks.py compare URL REF.json        # greedy outputs equal the reference
    python docker/smoke_checks.py targets PROMETHEUS_URL      # every scrape target up
    python docker/smoke_checks.py dashboard URL PROMETHEUS_URL  # some load, then every dashboard query has data
"""

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(path):\n",
           "def quicksort(items):\n", "for i in range(10):\n", "def read_json(path):\n"]
MAX_TOKENS = 200  # long enough for a fault in the middle of the streams


def fail(message: str) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(1)


def stream(url: str, prompt: str, out: dict, started: threading.Event | None = None) -> None:
    """One greedy streamed completion: its token ids, whether it ended with [DONE] and no error, the longest gap
    between two chunks."""
    body = {"model": served_model(url), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    ids, last, gap, done, error = [], None, 0.0, False, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}"
            for line in response.iter_lines():
                now = time.monotonic()
                gap, last = (max(gap, now - last) if last else gap), now
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                    for choice in chunk.get("choices", []):
                        ids += choice.get("token_ids") or []
                    if started is not None and ids:
                        started.set()
    except httpx.HTTPError as exc:
        error = repr(exc)
    out.update(ids=ids, done=done and error is None, error=error, gap=gap)


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def cmd_ready(args) -> None:
    deadline = time.monotonic() + args.timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{args.url}/ready", timeout=5)
            if response.status_code == 200:
                print("ready")
                return
            last = response.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(2)
    fail(f"not ready after {args.timeout:.0f} s: {last}")


def cmd_openai(args) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{args.url}/v1", api_key="none")
    model = served_model(args.url)
    completion = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=32, temperature=0)
    text = completion.choices[0].text
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a function that adds two numbers."}],
        max_tokens=32, temperature=0, stream=True) if chunk.choices]
    if not text or not "".join(pieces):
        fail(f"empty output: completion {text!r}, chat {''.join(pieces)!r}")
    print(f"completion {completion.usage.completion_tokens} tokens, streamed chat {len(pieces)} chunks")


def cmd_reference(args) -> None:
    outputs = []
    for prompt in PROMPTS:
        out: dict = {}
        stream(args.url, prompt, out)
        if not out["done"]:
            fail(f"{prompt!r}: {out['error']}")
        outputs.append(out["ids"])
    Path(args.out).write_text(json.dumps(outputs))
    print(f"{len(outputs)} prompts x {MAX_TOKENS} tokens, each alone")


def concurrent(url: str, action) -> tuple[list[dict], float]:
    """Every prompt streamed at once; `action` runs once all of them stream. (outputs, seconds the action took)"""
    outs = [dict() for _ in PROMPTS]
    started = [threading.Event() for _ in PROMPTS]
    threads = [threading.Thread(target=stream, args=(url, p, o, e)) for p, o, e in zip(PROMPTS, outs, started)]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait(120)
    t0 = time.monotonic()
    action()
    took = time.monotonic() - t0
    for thread in threads:
        thread.join(600)
    return outs, took


def cmd_during(args) -> None:
    reference = json.loads(Path(args.ref).read_text())
    outs, _ = concurrent(args.url, lambda: subprocess.run(args.cmd, shell=True, check=True))
    complete = sum(o["done"] for o in outs)
    same = sum(o["ids"] == want for o, want in zip(outs, reference))
    figures = (f"{complete}/{len(outs)} streams complete, {same}/{len(outs)} identical to alone, longest gap "
               f"{max(o['gap'] for o in outs):.2f} s")
    if complete < len(outs) or same < len(outs):
        fail(figures + f"; errors: {[o['error'] for o in outs if o['error']]}")
    print(figures)


def drafted_tokens(url: str) -> int:
    out = httpx.post(f"{url}/v1/completions", json={"model": served_model(url), "prompt": PROMPTS[0], "max_tokens": 24,
                                                   "temperature": 0, "num_speculative_tokens": 7}, timeout=60).json()
    return out["usage"].get("speculative", {}).get("draft_tokens", 0)


def container_state(container: str) -> dict:
    return json.loads(subprocess.run(["docker", "inspect", "--format", "{{json .State}}", container],
                                     capture_output=True, text=True, check=True).stdout)


def restart_count(container: str) -> int:
    return int(subprocess.run(["docker", "inspect", "--format", "{{.RestartCount}}", container],
                              capture_output=True, text=True, check=True).stdout)


def cmd_drafts_again(args) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if container_state(args.container).get("Running") and drafted_tokens(args.url) > 0:
            print(f"restarted by its policy ({restart_count(args.container)} restart), drafting again after "
                  f"{300 - (deadline - time.monotonic()):.0f} s")
            return
        time.sleep(2)
    fail(f"no drafts 300 s after the kill; state {container_state(args.container)}")


def cmd_docker_kill(args) -> None:
    subprocess.run(["docker", "kill", args.container], check=True, capture_output=True)
    time.sleep(10)
    state = container_state(args.container)
    running = state.get("Running")
    print(f"after `docker kill`: {'running again' if running else 'stopped'} ({restart_count(args.container)} "
          f"restarts; docker counts a kill as a manual stop)")


def cmd_drain(args) -> None:
    outs, took = concurrent(args.url, lambda: subprocess.run(args.cmd, shell=True, check=True, capture_output=True))
    complete = sum(o["done"] and len(o["ids"]) == MAX_TOKENS for o in outs)
    figures = f"{complete}/{len(outs)} streams finished whole; the stop took {took:.1f} s"
    if complete < len(outs):
        fail(figures + f"; errors: {[o['error'] for o in outs if o['error']]}")
    print(figures)


def cmd_compare(args) -> None:
    reference = json.loads(Path(args.ref).read_text())
    same = 0
    for prompt, want in zip(PROMPTS, reference):
        out: dict = {}
        stream(args.url, prompt, out)
        same += out["ids"] == want
    figures = f"{same}/{len(PROMPTS)} greedy outputs identical ({MAX_TOKENS} tokens each)"
    if same < len(PROMPTS):
        fail(figures)
    print(figures)


def cmd_targets(args) -> None:
    deadline = time.monotonic() + 60
    while True:
        targets = httpx.get(f"{args.prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        up = [t["scrapeUrl"] for t in targets if t["health"] == "up"]
        if len(up) == len(targets) and targets or time.monotonic() > deadline:
            break
        time.sleep(2)
    figures = f"{len(up)}/{len(targets)} up: {', '.join(sorted(up))}"
    if len(up) < len(targets) or not targets:
        fail(figures)
    print(figures)


def cmd_dashboard(args) -> None:
    outs, _ = concurrent(args.url, lambda: None)
    time.sleep(20)  # a few scrapes after the load
    board = Path(__file__).resolve().parent / "check_dashboard.py"
    run = subprocess.run([sys.executable, str(board), "--prometheus", args.prometheus, "--require-data"],
                         capture_output=True, text=True)
    summary = next((line for line in (run.stdout + run.stderr).splitlines() if " queries: " in line), "no summary")
    if run.returncode != 0:
        fail(f"{summary} {run.stderr.strip()[-300:]}")
    print(summary)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("ready").add_argument("url")
    sub.choices["ready"].add_argument("--timeout", type=float, default=600)
    sub.add_parser("openai").add_argument("url")
    for name, extra in (("reference", ["out"]), ("during", ["ref", "cmd"]), ("drafts-again", ["container"]),
                        ("drain", ["cmd"]), ("compare", ["ref"]), ("dashboard", ["prometheus"])):
        command = sub.add_parser(name)
        command.add_argument("url")
        for field in extra:
            command.add_argument(field)
    sub.add_parser("docker-kill").add_argument("container")
    sub.add_parser("targets").add_argument("prometheus")
    args = parser.parse_args(argv)
    globals()["cmd_" + args.check.replace("-", "_")](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
