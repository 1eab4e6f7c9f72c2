"""A real dflash-serve under a burst of concurrent requests of mixed lengths: every answer's status, the most
requests running and waiting at once (the gateway's /ready), the max running the verify worker chose (its log),
and the resident memory of every role, sampled throughout (peak) and after.

    python benchmarks/concurrent_memory.py --target /tmp/q06 [--serve-args "--no-draft"] [--concurrency 64]
        [--prompt-tokens 16,4000] [--max-tokens 8]

Prompts are token ids drawn from a fixed seed, lengths spread evenly over --prompt-tokens; greedy, ignore_eos, so
every request holds its slot for its whole output.
"""

import argparse
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's helpers: process lookup

from processes import child_pid, resident_kb, stop_process  # noqa: E402

ROLES = ("verify", "draft", "gateway")


class Sampler(threading.Thread):
    """Every 0.25 s: each role's resident memory and /ready's running and waiting counts; the peaks kept."""

    def __init__(self, url: str, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.url, self.pids = url, pids
        self.peak_kb = dict.fromkeys(pids, 0)
        self.most_running = self.most_waiting = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for role, pid in self.pids.items():
                try:
                    self.peak_kb[role] = max(self.peak_kb[role], resident_kb(pid))
                except (OSError, LookupError):
                    pass
            try:
                body = httpx.get(f"{self.url}/ready", timeout=5).json()
                self.most_running = max(self.most_running, body.get("running") or 0)
                self.most_waiting = max(self.most_waiting, body.get("waiting") or 0)
            except (httpx.HTTPError, ValueError):
                pass
            self.done.wait(0.25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--serve-args", default="--no-draft", help="more dflash-serve flags, as one string")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", default="16,4000", help="the shortest and longest prompt, in tokens")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = args.port
    command = [sys.executable, "-m", "gateway.launcher", "--target", args.target, "--port", str(port),
               "--zmq-base-port", str(port + 1), "--metrics-base-port", str(port + 5), "--tp-master-port",
               str(port + 7), "--feature-pair-port", str(port + 8), *args.serve_args.split()]
    log_path = ROOT / f"concurrent_memory_{port}.log"
    log = open(log_path, "w")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    try:
        if not process.stdout.readline().startswith("dflash-serve ready"):
            print(log_path.read_text()[-3000:])
            raise SystemExit(f"dflash-serve did not start (its log: {log_path})")
        print(f"dflash-serve {' '.join(command[3:])}: ready in {time.monotonic() - started:.0f} s")
        for line in log_path.read_text().splitlines():
            if "may use" in line or "max running lowered" in line or "requests that fit" in line or "cache " in line:
                print("  " + line.split(" INFO ")[-1].split(" WARNING ")[-1])
        url = f"http://127.0.0.1:{port}"
        config = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        pids = {}
        for role in ROLES:
            try:
                pids[role] = child_pid(process.pid, role)
            except LookupError:
                pass
        shortest, longest = (int(n) for n in args.prompt_tokens.split(","))
        rng = random.Random(args.seed)
        lengths = [shortest + (longest - shortest) * i // max(1, args.concurrency - 1) for i in range(args.concurrency)]
        rng.shuffle(lengths)
        statuses: list[int | str] = [0] * args.concurrency

        def send(index: int) -> None:
            prompt = [rng.randrange(256) for _ in range(lengths[index])]
            body = {"model": config["id"], "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            try:
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
                statuses[index] = answer.status_code
            except httpx.HTTPError as exc:
                statuses[index] = type(exc).__name__

        sampler = Sampler(url, pids)
        sampler.start()
        burst = time.monotonic()
        senders = [threading.Thread(target=send, args=(i,)) for i in range(args.concurrency)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        sampler.done.set()
        sampler.join()
        elapsed = time.monotonic() - burst
        ok = sum(1 for status in statuses if status == 200)
        print(f"{args.concurrency} concurrent requests, prompts {shortest}-{longest} tokens, {args.max_tokens} new: "
              f"{ok} answered 200 in {elapsed:.0f} s; others: {[s for s in statuses if s != 200]}")
        print(f"most at once: {sampler.most_running} running, {sampler.most_waiting} waiting (/ready, every 0.25 s)")
        time.sleep(1.0)
        print("| role | resident after (GiB) | peak sampled (GiB) |")
        print("| --- | --- | --- |")
        for role, pid in pids.items():
            print(f"| {role} | {resident_kb(pid) / 2**20:.2f} | {sampler.peak_kb[role] / 2**20:.2f} |")
        return 0 if ok == args.concurrency else 1
    finally:
        stop_process(process, 60)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
