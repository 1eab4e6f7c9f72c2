"""Offline speed: dflash-generate (plain and speculative) against transformers' greedy generate.

All three run on the same checkpoint and prompt, interleaved round by round in one process, so machine
noise hits them alike; the script prints medians and ratios. Model loading is excluded from every timing.

    python benchmarks/bench_generate.py                      # the embedded demo pair
    python benchmarks/bench_generate.py --random-hf 1024,8,32000   # a bigger random Qwen3 written by transformers
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from draft_worker.random_pair import ensure_random_pair
from verify_worker.generate_cli import parse_args, run


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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    target, draft = args.target, args.draft
    if args.random_hf:
        target = str(write_random_hf(args.random_hf, Path(tempfile.mkdtemp())))
    if target is None:
        target_path, draft_path = ensure_random_pair()
        target, draft = str(target_path), draft or str(draft_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3"
    common = ["--target", target, "--prompt-ids", prompt, "--max-tokens", str(args.max_tokens), "--ignore-eos",
              "--threads", str(args.threads), "--json"]
    plain_args = parse_args(common + ["--no-spec"])
    spec_args = parse_args(common + (["--draft", draft] if draft else []))
    figures: dict[str, list[float]] = {"transformers": [], "plain": [], "speculative": []}
    acceptance = []
    hf_tokens_per_second(hf, [3, 1, 4], 8)  # warm-up
    run(parse_args(common[:-1] + ["--max-tokens", "8", "--no-spec"]))
    for _ in range(args.rounds):
        figures["transformers"].append(hf_tokens_per_second(hf, [int(t) for t in prompt.split(",")], args.max_tokens))
        plain = run(plain_args)
        figures["plain"].append(plain["stats"]["tokens_per_second"])
        if draft:
            spec = run(spec_args)
            figures["speculative"].append(spec["stats"]["tokens_per_second"])
            acceptance.append(spec["stats"]["acceptance_length"])
            assert spec["token_ids"] == plain["token_ids"], "speculative output differs from plain"
    medians = {name: statistics.median(v) for name, v in figures.items() if v}
    report = {
        "target": target, "draft": draft, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "threads": args.threads, "tokens_per_second_median": medians,
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
