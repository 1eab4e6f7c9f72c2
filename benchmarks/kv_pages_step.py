"""The paged KV cache's cost per decode step against a slot a request, side by side in one process: the same
target, the same greedy batch of requests (prompts of --prompt-tokens, --new-tokens each, plain decoding), served
by an engine with the cache paged (the default on a CPU) and one with a slot a request (page_size None),
alternately for --rounds rounds (each round's first engine alternating). Prints the median decode step (ms) and tokens/s of each and their ratio, and
checks that the outputs are the same.

    python benchmarks/kv_pages_step.py --target /tmp/q06 [--requests 8] [--prompt-tokens 512] [--new-tokens 32]
        [--threads 2]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.generation_request import GenerationRequest  # noqa: E402
from verify_worker.engine import SpeculativeEngine  # noqa: E402
from verify_worker.target_loader import load_target  # noqa: E402


def serve(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> tuple[list[float], list[list[int]]]:
    """The engine's decode step times (seconds; steps without a prompt chunk) and the outputs."""
    states = [engine.add(request) for request in requests]
    steps = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        if not engine.last_report.prefill_tokens:
            steps.append(time.perf_counter() - started)
    return steps, [s.output_ids for s in states]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="the C++ kernels' threads (the server: every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, kernel_threads=args.threads)
    rng = random.Random(0)
    vocab = min(target.config.vocab_size, 30000)
    engines = {"paged": SpeculativeEngine(target, max_requests=args.requests, max_model_len=args.max_model_len,
                                          prefix_caching=False),
               "slots": SpeculativeEngine(target, max_requests=args.requests, max_model_len=args.max_model_len,
                                          prefix_caching=False, page_size=None)}
    assert engines["paged"].pages is not None, "this target's cache is not paged here"
    steps: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for round_ in range(args.rounds):
        requests = [GenerationRequest(tuple(rng.randrange(vocab) for _ in range(args.prompt_tokens)), args.new_tokens,
                                      request_id=f"{round_}-{i}") for i in range(args.requests)]
        order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]  # neither always runs first
        for name in order:
            times, outputs[name] = serve(engines[name], requests)
            steps[name] += times
        if outputs["paged"] != outputs["slots"]:
            raise SystemExit(f"round {round_}: the paged engine's outputs differ from the slot engine's")
    tokens = args.requests
    print(f"{args.target}: {args.requests} requests of {args.prompt_tokens} prompt tokens, {args.new_tokens} new, "
          f"{args.rounds} rounds; outputs identical")
    print("| cache | median decode step (ms) | tokens/s |")
    print("| --- | --- | --- |")
    medians = {name: statistics.median(times) for name, times in steps.items()}
    for name, median in medians.items():
        print(f"| {name} | {median * 1e3:.1f} | {tokens / median:.1f} |")
    print(f"paged / slots step time: {medians['paged'] / medians['slots']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
