"""python -m demo_build [stage ...]: build the demo pair. Stages run in order and resume from runs/demo/.

  tokenizer  train the BPE tokenizer on the training split
  target     pretrain the target (--target-minutes) and export models/demo/target
  data       generate target continuations with our engine (--data-shards of up to 6000 prompts each,
             at most --data-minutes each)
  drafter    train the DFlash drafter (--drafter-minutes) and export models/demo/draft
  drafter2   train the DFlash 2 additions on top of it (--drafter2-minutes, then --selector-soft-minutes of the
             selector alone against the target's distribution, then three cycles of the whole drafter at block size 8,
             --drafter2-joint-minutes each), export models/demo/draft2
  prompts    write the held-out benchmark prompts (benchmarks/prompts_heldout.json)
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from demo_build.corpus import read_text, split

STAGES = ("tokenizer", "target", "data", "drafter", "drafter2", "prompts")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def tokenize_split(tokenizer, files, eos_id: int) -> torch.Tensor:
    ids = []
    for path in files:
        ids += tokenizer.encode(read_text(path)).ids + [eos_id]
    return torch.tensor(ids, dtype=torch.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="*", default=list(STAGES), choices=[*STAGES, []])
    parser.add_argument("--work", default="runs/demo", help="checkpoints and generated data (not committed)")
    parser.add_argument("--out", default="models/demo", help="where the finished pair goes")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--target-minutes", type=float, default=40)
    parser.add_argument("--data-minutes", type=float, default=15, help="time limit of each data shard")
    parser.add_argument("--data-shards", type=int, default=3,
                        help="shards of target continuations (6000 prompts each; existing shards are kept)")
    parser.add_argument("--drafter-minutes", type=float, default=45)
    parser.add_argument("--drafter2-minutes", type=float, default=25)
    parser.add_argument("--selector-soft-minutes", type=float, default=15)
    parser.add_argument("--drafter2-joint-minutes", type=float, nargs=3, default=[35, 35, 50],
                        help="minutes of each of the three cycles of DFlash 2 phase 3, the whole drafter at block 8 "
                             "(0 0 0 skips the phase)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    train_files, held_files = split()
    log(f"corpus: {len(train_files)} training files, {len(held_files)} held out")

    if "tokenizer" in args.stages:
        from demo_build.tokenizer import train_tokenizer, write_tokenizer_files

        tokenizer = train_tokenizer(train_files, args.vocab_size)
        write_tokenizer_files(tokenizer, out / "target")
        log(f"tokenizer: {tokenizer.get_vocab_size()} tokens")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    ids_path = work / "token_ids.pt"
    if not ids_path.exists():
        torch.save({"train": tokenize_split(tokenizer, train_files, eos_id),
                    "val": tokenize_split(tokenizer, held_files, eos_id)}, ids_path)
    ids = torch.load(ids_path)
    log(f"tokens: {len(ids['train'])} training, {len(ids['val'])} held out")

    if "target" in args.stages:
        from demo_build.pretrain import demo_target_config, export_target, pretrain

        cfg = demo_target_config(tokenizer.get_vocab_size(), eos_id)
        model = pretrain(ids["train"].long(), ids["val"].long(), cfg, work / "pretrain.pt", args.target_minutes, log=log)
        export_target(model, cfg, out / "target")
        log(f"exported target to {out / 'target'}")

    if "data" in args.stages:
        from demo_build.generate_data import generate_corpus

        generate_corpus(out / "target", ids["train"].long(), work, args.data_minutes, args.data_shards, log=log)

    if "drafter" in args.stages:
        from demo_build.train_demo_drafter import train_demo_drafter

        train_demo_drafter(out / "target", work, out / "draft", args.drafter_minutes, log=log)

    if "drafter2" in args.stages:
        from demo_build.train_demo_drafter2 import train_demo_drafter2

        train_demo_drafter2(out / "target", work, out / "draft", out / "draft2", args.drafter2_minutes,
                            args.selector_soft_minutes, args.drafter2_joint_minutes, log=log)

    if "prompts" in args.stages:
        from demo_build.prompts import heldout_prompts

        prompts = heldout_prompts(held_files)
        Path("benchmarks/prompts_heldout.json").write_text(json.dumps(prompts, indent=1) + "\n")
        log(f"wrote {len(prompts)} held-out prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
