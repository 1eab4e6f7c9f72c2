"""The bare target forward (with its lm_head), as loaded (the checkpoint's modules) against packed for inference
(TargetModel.pack: fused q/k/v and gate/up, the device's fastest weight layout, q and k heads normalized and
rotated together), measured in interleaved rounds in one process; prints medians and ratios.

    python benchmarks/bench_forward.py                         # demo target, float32, 1 thread
    python benchmarks/bench_forward.py --dtype bfloat16 --threads 2
    python benchmarks/bench_forward.py --target path/to/hf_checkpoint --shapes 1x1,1x8,16x1,16x8

Shapes are BATCHxTOKENS: 1x1 is a plain decode step, 1x8 a verify block of 8, 16x8 sixteen verify blocks.
Every row attends over --context cached positions. The two models must give the same greedy tokens; the
largest logit difference is printed too.
"""

import argparse
import statistics
import time

import torch

from shared.demo_models import default_pair
from verify_worker.target_loader import load_target


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target checkpoint folder (default: the embedded demo target)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default="1x1,1x8,16x1,16x8")
    parser.add_argument("--context", type=int, default=200, help="cached positions before the new tokens")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30, help="timed forwards per model per round")
    return parser.parse_args(argv)


def time_forward(model, cache, ids, positions, slots, calls: int) -> tuple[float, torch.Tensor]:
    """Median seconds of one forward + logits over `calls` calls, and the last logits."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        logits = model.logits(model(ids, positions, cache, slots, (1,)).hidden)
        times.append(time.perf_counter() - started)
    return statistics.median(times), logits


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.target or default_pair().target
    models = {"as loaded": load_target(folder, dtype=args.dtype, pack=False),
              "packed": load_target(folder, dtype=args.dtype)}
    vocab = models["packed"].config.vocab_size
    print(f"target {folder}, {args.dtype}, {args.threads} thread(s), context {args.context}")
    print(f"{'shape':>6} {'as loaded ms':>13} {'packed ms':>10} {'ratio':>6}  max |logit diff|  same argmax")
    for shape in args.shapes.split(","):
        batch, tokens = (int(n) for n in shape.split("x"))
        ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
        positions = (args.context + torch.arange(tokens))[None].expand(batch, -1)
        slots = torch.arange(batch)
        caches = {name: model.new_cache(batch, args.context + tokens) for name, model in models.items()}
        seconds = {name: [] for name in models}
        logits = {}
        with torch.inference_mode():
            for name, model in models.items():  # fill the cached context alike
                model(torch.randint(0, vocab, (batch, args.context), generator=torch.Generator().manual_seed(1)),
                      torch.arange(args.context)[None].expand(batch, -1), caches[name], slots)
            for _ in range(args.rounds):
                for name, model in models.items():
                    median, logits[name] = time_forward(model, caches[name], ids, positions, slots, args.calls)
                    seconds[name].append(median)
        loaded, packed = (statistics.median(seconds[n]) * 1e3 for n in models)
        diff = (logits["as loaded"] - logits["packed"]).abs().max().item()
        same = torch.equal(logits["as loaded"].argmax(-1), logits["packed"].argmax(-1))
        print(f"{shape:>6} {loaded:13.2f} {packed:10.2f} {loaded / packed:5.2f}x  {diff:16.2e}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
