"""The random demo pair: an UNTRAINED Qwen3-style target and DFlash drafter built on the fly.

It stands in for the embedded trained models until they exist: it exercises every code path (loading,
drafting, verification, the byte-level tokenizer) but its output is gibberish and its acceptance is near 0.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from draft_worker.draft_checkpoint import random_drafter, save_drafter
from shared.byte_tokenizer import END_OF_TEXT, MASK, write_byte_tokenizer
from shared.checkpoint_io import write_checkpoint
from shared.demo_models import random_pair_dir
from shared.draft_config import DraftConfig
from shared.rope_settings import RopeSettings
from verify_worker.families.llama.config import TargetConfig

VOCAB, EOS_ID, MASK_ID = 258, 256, 257


def random_target_config(num_layers: int = 6, hidden: int = 256) -> TargetConfig:
    return TargetConfig(
        family="qwen3", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6, rope=RopeSettings(theta=10000.0),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, max_position_embeddings=2048,
        checkpoint_dtype="float32", eos_token_ids=(EOS_ID,),
    )


def write_random_target(folder: Path, cfg: TargetConfig, seed: int = 0, std: float = 0.08) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in cfg.tensor_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * std
    write_checkpoint(folder, cfg.to_dict(), tensors)
    write_byte_tokenizer(folder)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT, "mask_token": MASK}
    (folder / "tokenizer_config.json").write_text(json.dumps(config) + "\n")  # tokenizer.json as it is, everywhere


def ensure_random_pair(root: Path | None = None) -> tuple[Path, Path]:
    """Build the pair once under root (default: the user cache) and return (target, drafter) folders."""
    root = Path(root or random_pair_dir())
    target_dir, draft_dir = root / "target", root / "draft"
    if not root.is_dir():
        building = root.with_name(f"{root.name}.building-{os.getpid()}")
        _build_pair(building)
        try:
            building.rename(root)  # atomic: a concurrent builder's finished pair wins, ours is dropped
        except OSError:
            shutil.rmtree(building, ignore_errors=True)
    return target_dir, draft_dir


def _build_pair(root: Path) -> None:
    target_dir, draft_dir = root / "target", root / "draft"
    cfg = random_target_config()
    write_random_target(target_dir, cfg)
    draft_cfg = DraftConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=1,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=VOCAB,
        num_target_layers=cfg.num_layers, target_layer_ids=(1, 3), mask_token_id=MASK_ID, block_size=8,
    )
    save_drafter(random_drafter(draft_cfg, seed=1), draft_dir)


if __name__ == "__main__":  # python -m demo_build.random_pair [ROOT]: what shared.demo_models runs
    ensure_random_pair(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
