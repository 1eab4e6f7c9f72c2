"""dflash-bench: speculative against plain decoding on a running server, measured in one run.

For each block size and concurrency it runs waves of the prompt set, alternating speculative
(num_speculative_tokens = block - 1) and plain (num_speculative_tokens = 0) waves; the first pair of waves is a
discarded warm-up, and the server must be idle before each wave. Optionally it times transformers' generate()
on the same target and prompts. Writes JSON and a PNG plot (acceptance by position, speedup by concurrency).
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx


def parse_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def per_position(before: dict, after: dict, block: int) -> list[float]:
    rates = []
    for position in range(1, block):
        drafted = after.get(f"dflash_spec_draft_tokens_per_position_total|position={position}", 0) - \
            before.get(f"dflash_spec_draft_tokens_per_position_total|position={position}", 0)
        accepted = after.get(f"dflash_spec_accepted_tokens_per_position_total|position={position}", 0) - \
            before.get(f"dflash_spec_accepted_tokens_per_position_total|position={position}", 0)
        rates.append(round(accepted / drafted, 4) if drafted else 0.0)
    return rates


def step_phases_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per engine step of each phase (draft, transfer, verify, ...) between two scrapes of
    the verify worker's step-duration histogram."""
    phases = {}
    for key, total in after.items():
        if key.startswith("dflash_step_duration_seconds_sum|phase="):
            phase = key.split("=", 1)[1]
            count_key = f"dflash_step_duration_seconds_count|phase={phase}"
            steps = after.get(count_key, 0) - before.get(count_key, 0)
            if steps:
                phases[phase] = round(1000 * (total - before.get(key, 0)) / steps, 3)
    return phases


async def one_request(client, url, prompt, args, spec_tokens):
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "num_speculative_tokens": spec_tokens}
    if args.seed is not None:
        body["seed"] = args.seed
    started, arrivals, tokens, usage = time.perf_counter(), [], [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                arrivals.append(time.perf_counter())
                tokens += chunk["choices"][0]["token_ids"]
    elapsed = time.perf_counter() - started
    gaps = [(b - a) for a, b in zip(arrivals, arrivals[1:])]
    return {"tokens": tokens, "elapsed": elapsed, "ttft": arrivals[0] - started if arrivals else elapsed,
            "itl": (sum(gaps) / max(1, len(tokens) - 1)) if gaps else 0.0, "usage": usage}


async def wave(url, prompts, args, spec_tokens, concurrency):
    queue = list(enumerate(prompts))
    results = [None] * len(prompts)

    async def worker(client):
        while queue:
            index, prompt = queue.pop(0)
            results[index] = await one_request(client, url, prompt, args, spec_tokens)

    started = time.perf_counter()
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, time.perf_counter() - started


def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"{url}/ready", timeout=10).json()
        if body.get("running") == 0 and body.get("waiting") == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("the server did not become idle")


def summarize(results, wall):
    tokens = sum(len(r["tokens"]) for r in results)
    steps = sum(r["usage"]["speculative"]["verify_steps"] for r in results)
    return {
        "tokens": tokens,
        "tokens_per_second_aggregate": tokens / wall,
        "tokens_per_second_per_stream": statistics.median(len(r["tokens"]) / r["elapsed"] for r in results),
        "ttft_median_s": statistics.median(r["ttft"] for r in results),
        "itl_median_s": statistics.median(r["itl"] for r in results),
        "acceptance_length": (tokens - len(results)) / steps if steps else 0.0,
    }


