"""The committed demo pair (models/demo) loads, speculates for real, and stays lossless."""

import json
from pathlib import Path

import pytest
from greedy_check import assert_same_or_near_tie
from tokenizers import Tokenizer

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from gateway import launcher
from shared.demo_models import DEMO_DIR, default_pair
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts_heldout.json"


def test_the_default_pair_is_the_demo_target_with_its_dflash2_drafter():
    pair = default_pair()
    assert pair.target == DEMO_DIR / "target" and pair.draft == DEMO_DIR / "draft2" and pair.embedded
    assert "DFlash 2 drafter" in pair.label
    drafter = load_drafter(pair.draft)
    assert drafter.config.kind == "dflash2" and drafter.config.block_size == 8  # the block size it is served at


def _demo_dir(root: Path, *folders: str) -> Path:
    for folder in folders:
        (root / folder).mkdir(parents=True)
        (root / folder / "config.json").write_text("{}")
    return root


def test_without_the_dflash2_drafter_the_default_falls_back_to_the_dflash_one(tmp_path):
    demo = _demo_dir(tmp_path, "target", "draft")
    pair = default_pair(demo_dir=demo)
    assert (pair.target, pair.draft, pair.embedded) == (demo / "target", demo / "draft", True)
    assert "its DFlash drafter" in pair.label


def test_a_users_drafter_needs_only_the_demo_target_and_the_label_names_it(tmp_path):
    demo = _demo_dir(tmp_path / "demo", "target")  # no demo drafter at all
    pair = default_pair(tmp_path / "mine", demo_dir=demo)
    assert (pair.target, pair.draft, pair.embedded) == (demo / "target", tmp_path / "mine", True)
    assert pair.label.startswith("the embedded demo target") and repr(str(tmp_path / "mine")) in pair.label


def test_without_models_demo_the_random_pair_stands_in_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    pair = default_pair(demo_dir=tmp_path / "empty")
    assert not pair.embedded and "RANDOM" in pair.label
    assert (pair.target / "config.json").is_file() and (pair.draft / "config.json").is_file()
    assert pair.target.is_relative_to(tmp_path / "cache")
    mine = default_pair(tmp_path / "mine", demo_dir=tmp_path / "empty")
    assert mine.target == pair.target and mine.draft == tmp_path / "mine" and not mine.embedded


@pytest.mark.parametrize("drafter_name", ["draft", "draft2"])
def test_demo_drafters_speculate_losslessly_on_held_out_code(drafter_name):
    target_dir, draft_dir = DEMO_DIR / "target", DEMO_DIR / drafter_name
    target = load_target(target_dir)
    drafter = load_drafter(draft_dir)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    assert tokenizer.token_to_id(config["mask_token"]) == drafter.config.mask_token_id
    assert "chat_template" in config
    prompts = [p["prompt"] for p in json.loads(PROMPTS.read_text())[:3]]
    requests = [GenerationRequest(tuple(tokenizer.encode(p).ids), 48) for p in prompts]
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=1024).generate(requests)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=3,
                             max_model_len=1024)
    spec = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=1024).generate(requests)
    for request, want, got in zip(requests, plain, spec):
        assert_same_or_near_tie(target, list(request.prompt_ids), got.token_ids, want.token_ids)
    steps = sum(r.stats.verify_steps for r in spec)
    committed = sum(r.stats.committed_tokens for r in spec)
    assert committed / steps > 1.5  # a trained drafter: drafts are accepted on held-out code


def test_dflash_serve_without_arguments_wires_the_demo_target_and_its_dflash2_drafter():
    children = launcher.build_children(launcher.parse_args([]))
    assert children["gateway"].settings.http.served_model_name == "dflash-demo"
    for role in ("verify", "draft"):
        model = children[role].settings.model
        assert model.target == str(DEMO_DIR / "target")
        assert model.draft == str(DEMO_DIR / "draft2")
    mine = launcher.build_children(launcher.parse_args(["--draft", str(DEMO_DIR / "draft")]))
    assert mine["draft"].settings.model.draft == str(DEMO_DIR / "draft")
    plain = launcher.build_children(launcher.parse_args(["--no-draft"]))
    assert "draft" not in plain and plain["verify"].settings.model.no_draft
    assert not plain["verify"].settings.drafting and plain["gateway"].settings.model.no_draft


def test_other_engines_tokenize_the_demo_target_as_we_do():
    """vLLM, SGLang and HF load tokenizers with transformers' AutoTokenizer; its ids must equal ours on the
    benchmark's held-out prompts, or text prompts would give other outputs there (a qwen3 model_type alone made it
    Qwen2Tokenizer, which split 46 of the 48 prompts differently)."""
    from transformers import AutoTokenizer

    folder = DEMO_DIR / "target"
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(str(folder))
    prompts = [p["prompt"] for p in json.loads(PROMPTS.read_text())]
    for prompt in prompts + ["<|endoftext|>x<|mask|>", "naïve 日本 \t\n  end"]:
        assert theirs(prompt, add_special_tokens=False)["input_ids"] == ours.encode(prompt, add_special_tokens=False).ids
    assert theirs.eos_token == "<|endoftext|>"
