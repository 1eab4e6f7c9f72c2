"""The demo DFlash 2 drafter: the committed DFlash drafter (models/demo/draft) upgraded to DFlash 2 (identity
convolutions, a fresh candidate selector with the published rank 256 and top-16), of which only the
convolutions and the selector are trained, on the same target-regenerated data. The backbone stays exactly
the DFlash drafter's, so a comparison of the two measures what the DFlash 2 additions bring."""

from pathlib import Path

import torch

from draft_worker.draft_checkpoint import load_drafter, save_drafter
from draft_worker.draft_config import DFlash2Settings
from draft_worker.train_cli import as_kind, examples_from, train
from draft_worker.training.trainer import TrainSettings
from verify_worker.target_loader import load_target


def train_demo_drafter2(target_dir: Path, work: Path, dflash_dir: Path, out: Path, minutes: float, log=print) -> None:
    target = load_target(target_dir)
    examples = examples_from(torch.load(work / "generated.pt"))
    checkpoint = work / "drafter2"
    if (checkpoint / "model.safetensors").exists():
        drafter = load_drafter(checkpoint)  # resume, optimizer state included
    else:
        drafter = as_kind(load_drafter(dflash_dir), "dflash2", DFlash2Settings(), seed=0)
        log(f"DFlash 2 from {dflash_dir}: identity convolutions, new selector")
    settings = TrainSettings(anchors_per_sequence=48, lr=1e-3, soft_label_weight=0.5, short_block_probability=0.25,
                             selector_loss_weight=1.0, train_only=("conv", "candidate_selector"),
                             minutes=minutes, checkpoint_every_s=300)
    report = train(target, drafter, examples, checkpoint, settings, val_fraction=0.03, log=log)
    save_drafter(drafter, out, dtype=torch.bfloat16)
    (out / "validation.txt").write_text(str(report) + "\n")
    log(f"exported DFlash 2 drafter to {out}")
