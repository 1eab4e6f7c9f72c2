"""Our target forward equals transformers' on checkpoints written by transformers' save_pretrained."""

import json

import pytest
import torch
from conftest import write_hf_checkpoint

from verify_worker.target_loader import load_target

TOL = 1e-4


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float()


def ours_prefill(target, ids):
    ids = torch.tensor(ids)
    cache = target.new_cache(ids.shape[0], 256)
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    out = target(ids, positions, cache, torch.arange(ids.shape[0]))
    return target.logits(out.hidden), cache


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prefill_logits_match_transformers(family, qwen3_pair, llama_pair):
    hf, target, _, _ = qwen3_pair if family == "qwen3" else llama_pair
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(0)).tolist()
    ours, _ = ours_prefill(target, ids)
    assert (ours - hf_logits(hf, ids)).abs().max() <= TOL


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_incremental_steps_with_rollback_match_transformers(family, qwen3_pair, llama_pair):
    """Prefill, then blocks of new tokens of which only a prefix is kept: the rejected tail is rolled back
    by rewriting its positions, and every step's logits equal a fresh full forward of the kept sequence."""
    hf, target, _, _ = qwen3_pair if family == "qwen3" else llama_pair
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 128, (9,), generator=gen).tolist()
    cache = target.new_cache(2, 256)
    slot = torch.tensor([1])  # a slot other than 0, to exercise slot indexing
    target(torch.tensor([seq]), torch.arange(len(seq))[None], cache, slot)
    for keep in (2, 0, 4, 1, 3):
        block = torch.randint(0, 128, (5,), generator=gen).tolist()
        positions = torch.arange(len(seq), len(seq) + 5)[None]
        out = target(torch.tensor([block]), positions, cache, slot)
        ours = target.logits(out.hidden)[0]
        reference = hf_logits(hf, [seq + block])[0, -5:]
        assert (ours - reference).abs().max() <= TOL
        seq = seq + block[:keep]  # roll back: the cache length is simply len(seq)


def test_batched_rows_of_different_lengths_match(qwen3_pair):
    """A right-padded batch: each row's real positions equal that row's unbatched logits."""
    hf, target, _, _ = qwen3_pair
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42]]
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    cache = target.new_cache(3, 64)
    out = target(ids, torch.arange(width)[None].expand(3, -1), cache, torch.tensor([2, 0, 1]))
    logits = target.logits(out.hidden)
    for row, prompt in enumerate(prompts):
        assert (logits[row, : len(prompt)] - hf_logits(hf, [prompt])[0]).abs().max() <= TOL


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   "rope_theta": 500000.0}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen3", {"attention_bias": True}),
        ("llama", {"mlp_bias": True, "head_dim": 32}),
    ],
)
def test_config_variants_match_transformers(tmp_path, family, overrides):
    hf = write_hf_checkpoint(tmp_path, family, seed=3, **overrides)
    target = load_target(tmp_path)
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(2)).tolist()
    ours, _ = ours_prefill(target, ids)
    assert (ours - hf_logits(hf, ids)).abs().max() <= TOL


def test_legacy_and_new_rope_config_styles_load_the_same(tmp_path):
    """rope_parameters (new) and top-level rope_theta/rope_scaling (legacy) give identical models."""
    hf = write_hf_checkpoint(tmp_path, "qwen3", seed=4, rope_theta=50000.0)
    new_style = load_target(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 50000.0  # transformers 5 writes the new style
    params = config.pop("rope_parameters")
    config["rope_theta"], config["rope_scaling"] = params["rope_theta"], None
    (tmp_path / "config.json").write_text(json.dumps(config))
    legacy = load_target(tmp_path)
    assert torch.equal(new_style.inv_freq, legacy.inv_freq)
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert (ours_prefill(legacy, ids)[0] - hf_logits(hf, ids)).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(tmp_path, dtype):
    """bf16/fp16 weights load upcast to fp32 and match transformers run on the same rounded weights."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=5, dtype=dtype)
    target = load_target(tmp_path, dtype="float32")
    assert target.embed_weight.dtype == torch.float32
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = [[7, 8, 9, 10, 11]]
    assert (ours_prefill(target, ids)[0] - hf_logits(hf, ids)).abs().max() <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = write_hf_checkpoint(tmp_path / "src", "llama", seed=6)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    target = load_target(tmp_path / "sharded")
    ids = [[1, 2, 3, 4]]
    assert (ours_prefill(target, ids)[0] - hf_logits(hf, ids)).abs().max() <= TOL
