"""The demo DFlash 2 drafter: the committed DFlash drafter (models/demo/draft) upgraded to DFlash 2 (identity
convolutions, a fresh candidate selector with the published rank 256 and top-16), of which only the
convolutions and the selector are trained, on the same target-regenerated data. The backbone stays exactly
the DFlash drafter's, so a comparison of the two measures what the DFlash 2 additions bring.

Two phases: (1) convolutions and selector with the hard K-way selector loss (what the greedy walk needs);
(2) the selector alone, 70% of its loss matching the target's distribution over the whole vocabulary, so the
q a sampled walk draws from approaches the target's p; sampled walks then use the top 1024 candidates."""

from pathlib import Path

import torch

from draft_worker.draft_checkpoint import load_drafter, save_drafter
from draft_worker.draft_config import DFlash2Settings
from draft_worker.train_cli import as_kind, examples_from, train, with_sample_top_k
from draft_worker.training.trainer import TrainSettings
from verify_worker.target_loader import load_target

SAMPLE_TOP_K = 1024  # candidates of a sampled walk (greedy walks keep the published top-16)


def train_demo_drafter2(target_dir: Path, work: Path, dflash_dir: Path, out: Path, minutes: float,
                        soft_minutes: float, log=print) -> None:
    target = load_target(target_dir)
    examples = examples_from(torch.load(work / "generated.pt"))
    common = dict(anchors_per_sequence=48, lr=1e-3, soft_label_weight=0.5, short_block_probability=0.25,
                  selector_loss_weight=1.0, checkpoint_every_s=300)
    hard_dir, soft_dir = work / "drafter2", work / "drafter2_soft"
    if (soft_dir / "model.safetensors").exists():
        drafter = load_drafter(soft_dir)  # resume phase 2
    elif (hard_dir / "model.safetensors").exists():
        drafter = load_drafter(hard_dir)  # resume phase 1 (or start phase 2 from its end)
    else:
        drafter = as_kind(load_drafter(dflash_dir), "dflash2", DFlash2Settings(), seed=0)
        log(f"DFlash 2 from {dflash_dir}: identity convolutions, new selector")
    if not (soft_dir / "model.safetensors").exists():
        phase1 = TrainSettings(**common, train_only=("conv", "candidate_selector"), minutes=minutes)
        train(target, drafter, examples, hard_dir, phase1, val_fraction=0.03, log=log)
    log("phase 2: the selector against the target's distribution")
    phase2 = TrainSettings(**common, selector_soft_weight=0.7, train_only=("candidate_selector",),
                           minutes=soft_minutes)
    report = train(target, drafter, examples, soft_dir, phase2, val_fraction=0.03, log=log)
    drafter.config = with_sample_top_k(drafter.config, SAMPLE_TOP_K)
    save_drafter(drafter, out, dtype=torch.bfloat16)
    (out / "validation.txt").write_text(str(report) + "\n")
    log(f"exported DFlash 2 drafter to {out}")
