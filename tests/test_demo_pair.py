"""The committed demo pair (models/demo) loads, speculates for real, and stays lossless."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from greedy_check import assert_same_or_near_tie
from shared.demo_models import DEMO_DIR, default_pair
from verify_worker.engine import SpeculativeEngine
from verify_worker.request import GenerationRequest
from verify_worker.target_loader import load_target

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts_heldout.json"


def test_the_default_pair_is_the_demo_target_with_its_dflash2_drafter():
    target_dir, draft_dir, label = default_pair()
    assert target_dir == DEMO_DIR / "target" and draft_dir == DEMO_DIR / "draft2" and "embedded" in label
    drafter = load_drafter(draft_dir)
    assert drafter.config.kind == "dflash2" and drafter.config.block_size == 8  # the block size it is served at


def test_a_users_drafter_replaces_the_demo_drafter_and_the_label_says_so(tmp_path):
    target_dir, draft_dir, label = default_pair(tmp_path / "mine")
    assert target_dir == DEMO_DIR / "target" and draft_dir == tmp_path / "mine"
    assert "embedded demo target" in label and str(tmp_path / "mine") in label and "DFlash 2" not in label


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
