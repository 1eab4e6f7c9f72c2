"""The demo drafter: 1 layer initialised from the target's top layer, block size 16 (a quarter of the
blocks cut to 8 rows so it also serves block size 8), trained on target-regenerated continuations."""

from pathlib import Path

import torch

from demo_build.generate_data import generated_sequences
from draft_worker.draft_checkpoint import load_drafter, random_drafter
from shared.byte_tokenizer import MASK
from training.cli import examples_from, init_from_target, new_drafter_config, train
from training.trainer import TrainSettings
from verify_worker.target_loader import load_target


def train_demo_drafter(target_dir: Path, work: Path, out: Path, minutes: float, log=print) -> None:
    from tokenizers import Tokenizer

    target = load_target(target_dir, dtype="float32", pack=False)  # init_from_target reads the checkpoint names
    mask_id = Tokenizer.from_file(str(target_dir / "tokenizer.json")).token_to_id(MASK)
    examples = examples_from(generated_sequences(work))
    checkpoint = work / "drafter"
    if (checkpoint / "model.safetensors").exists():
        drafter = load_drafter(checkpoint)  # resume, optimizer state included (see DrafterTrainer.resume)
    elif (out / "model.safetensors").exists():
        drafter = load_drafter(out)  # warm start from the committed drafter (a fresh machine has no runs/)
        log(f"warm start from {out}")
    else:
        drafter = random_drafter(new_drafter_config(target, 1, 16, [1, 3, 5], mask_id), seed=0)
        init_from_target(drafter, target)
    settings = TrainSettings(anchors_per_sequence=48, lr=1e-3, soft_label_weight=0.5, short_block_probability=0.25,
                             minutes=minutes, checkpoint_every_s=300)
    report = train(target, drafter, examples, checkpoint, settings, val_fraction=0.03, log=log)
    from draft_worker.draft_checkpoint import save_drafter

    save_drafter(drafter, out, dtype=torch.bfloat16)
    (out / "validation.txt").write_text(str(report) + "\n")
    log(f"exported drafter to {out}")
