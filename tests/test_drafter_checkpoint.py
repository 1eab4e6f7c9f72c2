"""Drafter checkpoints use exactly the published tensor names and config keys, and load back."""

import json

import pytest
import torch
from conftest import tiny_draft_config
from safetensors import safe_open

from draft_worker.draft_checkpoint import load_drafter, random_drafter, save_drafter
from shared.draft_config import DraftConfig, default_target_layer_ids
from shared.errors import ConfigError

PUBLISHED_LAYER_TENSORS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
]


def test_saved_checkpoint_has_published_names_and_keys(tmp_path):
    model = random_drafter(tiny_draft_config(layers=2, block_size=16), seed=0)
    save_drafter(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in PUBLISHED_LAYER_TENSORS}
    assert names == expected
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 16 and config["dflash_config"]["block_size"] == 16
    assert config["dflash_config"]["mask_token_id"] == 127
    assert config["dflash_config"]["target_layer_ids"] == [1, 2]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "vocab_size", "layer_types", "num_target_layers"):
        assert key in config, key


def test_round_trip(tmp_path):
    model = random_drafter(tiny_draft_config(layers=2), seed=0)
    save_drafter(model, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def published_style_config(**changes) -> dict:
    config = tiny_draft_config().to_dict()
    config.update(changes)
    return config


def test_block_size_read_from_dflash_config_first():
    config = published_style_config(block_size=16)
    config["dflash_config"]["block_size"] = 8
    assert DraftConfig.from_dict(config).block_size == 8
    del config["dflash_config"]["block_size"]
    assert DraftConfig.from_dict(config).block_size == 16


def test_default_tap_rule_when_target_layer_ids_absent():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, 5 taps
    assert default_target_layer_ids(36, 1) == [18]
    config = published_style_config(num_hidden_layers=3, num_target_layers=36)
    del config["dflash_config"]["target_layer_ids"]
    config["layer_types"] = ["full_attention"] * 3
    assert DraftConfig.from_dict(config).target_layer_ids == (1, 17, 33)


def test_rope_parameters_and_legacy_rope_keys_are_both_read():
    legacy = published_style_config(rope_theta=1e6, rope_scaling=None)
    new = published_style_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    new.pop("rope_theta")
    assert DraftConfig.from_dict(legacy).rope == DraftConfig.from_dict(new).rope
    assert DraftConfig.from_dict(new).rope.theta == 1e6


def test_published_dflash_fields_are_read():
    config = published_style_config(is_causal=False, sliding_window=2048,
                                    layer_types=["sliding_attention"])
    config["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=20.0, input_embedding_scale=2.0)
    cfg = DraftConfig.from_dict(config)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale) == (0.5, 20.0, 2.0)
    assert cfg.layer_window(0) == 2048 and cfg.layer_is_causal(0) is False
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["MysteryDraftModel"]}, "unknown drafter architecture"),
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"num_hidden_layers": "two"}, "num_hidden_layers"),
    ],
)
def test_bad_configs_are_clear_errors(change, message):
    config = published_style_config(**change)
    config["dflash_config"].pop("block_size")
    with pytest.raises(ConfigError, match=message):
        DraftConfig.from_dict(config)


def test_mask_token_outside_vocabulary_is_an_error():
    config = published_style_config()
    config["dflash_config"]["mask_token_id"] = 128
    with pytest.raises(ConfigError, match="mask_token_id 128 is outside the vocabulary"):
        DraftConfig.from_dict(config)
