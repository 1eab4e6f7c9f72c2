"""dflash-generate: offline generation in one process, for quick checks and benchmarks."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import DraftSampling, LocalProposer
from shared.config_json import read_config
from shared.demo_models import default_pair
from shared.errors import ConfigError, DFlashError, RequestError
from shared.generation_request import GenerationRequest
from shared.packed_linear import kernel_layout
from shared.role import usable_cores
from shared.sampling_params import SamplingParams
from shared.settings.commands import GenerateCommand
from shared.settings.options import build_parser, parse_command
from shared.target_facts import TargetFacts
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import batch_invariant_refusal, load_target

DEMO_PROMPT = "def fibonacci(n):\n"


def parse_args(argv) -> argparse.Namespace:
    """The model and compute flags come from the settings (shared.settings: GenerateCommand), checked there."""
    parser = build_parser(GenerateCommand, "dflash-generate", __doc__)
    prompt = parser.add_argument_group("prompt and sampling").add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the target folder)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-spec", action="store_true", help="plain decoding: one target forward per token")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    parser.add_argument("--logprobs", type=int, default=None, metavar="K",
                        help="with --json: each token's log-probability under the target (before temperature, "
                             "top-p, top-k) and its K most likely alternatives (0-20)")
    return parse_command(GenerateCommand, parser, argv)[1]


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(part) for part in args.prompt_ids.split(",") if part.strip()]
        except ValueError:
            raise RequestError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    text = args.prompt if args.prompt is not None else DEMO_PROMPT
    if tokenizer is None:
        raise RequestError("the target folder has no tokenizer.json: pass --prompt-ids instead of --prompt")
    return tokenizer.encode(text).ids


def _load_tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        raise ConfigError(f"cannot read {str(path)!r}: {exc}") from None


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_tokens < 1:
        raise RequestError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    target_path, draft_path = (Path(args.target), Path(args.draft) if args.draft else None) if args.target else (None, None)
    if target_path is None:
        target_path, draft_path, label, _ = default_pair(args.draft)
        print(f"note: no --target given: using {label}", file=sys.stderr)
    if args.batch_invariant and batch_invariant_refusal(args.device):
        raise ConfigError(batch_invariant_refusal(args.device))
    target = load_target(target_path, device=args.device, dtype=args.dtype, kernel_threads=usable_cores(),
                         batch_invariant=args.batch_invariant)
    if not args.threads and getattr(target, "kernels", None) is not None:  # the target's step on the C++ kernels:
        torch.set_num_threads(1)  # idle PyTorch threads spinning beside their pool slow it
    tokenizer = _load_tokenizer(target_path)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    proposer = None
    if draft_path is not None and not args.no_spec:
        drafter = load_drafter(draft_path, dtype=target.embed_weight.dtype, device=args.device)
        proposer = LocalProposer(
            drafter, target.embed_weight, target.lm_head_weight, block_size=args.block_size, max_requests=1,
            max_model_len=target.config.max_position_embeddings, draft_sampling=DraftSampling(args.draft_sampling),
            layout=kernel_layout(args.dtype, TargetFacts.from_config(read_config(target_path)).checkpoint_dtype,
                                 args.device),
        )
        # its calls and the target's alternate, as in the server: the target's pool where it has one
        proposer.share_kernel_threads(usable_cores(), getattr(target, "pool", None))
    engine = SpeculativeEngine(target, proposer, max_requests=1)
    stops = () if args.ignore_eos else target.config.eos_token_ids
    request = GenerationRequest(tuple(_prompt_ids(args, tokenizer)), args.max_tokens, sampling, stops,
                                logprobs=args.logprobs)
    started = time.perf_counter()
    result = engine.generate([request])[0]
    elapsed = time.perf_counter() - started
    stats = result.stats.as_dict()
    stats["tokens_per_second"] = round(len(result.token_ids) / elapsed, 3)
    report = {"token_ids": result.token_ids, "stats": stats}
    if result.logprobs is not None:
        report["logprobs"] = [{"logprob": t.logprob, "top": [[i, v] for i, v in zip(t.top_ids, t.top_logprobs)]}
                              for t in result.logprobs]
    if tokenizer is not None:
        report["text"] = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return report


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse has printed what is wrong
        return exc.code
    try:
        report = run(args)
    except DFlashError as exc:
        print(f"dflash-generate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print(report.get("text", " ".join(map(str, report["token_ids"]))))
        print(json.dumps(report["stats"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
