"""Shared fixtures: tiny HF checkpoints written by transformers, and tiny DFlash drafters.

Weights are drawn with a large std so logits are far from tied (greedy comparisons between batched and
unbatched arithmetic then only diverge at a genuine near-tie, which the tests check explicitly).
"""

import pytest
import torch

from draft_worker.draft_checkpoint import random_drafter
from shared.draft_config import DraftConfig
from verify_worker.target_loader import load_target

torch.set_num_threads(2)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def write_hf_checkpoint(folder, family="qwen3", seed=0, std=0.2, dtype=None, **overrides):
    """Write a random HF checkpoint with transformers' own save_pretrained; returns the HF model (fp32)."""
    import transformers

    settings = {**TINY, "initializer_range": std, **overrides}
    if family == "qwen3":
        config, model_cls = transformers.Qwen3Config(**settings), transformers.Qwen3ForCausalLM
    else:
        config, model_cls = transformers.LlamaConfig(**settings), transformers.LlamaForCausalLM
    config.eos_token_id = None
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if dtype is not None:
        model.to(dtype).save_pretrained(folder)
        model.float()
    else:
        model.save_pretrained(folder)
    return model


def tiny_draft_config(target_layers=4, block_size=8, layers=1, vocab=128, hidden=64, **overrides) -> DraftConfig:
    settings = dict(
        hidden_size=hidden, intermediate_size=128, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
        vocab_size=vocab, num_target_layers=target_layers, target_layer_ids=(1, 2), mask_token_id=vocab - 1,
        block_size=block_size,
    )
    settings.update(overrides)
    return DraftConfig(**settings)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory):
    """(hf_model, our_target, drafter, folder) on one tiny random Qwen3 checkpoint."""
    folder = tmp_path_factory.mktemp("qwen3")
    hf = write_hf_checkpoint(folder, "qwen3")
    target = load_target(folder)
    drafter = random_drafter(tiny_draft_config(), seed=1, std=0.2)
    return hf, target, drafter, folder


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = write_hf_checkpoint(folder, "llama", seed=1)
    target = load_target(folder)
    drafter = random_drafter(tiny_draft_config(), seed=2, std=0.2)
    return hf, target, drafter, folder
