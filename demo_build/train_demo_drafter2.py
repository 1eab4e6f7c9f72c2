"""The demo DFlash 2 drafter, in phases that each resume from their own folder under the work directory.

(1) The committed DFlash drafter (models/demo/draft) upgraded to DFlash 2 (identity convolutions, a fresh
    candidate selector with the published rank 256 and top-16); only the convolutions and the selector train,
    with the hard K-way selector loss (what the greedy walk needs).
(2) The selector alone, 70% of its loss matching the target's distribution over the whole vocabulary, so the q
    a sampled walk draws from approaches the target's p; sampled walks then use the top 1024 candidates.
(3) Everything (backbone included) at block size 8, the size the demo serves, with half of the selector's loss
    hard and half soft; three cosine cycles (lr 3e-4, then 2e-4 twice, each from the previous one's end).

Phases 1 and 2 keep the DFlash drafter's backbone, so comparing the two drafters after phase 2 measures what
the DFlash 2 additions bring; phase 3 then fine-tunes the whole drafter for serving at block 8."""

import dataclasses
from pathlib import Path

import torch

from demo_build.generate_data import generated_sequences
from draft_worker.draft_checkpoint import load_drafter, save_drafter
from shared.draft_config import DFlash2Settings
from training.cli import as_kind, examples_from, train
from training.trainer import TrainSettings
from verify_worker.target_loader import load_target

SAMPLE_TOP_K = 1024  # candidates of a sampled walk
GREEDY_TOP_K = 32  # candidates of a greedy walk at serving time (training's K-way loss keeps the published 16)
SERVED_BLOCK_SIZE = 8  # phase 3 trains, and the export declares, the block size the demo serves
# phase 3: (work folder, peak lr) of each cycle
JOINT_CYCLES = (("drafter2_joint", 3e-4), ("drafter2_joint2", 2e-4), ("drafter2_joint3", 2e-4))


def train_demo_drafter2(target_dir: Path, work: Path, dflash_dir: Path, out: Path, minutes: float,
                        soft_minutes: float, joint_minutes: list[float], log=print) -> None:
    target = load_target(target_dir, dtype="float32")
    examples = examples_from(generated_sequences(work))
    common = dict(anchors_per_sequence=48, lr=1e-3, soft_label_weight=0.5, short_block_probability=0.25,
                  selector_loss_weight=1.0, checkpoint_every_s=300)
    hard_dir, soft_dir = work / "drafter2", work / "drafter2_soft"
    joint_dirs = [work / name for name, _ in JOINT_CYCLES] if any(joint_minutes) else []  # all 0: no phase 3
    done = [d for d in (hard_dir, soft_dir, *joint_dirs) if (d / "model.safetensors").exists()]
    if done:
        drafter = load_drafter(done[-1])  # resume the latest phase begun (or start the next from its end)
    else:
        drafter = as_kind(load_drafter(dflash_dir), "dflash2", DFlash2Settings(), seed=0)
        log(f"DFlash 2 from {dflash_dir}: identity convolutions, new selector")
    if not any(d in done for d in (soft_dir, *joint_dirs)):
        phase1 = TrainSettings(**common, train_only=("conv", "candidate_selector"), minutes=minutes)
        train(target, drafter, examples, hard_dir, phase1, val_fraction=0.03, log=log)
    if not any(d in done for d in joint_dirs):
        log("phase 2: the selector against the target's distribution")
        phase2 = TrainSettings(**common, selector_soft_weight=0.7, train_only=("candidate_selector",),
                               minutes=soft_minutes)
        report = train(target, drafter, examples, soft_dir, phase2, val_fraction=0.03, log=log)
    if joint_dirs:
        drafter.config = dataclasses.replace(drafter.config, block_size=SERVED_BLOCK_SIZE)
        for cycle, ((name, lr), joint_dir) in enumerate(zip(JOINT_CYCLES, joint_dirs)):
            if any(d in done for d in joint_dirs[cycle + 1:]):
                continue  # this cycle is finished: a later one has begun
            log(f"phase 3 ({name}): the whole drafter at block size {SERVED_BLOCK_SIZE}, lr {lr:g}")
            phase3 = TrainSettings(anchors_per_sequence=64, lr=lr, soft_label_weight=0.5, selector_loss_weight=1.0,
                                   selector_soft_weight=0.5, minutes=joint_minutes[cycle], checkpoint_every_s=300)
            report = train(target, drafter, examples, joint_dir, phase3, val_fraction=0.03, log=log)
    # report is set: the last phase always runs (a finished one resumes, trains no step and validates).
    vocab = drafter.config.vocab_size
    candidates = dataclasses.replace(drafter.config.dflash2, selector_top_k=min(GREEDY_TOP_K, vocab),
                                     selector_sample_top_k=min(SAMPLE_TOP_K, vocab))
    drafter.config = dataclasses.replace(drafter.config, dflash2=candidates)
    save_drafter(drafter, out, dtype=torch.bfloat16)
    (out / "validation.txt").write_text(str(report) + "\n")
    log(f"exported DFlash 2 drafter to {out}")