def run_hf(target: str, prompts: list[str], max_tokens: int) -> float:
    """Median tokens/s of transformers' greedy generate, one prompt at a time."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    rates = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        rates.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - started))
    return statistics.median(rates)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for block, entry in report["by_block_size"].items():
        first = entry["by_concurrency"][str(min(map(int, entry["by_concurrency"])))]
        rates = first["per_position_acceptance"]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=f"block {block}")
        levels = sorted(map(int, entry["by_concurrency"]))
        right.plot(levels, [entry["by_concurrency"][str(c)]["speedup_aggregate"] for c in levels], marker="o",
                   label=f"block {block}")
    left.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance by position", ylim=(0, 1))
    right.set(xlabel="concurrency", ylabel="speedup over plain", title="End-to-end speedup")
    right.axhline(1.0, color="grey", linewidth=0.8)
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:9101/metrics", help="the verify worker's metrics")
    parser.add_argument("--prompts", default="benchmarks/prompts_heldout.json")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--block-sizes", default="8,16")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--rounds", type=int, default=2, help="measured spec/plain wave pairs per setting")
    parser.add_argument("--hf-target", help="also time transformers' generate on this target checkpoint")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    records = json.loads(Path(args.prompts).read_text())
    prompts = [r["prompt"] if isinstance(r, dict) else r for r in records][: args.num_prompts]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": vars(args), "by_block_size": {}}
    mismatches = 0
    for block in map(int, args.block_sizes.split(",")):
        entry = report["by_block_size"][str(block)] = {"by_concurrency": {}}
        for concurrency in map(int, args.concurrency.split(",")):
            spec_runs, plain_runs, positions, phases = [], [], [], []
            for round_index in range(args.rounds + 1):  # round 0 is the warm-up
                wait_idle(args.url)
                before = parse_metrics(httpx.get(args.metrics_url, timeout=10).text)
                spec = asyncio.run(wave(args.url, prompts, args, block - 1, concurrency))
                after = parse_metrics(httpx.get(args.metrics_url, timeout=10).text)
                wait_idle(args.url)
                plain = asyncio.run(wave(args.url, prompts, args, 0, concurrency))
                if round_index == 0:
                    continue
                spec_runs.append(summarize(*spec))
                plain_runs.append(summarize(*plain))
                positions.append(per_position(before, after, block))
                phases.append(step_phases_ms(before, after))
                if args.temperature == 0:
                    mismatches += sum(s["tokens"] != p["tokens"] for s, p in zip(spec[0], plain[0]))
            med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
            result = {
                "speculative": {k: med(spec_runs, k) for k in spec_runs[0]},
                "plain": {k: med(plain_runs, k) for k in plain_runs[0]},
                "per_position_acceptance": [round(statistics.mean(p[i] for p in positions), 4)
                                            for i in range(block - 1)],
                "speculative_step_ms_by_phase": {k: statistics.median(p.get(k, 0.0) for p in phases)
                                                 for k in phases[0]},
            }
            result["speedup_aggregate"] = result["speculative"]["tokens_per_second_aggregate"] / \
                result["plain"]["tokens_per_second_aggregate"]
            result["speedup_per_stream"] = result["speculative"]["tokens_per_second_per_stream"] / \
                result["plain"]["tokens_per_second_per_stream"]
            entry["by_concurrency"][str(concurrency)] = result
            print(f"block {block} concurrency {concurrency}: acceptance length "
                  f"{result['speculative']['acceptance_length']:.2f}, speedup {result['speedup_aggregate']:.2f}x "
                  f"({result['speculative']['tokens_per_second_aggregate']:.1f} vs "
                  f"{result['plain']['tokens_per_second_aggregate']:.1f} tok/s)", flush=True)
    report["greedy_mismatches"] = mismatches if args.temperature == 0 else None
    if args.hf_target:
        wait_idle(args.url)
        hf = run_hf(args.hf_target, prompts, args.max_tokens)
        report["transformers_tokens_per_second_per_stream"] = hf
        for block, entry in report["by_block_size"].items():
            c1 = entry["by_concurrency"].get("1")
            if c1:
                c1["speedup_over_transformers"] = c1["speculative"]["tokens_per_second_per_stream"] / hf
                c1["plain_over_transformers"] = c1["plain"]["tokens_per_second_per_stream"] / hf
        print(f"transformers generate: {hf:.1f} tok/s per stream", flush=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(report, out / "bench.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
