"""Tensor parallelism on CPU over gloo: each rank holds only its slice, logits equal the single-process
target's within fp32 tolerance, and greedy generation on TP 2 equals TP 1 (near-tie rule)."""

import pytest
import torch
from conftest import tiny_draft_config, write_hf_checkpoint
from greedy_check import assert_same_or_near_tie
from tp_ranks import engine_generate, logits_and_shards, run_ranks

from draft_worker.draft_checkpoint import random_drafter, save_drafter
from shared.errors import ConfigError
from verify_worker.families.llama.config import TargetConfig
from verify_worker.families.llama.model import TargetModel
from verify_worker.families.llama.shard_plan import local_shapes
from verify_worker.parallel.group import TensorParallel
from verify_worker.target_loader import load_target

SPLIT_KV = dict(vocab_size=127, num_key_value_heads=2)  # KV heads split across 2 ranks; vocab not divisible by 2
REPLICATED_KV = dict(vocab_size=128, num_key_value_heads=1)  # 1 KV head: both ranks hold it


def whole_logits(target: TargetModel):
    cache = target.new_cache(2, 32)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7], [8, 8, 120, 64, 0, 0]])
    prefill = target.logits(target(ids, torch.arange(6)[None].repeat(2, 1), cache, torch.tensor([0, 1])).hidden)
    out = target(torch.tensor([[11], [33]]), torch.tensor([[6], [4]]), cache, torch.tensor([0, 1]), (1, 2))
    return prefill, target.logits(out.hidden), out.taps


@pytest.fixture(scope="module", params=["split_kv", "replicated_kv"])
def tp2_run(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    family = "qwen3" if request.param == "split_kv" else "llama"
    write_hf_checkpoint(folder, family, seed=3, **(SPLIT_KV if request.param == "split_kv" else REPLICATED_KV))
    out = folder / "tp2.pt"
    run_ranks(logits_and_shards, 2, str(folder), str(out))
    return folder, torch.load(out), torch.load(f"{out}.rank1")


def test_tp2_logits_and_taps_equal_the_whole_target(tp2_run):
    folder, got, _ = tp2_run
    prefill, step, taps = whole_logits(load_target(folder, dtype="float32"))
    assert got["prefill"].shape == prefill.shape
    assert (got["prefill"] - prefill).abs().max() < 1e-4
    assert (got["step"] - step).abs().max() < 1e-4
    assert (got["taps"] - taps).abs().max() < 1e-4


def test_each_rank_loads_only_its_slice(tp2_run):
    folder, rank0, rank1 = tp2_run
    whole = {name: tuple(t.shape) for name, t in load_target(folder, dtype="float32", pack=False).state_dict().items()}
    cfg = load_target(folder, dtype="float32", pack=False).config
    for shapes in (rank0["shapes"], rank1):
        assert set(shapes) == set(whole)
        for name, full in whole.items():
            local = shapes[name]
            numel_full, numel_local = torch.Size(full).numel(), torch.Size(local).numel()
            if "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")):
                assert local == full, name
            elif ("k_proj" in name or "v_proj" in name) and cfg.num_kv_heads < 2:
                assert local == full, name  # replicated KV head
            elif "embed_tokens" in name or "lm_head" in name:
                assert local == (-(-cfg.vocab_size // 2), cfg.hidden_size), name  # half the vocabulary (padded)
            else:
                assert numel_local * 2 == numel_full, (name, local, full)
    sharded = [n for n in whole if "norm" not in n]
    per_rank = sum(torch.Size(rank1[n]).numel() for n in sharded)
    total = sum(torch.Size(whole[n]).numel() for n in sharded)
    assert per_rank <= 0.55 * total  # about 1/N of the sharded tensors (replicated KV heads aside)


def test_tp2_engine_greedy_equals_tp1(tmp_path):
    write_hf_checkpoint(tmp_path / "target", "qwen3", seed=5, **SPLIT_KV)
    save_drafter(random_drafter(tiny_draft_config(vocab=127, block_size=4), seed=4, std=0.2), tmp_path / "draft")
    prompts = [[5, 9, 33, 2], [100, 3, 3, 3, 3, 71, 8], [64]]
    out = tmp_path / "engine.pt"
    run_ranks(engine_generate, 2, str(tmp_path / "target"), str(tmp_path / "draft"), prompts, str(out))
    got = torch.load(out)["tokens"]
    whole = load_target(tmp_path / "target", dtype="float32")
    from shared.sampling_params import SamplingParams
    from verify_worker.engine import SpeculativeEngine
    from shared.generation_request import GenerationRequest

    want = [r.token_ids for r in SpeculativeEngine(whole, None, max_requests=3).generate(
        [GenerationRequest(tuple(p), 24, SamplingParams()) for p in prompts])]
    for prompt, g, w in zip(prompts, got, want):
        assert_same_or_near_tie(whole, prompt, g, w)


def test_shapes_a_tp_size_cannot_split_are_clear_errors():
    cfg = TargetConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
                                  "num_key_value_heads": 3, "head_dim": 16})
    with pytest.raises(ConfigError, match="does not divide the 6 attention heads"):
        local_shapes(cfg, TensorParallel(0, 4))
    with pytest.raises(ConfigError, match="KV heads"):
        local_shapes(cfg, TensorParallel(0, 2))
    assert local_shapes(cfg, TensorParallel(1, 3)).kv_head_start == 1


def test_followers_run_the_commits_and_resets_of_a_stateful_family(tmp_path):
    from tp_ranks import commits_mirrored

    write_hf_checkpoint(tmp_path / "target", "qwen3", seed=5, **SPLIT_KV)
    out = tmp_path / "calls.pt"
    run_ranks(commits_mirrored, 2, str(tmp_path / "target"), str(out))
    leader, follower = torch.load(out), torch.load(f"{out}.rank1")
    assert leader == [("reset", 1), ("commit", [1], [3]), ("reset", 0), ("commit", [0, 1], [2, 1])]
    assert follower == leader
