"""How often the twin target (python -m demo_build.twin) gives the demo target's greedy output on the held-out
prompts, and where not, the first differing token and the demo's top-2 logit gap there (a near-tie the twin's
rounding may break the other way).

    python benchmarks/twin_agreement.py --twin /tmp/twin-1.7b [--demo models/demo] [--num-prompts 48]
        [--max-tokens 64] [--batch 8]
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    import torch
    from tokenizers import Tokenizer

    from client.bench import first_divergence
    from shared.generation_request import GenerationRequest
    from verify_worker.engine import SpeculativeEngine
    from verify_worker.target_loader import load_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--twin", required=True, help="the folder demo_build.twin wrote")
    parser.add_argument("--demo", default=str(ROOT / "models" / "demo"))
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts_heldout.json"))
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)

    tokenizer = Tokenizer.from_file(str(Path(args.demo) / "target" / "tokenizer.json"))
    texts = [r["prompt"] for r in json.loads(Path(args.prompts).read_text())][:args.num_prompts]
    requests = [GenerationRequest(tuple(tokenizer.encode(t).ids), args.max_tokens) for t in texts]
    outputs, demo = {}, None
    for name, folder in (("demo", Path(args.demo) / "target"), ("twin", Path(args.twin) / "target")):
        target = load_target(folder)
        demo = demo or target
        started = time.perf_counter()
        engine = SpeculativeEngine(target, None, max_requests=args.batch, max_model_len=1024)
        outputs[name] = [r.token_ids for r in engine.generate(requests)]
        tokens = sum(map(len, outputs[name]))
        print(f"{name}: {tokens} tokens in {time.perf_counter() - started:.1f} s", flush=True)
        del engine
    same = 0
    for index, (request, want, got) in enumerate(zip(requests, outputs["demo"], outputs["twin"])):
        first = first_divergence(got, want)
        if first is None:
            same += 1
            continue
        prefix = list(request.prompt_ids) + list(want[:first])
        cache = demo.new_cache(1, len(prefix) + 1)
        hidden = demo(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, torch.tensor([0])).hidden
        top = demo.logits(hidden[0, -1]).topk(2)
        print(f"prompt {index}: differs at token {first} (demo {want[first] if first < len(want) else None}, "
              f"twin {got[first] if first < len(got) else None}); the demo's top-2 logits there "
              f"{top.values[0]:.4f} and {top.values[1]:.4f} (gap {float(top.values[0] - top.values[1]):.2g})")
    print(f"greedy output equal to the demo's on {same} of {len(requests)} prompts ({args.max_tokens} tokens each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
