"""An agent's multi-turn trace against dflash-serve with prefix caching on (the default) and off
(--no-prefix-caching), both servers up at once and each turn sent to one then the other, so the two are measured
side by side: every turn resends the whole history (the last prompt, its answer, a new message) as token ids, as
an agent does through a chat template. Prints per turn the prompt's tokens, the time to the first token with
caching on and off, their ratio and the cached tokens the response reports; then the caching server's hit rate
from its metrics. Greedy: each turn's answer must be the same from both servers.

    python benchmarks/agent_trace.py                                   # the demo pair, 10 turns
    python benchmarks/agent_trace.py --serve-args "--target /tmp/q06 --no-draft --max-running 4" \\
        --turns 10 --message-tokens 300 --max-tokens 16
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving_setups import serve  # noqa: E402

HELD_OUT = Path(__file__).resolve().parent / "prompts_heldout.json"


def first_token_and_answer(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the answer's ids, the prompt tokens the server found cached), streamed."""
    body = {"model": served_model(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    started, first, ids, cached = time.perf_counter(), None, [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids") and first is None:
                    first = time.perf_counter() - started
                ids += choice.get("token_ids") or []
            if chunk.get("usage"):
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return first, ids, cached


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def messages(count: int, tokens: int, url: str, vocab: int, seed: int) -> list[list[int]]:
    """The new message of every turn: held-out code through the server's tokenizer where it has one, else random
    ids; each `tokens` long."""
    rng = random.Random(seed)
    texts = [p["prompt"] for p in json.loads(HELD_OUT.read_text())]
    out = []
    for i in range(count):
        response = httpx.post(f"{url}/tokenize", json={"model": served_model(url), "prompt": "\n".join(texts[i:] + texts[:i])},
                              timeout=30)
        ids = response.json()["tokens"] if response.status_code == 200 else []
        ids = ids[:tokens] if len(ids) >= tokens else [rng.randrange(vocab) for _ in range(tokens)]
        out.append(ids)
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-args", default="", help="dflash-serve flags of both servers (default: the demo)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--message-tokens", type=int, default=40, help="tokens of each turn's new message")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens of each answer")
    parser.add_argument("--port", type=int, default=18300)
    args = parser.parse_args(argv)
    setups = {"on": "", "off": "--no-prefix-caching"}
    servers, urls, metrics_urls = [], {}, {}
    try:
        for i, (name, flags) in enumerate(setups.items()):
            port = args.port + 20 * i
            servers.append(serve(flags, args.serve_args, port, port + 5, port + 10))
            urls[name], metrics_urls[name] = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 10}/metrics"
        turns = messages(args.turns, args.message_tokens, urls["on"], 1000, seed=0)  # any vocabulary has 1000 ids
        print(f"serve args: {args.serve_args or '(the demo pair)'}; {args.turns} turns, new messages of "
              f"{args.message_tokens} tokens, answers of {args.max_tokens}, greedy")
        print("turn  prompt  ttft on (s)  ttft off (s)  off/on  cached")
        prompt, ratios = [], []
        for turn, message in enumerate(turns, start=1):
            prompt = prompt + message
            on_s, answer, cached = first_token_and_answer(urls["on"], prompt, args.max_tokens)
            off_s, plain, _ = first_token_and_answer(urls["off"], prompt, args.max_tokens)
            if answer != plain:
                raise SystemExit(f"turn {turn}: the answers differ with caching on and off")
            if turn > 1:
                ratios.append(off_s / on_s)
            print(f"{turn:4d}  {len(prompt):6d}  {on_s:11.3f}  {off_s:12.3f}  {off_s / on_s:6.2f}  {cached:6d}")
            prompt = prompt + answer
        queried = metric(metrics_urls["on"], "dflash_prefix_cache_query_tokens_total")
        hit = metric(metrics_urls["on"], "dflash_prefix_cache_hit_tokens_total")
        print(f"turns 2..{args.turns}: time to first token off/on, median {statistics.median(ratios):.2f}x; the "
              f"caching server's hit rate {hit / queried:.3f} of {queried:.0f} prompt tokens looked up")
    finally:
        for process in servers:
            process.terminate()
        for process in servers:
            process.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
