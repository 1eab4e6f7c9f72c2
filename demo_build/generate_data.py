"""Stage data: continuations of training-split prompts, decoded by the exported (bf16-rounded) target.

The data comes in shards of PROMPTS_PER_SHARD prompts, each with its own prompt seed (shard k: prompt windows
drawn with seed k, sampled continuations seeded from k * PROMPTS_PER_SHARD), so a build can add shards to the
ones it has without changing them. Shard 0 is generated.pt, shard k is generated-k.pt."""

from pathlib import Path

import torch

from training.regenerate import prompt_windows, regenerate
from verify_worker.target_loader import load_target

PROMPTS_PER_SHARD = 6000


def shard_path(work: Path, shard: int) -> Path:
    return work / ("generated.pt" if shard == 0 else f"generated-{shard}.pt")


def generate_corpus(target_dir: Path, train_ids: torch.Tensor, work: Path, minutes: float, shards: int,
                    log=print) -> None:
    """Write the missing shards of `shards`, each within `minutes` of decoding."""
    target = None
    for shard in range(shards):
        path = shard_path(work, shard)
        if path.exists():
            log(f"{path} exists: keeping it")
            continue
        target = target or load_target(target_dir, dtype="float32")
        prompts = prompt_windows(train_ids, PROMPTS_PER_SHARD, 24, 128, seed=shard)
        sequences = regenerate(target, prompts, new_tokens=192, minutes=minutes, batch=64,
                               seed=shard * PROMPTS_PER_SHARD, log=log)
        torch.save(sequences, path)


def generated_sequences(work: Path) -> list:
    """Every shard there is, in shard order ([(token ids, prompt length)]); shard 0 must exist."""
    sequences, shard = [], 0
    while shard_path(work, shard).exists():
        sequences += torch.load(shard_path(work, shard))
        shard += 1
    if not sequences:
        raise FileNotFoundError(f"no generated data in {work}: run the data stage first")
    return sequences
