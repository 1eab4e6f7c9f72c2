"""The memory plan (verify_worker/memory_plan.py) of the published configs (benchmarks/published_configs: GLM-5.3-Flash,
GLM-5.2, GLM-5.2-FP8, Qwen3-8B) at TP 1/2/4/8 on one GPU size, read from config.json alone: the
table of docs/serving.md.

    python benchmarks/memory_plans.py [--gpu-memory-gb 141] [--context 32768] [--max-running 64] [--taps 5]
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verify_worker.memory_plan import GB, GIB, PlanRequest, make_plan, refusal  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "published_configs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-gb", type=float, default=141.0, help="one GPU's memory (H200: 141)")
    parser.add_argument("--context", type=int, default=32768, help="--max-model-len")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--taps", type=int, default=5, help="target layers fed to the drafter")
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--tp", default="1,2,4,8")
    args = parser.parse_args()
    print(f"one GPU of {args.gpu_memory_gb:g} GB; --max-model-len {args.context}, --max-running {args.max_running}, "
          f"{args.taps} taps, block {args.block}; bfloat16 weights, FP8 ones kept FP8\n")
    print("| model | TP | weights / GPU (GiB) | one request (GiB) | activations (GiB) | requests that fit | plan |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in sorted(CONFIGS.glob("*.json")):
        config = json.loads(path.read_text())
        for tp in (int(v) for v in args.tp.split(",")):
            request = PlanRequest(config, None, tp, args.context, args.max_running, 512, args.block, "auto", "cuda",
                                  int(args.gpu_memory_gb * GB), False, False, taps=args.taps)
            try:
                plan = make_plan(request)
            except Exception as exc:  # a width the TP does not divide
                print(f"| {path.stem} | {tp} | - | - | - | - | {exc} |")
                continue
            why = refusal(plan)
            print(f"| {path.stem} | {tp} | {sum(plan.weights.values()) / GIB:.1f} | {plan.request_total / GIB:.3f} | "
                  f"{plan.activations / GIB:.2f} | {plan.fitting_requests} | {'fits' if why is None else why} |")


if __name__ == "__main__":
    main()
