"""Structured outputs on the demo pair, in process: acceptance and tok/s under 20 JSON schemas with the drafter
drafting under the grammar (the default), and with a drafter unaware of it: the target's logits masked only, drafts
cut at their first refused token, forced tokens proposed too; beside the same prompts unconstrained; the grammar's share of a step (masks, forced tokens, commits) at batch 1 and 16; and
what the gateway's compiler does with schema bombs (outcome, time).

    python benchmarks/structured_outputs.py [--drafter draft2|draft] [--max-tokens 96] [--rounds 3]
    python benchmarks/structured_outputs.py --target /tmp/q06 --batches 1,16   # a real size, plain decoding only

Greedy; every constrained run's tokens are checked equal to constrained plain decoding's. With --target (a
checkpoint with a tokenizer.json, e.g. benchmarks/random_checkpoint.py's) only plain decoding runs, constrained
and not: what the grammar's masks cost a step of that size; and what drafting under the grammar adds to a draft
call at that vocabulary (random logits: the worst case).
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from structured_schemas import SCHEMAS  # noqa: E402

from draft_worker import local_proposer  # noqa: E402
from draft_worker.draft_checkpoint import load_drafter  # noqa: E402
from draft_worker.local_proposer import LocalProposer  # noqa: E402
from gateway.schemas import ApiError  # noqa: E402
from gateway.structured_outputs import Constraint, GrammarCompiler, grammar_text  # noqa: E402
from shared.config_json import read_config  # noqa: E402
from shared.demo_models import DEMO_DIR  # noqa: E402
from shared.generation_request import GenerationRequest  # noqa: E402
from shared.grammar import folder_vocabulary  # noqa: E402
from shared.target_facts import TargetFacts  # noqa: E402
from verify_worker.engine import SpeculativeEngine  # noqa: E402
from verify_worker.engine import core, verify_inputs  # noqa: E402
from verify_worker.spec_policy import AdaptiveSpeculation  # noqa: E402
from verify_worker.target_loader import load_target  # noqa: E402

PROMPT = "Answer in JSON.\n"


class GrammarClock:
    """Time spent in the grammar's work of a step: masks (verify_inputs), forced tokens and cuts (core), drafts
    under the grammar (local_proposer's masked_drafts, tokens they take included), commits taking tokens
    (GrammarMatcher.take), summed over a run."""

    def __init__(self):
        self.seconds = 0.0
        self.depth = 0
        self.saved = []

    def wrap(self, module, name):
        original = getattr(module, name)

        def timed(*args, **kwargs):
            if self.depth:  # inside another timed call (a draft's takes): counted there
                return original(*args, **kwargs)
            self.depth += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.depth -= 1

        self.saved.append((module, name, original))
        setattr(module, name, timed)

    def __enter__(self):
        self.wrap(verify_inputs, "mask_grammars")
        self.wrap(core, "grammar_drafts")
        self.wrap(local_proposer, "masked_drafts")
        from shared.grammar_matcher import GrammarMatcher
        self.wrap(GrammarMatcher, "take")
        return self

    def __exit__(self, *exc):
        for module, name, original in self.saved:
            setattr(module, name, original)


def run(target, proposer, requests, vocabulary, mode, adaptive=False):
    engine = SpeculativeEngine(target, proposer, max_requests=len(requests), max_model_len=1024,
                               grammar_vocabulary=vocabulary, grammar_drafts=mode,
                               policy=AdaptiveSpeculation() if adaptive else None)
    with GrammarClock() as clock:
        started = time.perf_counter()
        results = engine.generate(requests)
        seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.verify_steps for r in results)
    committed = sum(r.stats.committed_tokens for r in results)
    return results, tokens / seconds, committed / max(steps, 1), clock.seconds / seconds


class RandomSelector(torch.nn.Module):
    """A DFlash 2 candidate selector's codebooks at a vocabulary (random: the walk's cost, not its choices)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.predecessor_codebook = torch.nn.Parameter(torch.randn(vocab, rank) * 0.1)
        self.successor_codebook = torch.nn.Parameter(torch.randn(vocab, rank) * 0.1)


class RandomWalker:
    def __init__(self, vocab: int, rank: int):
        self.candidate_selector = RandomSelector(vocab, rank)

    def candidates(self, logits, k):
        return logits.topk(k, dim=-1)


