"""The demo drafter: 2 layers, block size 16 (a quarter of the blocks cut to 8 rows so it also serves block
size 8), trained on the greedy target-regenerated continuations (the sampled third is left out: the demo's
headline figure is greedy acceptance). A 1-layer drafter found in the work folder or in models/ is grown to 2
layers by appending an identity-initialised layer, so its training is kept."""

from pathlib import Path

import torch

from draft_worker.train_cli import examples_from, grow_drafter, init_from_target, new_drafter_config, train
from draft_worker.training.regenerate import is_sampled
from draft_worker.draft_checkpoint import load_drafter, random_drafter
from draft_worker.training.trainer import TrainSettings
from shared.byte_tokenizer import MASK
from verify_worker.target_loader import load_target


LAYERS = 2
LR = 5e-4


def train_demo_drafter(target_dir: Path, work: Path, out: Path, minutes: float, log=print) -> None:
    from tokenizers import Tokenizer

    target = load_target(target_dir)
    mask_id = Tokenizer.from_file(str(target_dir / "tokenizer.json")).token_to_id(MASK)
    sequences = torch.load(work / "generated.pt")
    examples = examples_from([s for i, s in enumerate(sequences) if not is_sampled(i)])
    checkpoint = work / "drafter"
    if (checkpoint / "model.safetensors").exists():
        drafter = load_drafter(checkpoint)  # resume, optimizer state included (see DrafterTrainer.resume)
    elif (out / "model.safetensors").exists():
        drafter = load_drafter(out)  # warm start from the committed drafter (a fresh machine has no runs/)
        log(f"warm start from {out}")
    else:
        drafter = random_drafter(new_drafter_config(target, LAYERS, 16, [1, 3, 5], mask_id), seed=0)
        init_from_target(drafter, target)
    if drafter.config.num_layers < LAYERS:
        drafter = grow_drafter(drafter.float(), target, LAYERS)
        log(f"grew the drafter to {LAYERS} layers (the new one starts as the identity)")
    settings = TrainSettings(anchors_per_sequence=96, lr=LR, soft_label_weight=0.5, short_block_probability=0.25,
                             minutes=minutes, checkpoint_every_s=300)
    report = train(target, drafter, examples, checkpoint, settings, val_fraction=0.03, log=log)
    from draft_worker.draft_checkpoint import save_drafter

    save_drafter(drafter, out, dtype=torch.bfloat16)
    (out / "validation.txt").write_text(str(report) + "\n")
    log(f"exported drafter to {out}")
