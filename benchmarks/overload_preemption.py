"""Overload through a real dflash-serve: more long generations at once than its KV pool holds, so the engine
preempts (the newest request gives its pages back and is recomputed later). Checks that every request answers 200,
that preemptions happened, and that each request's greedy output equals its solo run on the same server.

    python benchmarks/overload_preemption.py                  # the demo pair, a pool of 12 MB, 16 x 240 tokens
    python benchmarks/overload_preemption.py --serve-args "--target /tmp/q06 --no-draft" --budget-mb 64
"""

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving_setups import serve  # noqa: E402
from pool_soak import metric  # noqa: E402
from processes import stop_process  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-args", default="", help="dflash-serve flags (default: the demo pair)")
    parser.add_argument("--budget-mb", type=float, default=12, help="--kv-cache-budget-mb: the pool's cap")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=240)
    parser.add_argument("--port", type=int, default=18700)
    args = parser.parse_args()
    port = args.port
    flags = f"{args.serve_args} --kv-cache-budget-mb {args.budget_mb} --max-model-len {args.max_model_len}"
    process = serve("", flags, port, port + 1, port + 5)
    try:
        url, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 5}/metrics"
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        vocab = min(256, model.get("vocab_size") or 256)
        rng = random.Random(0)
        prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]

        def complete(prompt: list[int]) -> tuple[int, list[int]]:
            body = {"model": model["id"], "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
            if response.status_code != 200:
                return response.status_code, []
            return 200, response.json()["choices"][0]["token_ids"]

        pool = metric(metrics, "dflash_kv_cache_pages")
        print(f"dflash-serve {flags}: pool {pool:.0f} pages; {args.requests} requests of {args.prompt_tokens} + "
              f"{args.max_tokens} tokens at once")
        started = time.monotonic()
        with ThreadPoolExecutor(args.requests) as workers:
            together = list(workers.map(complete, prompts))
        seconds = time.monotonic() - started
        preemptions = metric(metrics, "dflash_preemptions_total")
        solo = [complete(prompt) for prompt in prompts]  # one at a time: no preemption
        ok = sum(status == 200 for status, _ in together)
        same = sum(a == b and status == 200 for (status, a), (_, b) in zip(together, solo))
        print(f"{ok} of {args.requests} answered 200 in {seconds:.1f} s; preemptions {preemptions:.0f}; "
              f"{same} of {args.requests} outputs equal their solo runs; pages in use when idle "
              f"{metric(metrics, 'dflash_kv_cache_pages_used'):.0f}")
        return 0 if ok == same == args.requests and preemptions > 0 else 1
    finally:
        stop_process(process, 60)


if __name__ == "__main__":
    sys.exit(main())