def draft_cost(vocabulary, grammars: list[str], vocab: int, drafts: int = 7, rounds: int = 20) -> None:
    """What drafting under a grammar takes of a draft call at this vocabulary, per block of `drafts` positions: the
    DFlash argmax and the DFlash 2 greedy walk (rank 256, 32 candidates; its top-32 of each position included, which
    an unconstrained walk computes too) over random logits, so that every position takes the whole mask (the
    drafter's own choice refused: the worst case). Medians over the schemas and rounds."""
    from draft_worker.grammar_drafting import masked_drafts, token_chooser, walk_chooser
    from shared.grammar_matcher import CompiledGrammars
    from shared.sampling_params import SamplingParams

    compiled, walker = CompiledGrammars(vocabulary), RandomWalker(vocab, 256)
    generator = torch.Generator().manual_seed(0)
    print(f"\n| drafts under the grammar, a block of {drafts} at vocabulary {vocab} | ms a block (median) | drafts |")
    print("| --- | --- | --- |")
    for name in ("DFlash argmax", "DFlash 2 greedy walk"):
        times, counts = [], []
        for grammar in grammars:
            matcher = compiled.matcher(grammar)
            for _ in range(rounds):
                logits = torch.randn(drafts, vocab, generator=generator)
                projected = torch.randn(drafts, 256, generator=generator)
                started = time.perf_counter()
                choose = (token_chooser(SamplingParams(), None, None) if name == "DFlash argmax" else
                          walk_chooser(walker, projected, logits, 0.0, None, 32))
                result = masked_drafts(matcher, logits, drafts, 0, choose)
                times.append(time.perf_counter() - started)
                counts.append(len(result.tokens))
        print(f"| {name} | {statistics.median(times) * 1e3:.2f} | {statistics.median(counts)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="draft2", choices=("draft2", "draft"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target", default=None, help="another target folder: plain decoding only")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target) if args.target else DEMO_DIR / "target"
    target = load_target(target_dir)
    eos = TargetFacts.from_config(read_config(target_dir)).eos_token_ids
    vocabulary = folder_vocabulary(target_dir, target.config.vocab_size, eos)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    stops = tuple(vocabulary.eos_tokens)
    prompt = tuple(tokenizer.encode(PROMPT).ids)
    grammars = [grammar_text(Constraint("json_schema", schema, "bench")) for schema in SCHEMAS]
    drafter = None if args.target else load_drafter(DEMO_DIR / args.drafter)
    print(f"{target_dir}, {args.drafter if drafter else 'no drafter'}, {len(SCHEMAS)} schemas, {args.max_tokens} tokens at most, greedy, medians of "
          f"{args.rounds} rounds")
    print("| batch | setup | tok/s | tokens a step | grammar's share of the time | equal to plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in args.batches.split(",")):
        constrained = [GenerationRequest(prompt, args.max_tokens, stop_token_ids=stops, grammar=g) for g in grammars]
        free = [GenerationRequest(prompt, args.max_tokens, stop_token_ids=stops) for _ in grammars]
        groups = [constrained[i:i + batch] for i in range(0, len(constrained), batch)]
        free_groups = [free[i:i + batch] for i in range(0, len(free), batch)]
        plain = [r.token_ids for group in groups for r in run(target, None, group, vocabulary, "forced")[0]]
        # (name, grammar drafts mode, requests, adaptive policy, the drafter drafts under the grammar)
        setups = [("unconstrained, every step drafts", None, free_groups, False, False),
                  ("unconstrained, adaptive policy (the default)", None, free_groups, True, False),
                  ("constrained plain", None, groups, False, False),
                  ("drafter unaware: masks on the target only, every step drafts", "target", groups, False, False),
                  ("drafter unaware: drafts cut, every step drafts", "cut", groups, False, False),
                  ("drafter unaware: drafts cut + forced tokens, every step drafts", "forced", groups, False, False),
                  ("drafter unaware: drafts cut + forced tokens, adaptive policy (the default)", "forced", groups,
                   True, False),
                  ("drafts under the grammar, forced rows drafted too, every step drafts", "drafted", groups, False,
                   True),
                  ("drafts under the grammar + forced tokens, every step drafts", "masked", groups, False, True),
                  ("drafts under the grammar + forced tokens, adaptive policy", "masked", groups, True, True)]
        if drafter is None:
            setups = [("unconstrained plain", None, free_groups, False, False),
                      ("constrained plain", None, groups, False, False)]
        for name, mode, chosen, adaptive, aware in setups:
            figures = []
            for _ in range(args.rounds):
                proposer = None if drafter is None or name == "constrained plain" else LocalProposer(
                    drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=batch,
                    max_model_len=1024, grammar_vocabulary=vocabulary if aware else None)
                outs = [run(target, proposer, group, vocabulary, mode or "forced", adaptive) for group in chosen]
                tokens = [r.token_ids for out in outs for r in out[0]]
                figures.append((statistics.median(o[1] for o in outs), statistics.median(o[2] for o in outs),
                                statistics.median(o[3] for o in outs), tokens == plain))
            speed, per_step, share = (statistics.median(f[i] for f in figures) for i in range(3))
            equal = all(f[3] for f in figures)
            same = "-" if name.startswith("unconstrained") else ("yes" if equal else "NO")
            print(f"| {batch} | {name} | {speed:.1f} | {per_step:.2f} | {share:.1%} | {same} |")
    if drafter is None:
        draft_cost(vocabulary, grammars, target.config.vocab_size)
    compiler = GrammarCompiler(tokenizer, target.config.vocab_size, stops)
    deep: dict = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    bombs = {"nested 300 deep": deep,
             "enum of 4,000 strings": {"enum": [f"v{i:05d}" + "x" * 40 for i in range(4000)]},
             "enum of 6,000 long strings (over the size bound)": {"enum": [f"v{i:06d}-" + "x" * 40
                                                                           for i in range(6000)]},
             "pathological pattern": {"type": "string", "pattern": "^((a+)+|(b+)+)+(c{1,1000}){1,1000}$"}}
    print("\n| schema bomb | outcome | seconds |")
    print("| --- | --- | --- |")
    for name, schema in bombs.items():
        started = time.perf_counter()
        try:
            asyncio.run(compiler.grammar(Constraint("json_schema", schema, "response_format")))
            outcome = "compiled"
        except ApiError as exc:
            outcome = f"400: {exc.message[:110]}"
        print(f"| {name} | {outcome} | {time.perf_counter() - started:.3f} |")


if __name__ == "__main__":
    main()
