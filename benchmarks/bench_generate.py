"""Offline speed: dflash-generate (plain and speculative) against transformers' greedy generate.

All three run on the same checkpoint and prompts, interleaved round by round in one process, so machine
noise hits them alike; the script prints medians and ratios. Model loading is excluded from every timing.

    python benchmarks/bench_generate.py                      # the embedded demo pair, 8 held-out prompts
    python benchmarks/bench_generate.py --random-hf 1024,8,32000   # a bigger random Qwen3 written by transformers
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.demo_models import default_pair
from verify_worker.generate_cli import parse_args, run

HELD_OUT = Path(__file__).resolve().parent / "prompts_heldout.json"


def prompt_ids(target: Path, count: int) -> list[list[int]]:
    """The first `count` held-out benchmark prompts in the target's own tokens, or one fixed id sequence for a
    target without a tokenizer (a random one)."""
    if (target / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
        return [tokenizer.encode(p["prompt"]).ids for p in json.loads(HELD_OUT.read_text())[:count]]
    return [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]


def aggregate(reports: list[dict]) -> tuple[float, float]:
    """(tokens per second, tokens per verify step) over several dflash-generate reports."""
    tokens = sum(len(r["token_ids"]) for r in reports)
    seconds = sum(len(r["token_ids"]) / r["stats"]["tokens_per_second"] for r in reports)
    return tokens / seconds, tokens / sum(r["stats"]["verify_steps"] for r in reports)


def write_random_hf(spec: str, folder: Path) -> Path:
    import transformers

    hidden, layers, vocab = (int(x) for x in spec.split(","))
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 256, 1), head_dim=64,
        max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def hf_tokens_per_second(model, prompt_ids: list[int], max_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False)
    elapsed = time.perf_counter() - started
    return (out.shape[1] - ids.shape[1]) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--random-hf", help="hidden,layers,vocab of a random Qwen3 to write and use as target")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per round (demo target)")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch threads of transformers' generate()")
    parser.add_argument("--dflash-threads", type=int, default=0,
                        help="dflash-generate's --threads (0: its default, 1 where the C++ CPU kernels run)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    target, draft = args.target, args.draft
    if args.random_hf:
        target = str(write_random_hf(args.random_hf, Path(tempfile.mkdtemp())))
    if target is None:
        pair = default_pair(draft)
        target, draft = str(pair.target), str(pair.draft)
        print(f"no --target given: {pair.label}", file=sys.stderr)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = prompt_ids(Path(target), args.num_prompts)
    common = ["--target", target, "--max-tokens", str(args.max_tokens), "--ignore-eos", "--threads",
              str(args.dflash_threads), "--json"]

    def generate(prompt: list[int], *flags: str) -> dict:
        return run(parse_args(common + ["--prompt-ids", ",".join(map(str, prompt)), *flags]))

    figures: dict[str, list[float]] = {"transformers": [], "plain": [], "speculative": []}
    acceptance = []
    hf_tokens_per_second(hf, [3, 1, 4], 8)  # warm-up
    generate(prompts[0], "--no-spec")
    for _ in range(args.rounds):
        torch.set_num_threads(args.threads)  # (dflash-generate sets its own)
        hf_seconds = sum(args.max_tokens / hf_tokens_per_second(hf, p, args.max_tokens) for p in prompts)
        figures["transformers"].append(args.max_tokens * len(prompts) / hf_seconds)
        plain = [generate(p, "--no-spec") for p in prompts]
        figures["plain"].append(aggregate(plain)[0])
        if draft:
            spec = [generate(p, "--draft", draft) for p in prompts]
            speed, per_step = aggregate(spec)
            figures["speculative"].append(speed)
            acceptance.append(per_step)
            for a, b in zip(spec, plain):
                assert a["token_ids"] == b["token_ids"], "speculative output differs from plain"
    medians = {name: statistics.median(v) for name, v in figures.items() if v}
    report = {
        "target": target, "draft": draft, "prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
        "threads": args.threads, "dflash_threads": args.dflash_threads, "tokens_per_second_median": medians,
        "plain_over_transformers": medians["plain"] / medians["transformers"],
    }
    if draft:
        report["speculative_over_plain"] = medians["speculative"] / medians["plain"]
        report["acceptance_length_median"] = statistics.median(acceptance)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
