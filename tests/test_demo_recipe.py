"""The demo DFlash 2 recipe (demo_build/train_demo_drafter2.py) on a tiny random pair, a few seconds per phase:
every phase runs and leaves its checkpoint, the export declares the served block size, and a rerun resumes
instead of starting over."""

import json

import pytest
import torch
from conftest import tiny_draft_config

from demo_build.generate_data import generated_sequences
from demo_build.train_demo_drafter2 import (
    GREEDY_TOP_K,
    JOINT_CYCLES,
    SAMPLE_TOP_K,
    SERVED_BLOCK_SIZE,
    train_demo_drafter2,
)
from draft_worker.draft_checkpoint import random_drafter, save_drafter

PHASE_MINUTES = 0.02  # about a second of training per phase
JOINT_MINUTES = [PHASE_MINUTES] * len(JOINT_CYCLES)


def _prepare(tmp_path, target_folder):
    work, dflash_dir, out = tmp_path / "work", tmp_path / "draft", tmp_path / "draft2"
    work.mkdir()
    save_drafter(random_drafter(tiny_draft_config(block_size=16), seed=3), dflash_dir)
    generator = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, 120, (40,), generator=generator).tolist(), 8) for _ in range(12)]
    torch.save(sequences[:8], work / "generated.pt")  # two data shards
    torch.save(sequences[8:], work / "generated-1.pt")
    return work, dflash_dir, out


def _steps(folder):
    return torch.load(folder / "trainer_state.pt", weights_only=False)["step"]


def _exported(out):
    return json.loads((out / "config.json").read_text())


def test_demo_dflash2_recipe_runs_every_phase_and_resumes(tmp_path, qwen3_pair):
    _, _, _, target_folder = qwen3_pair
    work, dflash_dir, out = _prepare(tmp_path, target_folder)
    lines = []
    train_demo_drafter2(target_folder, work, dflash_dir, out, PHASE_MINUTES, PHASE_MINUTES, JOINT_MINUTES,
                        log=lines.append)
    for folder in ("drafter2", "drafter2_soft", *(name for name, _ in JOINT_CYCLES)):
        assert (work / folder / "model.safetensors").is_file(), folder
    config = _exported(out)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == SERVED_BLOCK_SIZE
    assert config["dflash_config"]["selector_sample_top_k"] == min(SAMPLE_TOP_K, config["vocab_size"])
    assert config["dflash_config"]["selector_top_k"] == min(GREEDY_TOP_K, config["vocab_size"])
    assert "acceptance_length_walk" in (out / "validation.txt").read_text()
    assert sum("phase 3" in line for line in lines) == len(JOINT_CYCLES)

    # Everything is done: a rerun resumes each finished phase, trains no further step and exports the same drafter.
    steps = {name: _steps(work / name) for name, _ in JOINT_CYCLES}
    exported = (out / "model.safetensors").read_bytes()
    (out / "validation.txt").unlink()
    train_demo_drafter2(target_folder, work, dflash_dir, out, PHASE_MINUTES, PHASE_MINUTES, JOINT_MINUTES,
                        log=lambda _: None)
    assert {name: _steps(work / name) for name, _ in JOINT_CYCLES} == steps
    assert (out / "model.safetensors").read_bytes() == exported and (out / "validation.txt").is_file()

    # --drafter2-joint-minutes 0 skips phase 3 even when its checkpoints exist: the phase-2 drafter (block 16).
    train_demo_drafter2(target_folder, work, dflash_dir, out, PHASE_MINUTES, PHASE_MINUTES, [0] * len(JOINT_CYCLES),
                        log=lambda _: None)
    assert _exported(out)["block_size"] == 16


def test_generated_data_is_read_shard_by_shard_in_order(tmp_path):
    torch.save([([1, 2, 3], 1)], tmp_path / "generated.pt")
    torch.save([([4, 5], 1)], tmp_path / "generated-1.pt")
    torch.save([([9], 0)], tmp_path / "generated-3.pt")  # shard 2 missing: shards stop at the first gap
    assert generated_sequences(tmp_path) == [([1, 2, 3], 1), ([4, 5], 1)]
    (tmp_path / "generated.pt").unlink()
    with pytest.raises(FileNotFoundError, match="run the data stage"):
        generated_sequences(tmp_path)
