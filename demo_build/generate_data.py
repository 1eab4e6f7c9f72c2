"""Stage data: continuations of training-split prompts, decoded by the exported (bf16-rounded) target."""

from pathlib import Path

import torch

from draft_worker.training.regenerate import prompt_windows, regenerate
from verify_worker.target_loader import load_target


def generate_corpus(target_dir: Path, train_ids: torch.Tensor, work: Path, minutes: float, log=print) -> None:
    path = work.with_suffix(".pt")
    if path.exists():
        log(f"{path} exists: keeping it")
        return
    target = load_target(target_dir, dtype="float32")
    prompts = prompt_windows(train_ids, 6000, 24, 128, seed=0)
    sequences = regenerate(target, prompts, new_tokens=192, minutes=minutes, batch=64, log=log)
    torch.save(sequences, path)
