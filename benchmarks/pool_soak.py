"""A soak of the paged KV cache and its prefix index through a real dflash-serve: many requests, a few at a time,
whose prompts share prefixes of every length with earlier ones (an agent's resent histories, forks of one system
prompt) and whose outputs end at random lengths. Every so often it reads the verify worker's pool
(dflash_kv_cache_pages_used) and resident memory; at the end it checks that every request answered 200, that the
pages in use came back to their idle count (0) and prints the memory at each checkpoint.

    python benchmarks/pool_soak.py                                      # the demo pair, 3000 requests
    python benchmarks/pool_soak.py --requests 500 --serve-args "--target /tmp/q06 --no-draft"
"""

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving_setups import serve  # noqa: E402
from processes import child_pid, resident_kb, stop_process  # noqa: E402


def metric(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-args", default="", help="dflash-serve flags (default: the demo pair)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = args.port
    process = serve("", args.serve_args, port, port + 1, port + 5)
    try:
        url = f"http://127.0.0.1:{port}"
        metrics = f"http://127.0.0.1:{port + 5}/metrics"
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        vocab = min(256, model.get("vocab_size") or 256)
        verify = child_pid(process.pid, "verify")
        rng = random.Random(args.seed)
        histories: list[list[int]] = [[rng.randrange(vocab) for _ in range(rng.randrange(8, args.max_prompt))]
                                      for _ in range(8)]
        lock, statuses, next_index = threading.Lock(), [], [0]
        pool = metric(metrics, "dflash_kv_cache_pages")
        print(f"dflash-serve {args.serve_args or '(the demo pair)'}: pool {pool:.0f} pages; {args.requests} requests, "
              f"{args.concurrency} at a time")

        def prompt_of() -> list[int]:
            base = rng.choice(histories)
            cut = rng.randrange(1, len(base) + 1)  # a prefix of any length, then something new
            prompt = (base[:cut] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 64))])[:args.max_prompt]
            if rng.random() < 0.1:
                histories[rng.randrange(len(histories))] = prompt
            return prompt

        def worker() -> None:
            while True:
                with lock:
                    if next_index[0] >= args.requests:
                        return
                    next_index[0] += 1
                    prompt, max_tokens = prompt_of(), rng.randrange(1, args.max_tokens + 1)
                body = {"model": model["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                try:
                    status = httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with lock:
                    statuses.append(status)

        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        rows, marks = [], [args.requests * (i + 1) // args.checkpoints for i in range(args.checkpoints)]
        while any(thread.is_alive() for thread in threads) or marks:
            with lock:
                done = len(statuses)
            if marks and done >= marks[0]:
                marks.pop(0)
                rows.append((done, time.monotonic() - started, resident_kb(verify) / 2**20,
                             metric(metrics, "dflash_kv_cache_pages_used"),
                             metric(metrics, "dflash_prefix_cache_tokens")))
            time.sleep(0.2)
        time.sleep(1.0)
        idle = metric(metrics, "dflash_kv_cache_pages_used")
        hits = metric(metrics, "dflash_prefix_cache_hit_tokens_total")
        queries = metric(metrics, "dflash_prefix_cache_query_tokens_total")
        print("| requests done | seconds | verify resident (GiB) | pages in use | tokens kept for reuse |")
        print("| --- | --- | --- | --- | --- |")
        for done, seconds, resident, used, kept in rows:
            print(f"| {done} | {seconds:.0f} | {resident:.3f} | {used:.0f} | {kept:.0f} |")
        ok = sum(1 for status in statuses if status == 200)
        print(f"{ok} of {len(statuses)} answered 200 (others: {sorted({s for s in statuses if s != 200}, key=str)}); "
              f"pages in use when idle: {idle:.0f}; prefix hit rate {hits / max(1, queries):.2f}; preemptions "
              f"{metric(metrics, 'dflash_preemptions_total'):.0f}")
        return 0 if ok == len(statuses) == args.requests and idle == 0 else 1
    finally:
        stop_process(process, 60)


if __name__ == "__main__":
    sys.exit(main())
