"""A DFlash 2 drafter's greedy drafts in one C++ call (draft_walk.cpp) are the tokens of the split path (logits,
top-k candidates, the selector's projection and the host walk in separate calls), on random bfloat16 drafters
in either tile layout, on one thread and a pool; a row without top_k numbers (NaN) hands the call back; a token
outside the selector's vocabulary is refused; the proposer takes the one call for greedy requests only."""

import json
from pathlib import Path

import pytest
import torch
from test_draft_block import bf16_drafter
from tokenizers import Tokenizer

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from shared.cpu_kernels.library import cpu_kernels
from shared.demo_models import default_pair
from shared.generation_request import GenerationRequest
from shared.packed_linear import packed_head
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts_heldout.json"

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")

LAYOUTS = ["bf16", pytest.param("amx", marks=pytest.mark.skipif(
    cpu_kernels() is None or not cpu_kernels().amx, reason="no AMX here"))]


def drafter_and_head(layout: str, seed: int = 4):
    """A random DFlash 2 drafter packed in `layout` and a bfloat16-valued lm_head packed alike."""
    drafter = bf16_drafter(True, 1, seed=seed, layout=layout)
    cfg = drafter.config
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)) * 0.3
    return drafter, packed_head(head.to(torch.bfloat16).float(), layout)


def split_walk(drafter, lm_head, hidden, anchors):
    """The split path's greedy tokens [b, B-1] of rows 1.. of each block."""
    logits = drafter.logits(hidden[:, 1:], lm_head)
    tokens, _, _ = drafter.walk(hidden[:, 1:], logits, anchors, torch.zeros(hidden.shape[0]), None)
    return tokens


def block(drafter, batch: int, seed: int):
    """Random final hidden states [batch, B, H] and anchors [batch]."""
    cfg, gen = drafter.config, torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, cfg.block_size, cfg.hidden_size, generator=gen)
    return hidden, torch.randint(0, cfg.vocab_size, (batch,), generator=gen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_call_walk_drafts_the_split_paths_tokens(layout):
    drafter, lm_head = drafter_and_head(layout)
    weights = drafter.native_walk(lm_head)
    assert weights is not None and weights.c_weights.amx == (layout == "amx")
    with torch.inference_mode():
        for batch, seed in ((1, 0), (3, 1), (8, 2)):
            hidden, anchors = block(drafter, batch, seed)
            ours = drafter.greedy_walk(weights, hidden, anchors)
            assert ours is not None and ours.shape == (batch, drafter.config.block_size - 1)
            assert torch.equal(ours, split_walk(drafter, lm_head, hidden, anchors))


def test_one_call_walk_is_the_same_on_a_pool_of_threads():
    drafter, lm_head = drafter_and_head("bf16", seed=6)
    weights = drafter.native_walk(lm_head)
    hidden, anchors = block(drafter, 5, seed=3)
    alone = drafter.greedy_walk(weights, hidden, anchors)
    for threads in (2, 3):
        pool = cpu_kernels().worker_pool(threads)
        drafter.pool = pool
        try:
            assert torch.equal(alone, drafter.greedy_walk(weights, hidden, anchors))
        finally:
            drafter.pool = None
            pool.close()


def test_a_row_without_top_k_numbers_hands_the_call_back():
    drafter, lm_head = drafter_and_head("bf16")
    weights = drafter.native_walk(lm_head)
    hidden, anchors = block(drafter, 2, seed=4)
    hidden[1, 3] = float("nan")  # every logit of that row NaN: torch.topk ranks NaN first, the split path decides
    assert drafter.greedy_walk(weights, hidden, anchors) is None


def test_an_anchor_outside_the_selector_vocabulary_is_refused():
    drafter, lm_head = drafter_and_head("bf16")
    weights = drafter.native_walk(lm_head)
    hidden, anchors = block(drafter, 2, seed=5)
    anchors[1] = drafter.config.vocab_size
    with pytest.raises(IndexError, match="outside the vocabulary"):
        drafter.greedy_walk(weights, hidden, anchors)


def test_a_head_off_the_kernels_layout_keeps_the_split_path():
    drafter, _ = drafter_and_head("bf16")
    cfg = drafter.config
    assert drafter.native_walk(torch.zeros(cfg.vocab_size, cfg.hidden_size)) is None  # an unpacked head


def test_the_kernel_choice_can_send_the_walk_back_to_the_split_path(monkeypatch):
    drafter, lm_head = drafter_and_head("bf16")
    weights = drafter.native_walk(lm_head)
    hidden, anchors = block(drafter, 2, seed=6)
    for mode in ("host", "reference"):
        monkeypatch.setenv("DFLASH_KERNELS", mode)
        assert drafter.greedy_walk(weights, hidden, anchors) is None


def test_the_served_demo_proposer_drafts_greedy_blocks_in_one_call():
    """The embedded pair as served: the proposer holds the one-call walk, and the engine's greedy outputs and
    every step's acceptance are the same as with the split path."""
    pair = default_pair()
    target = load_target(pair.target)
    tokenizer = Tokenizer.from_file(str(pair.target / "tokenizer.json"))
    prompts = [p["prompt"] for p in json.loads(PROMPTS.read_text())[3:5]]
    requests = [GenerationRequest(tuple(tokenizer.encode(p).ids), 32) for p in prompts]
    proposer = LocalProposer(load_drafter(pair.draft), target.embed_weight, target.lm_head_weight, block_size=8,
                             max_requests=2, max_model_len=1024)
    assert proposer.native_walk is not None
    runs = []
    for native_walk in (proposer.native_walk, None):
        proposer.native_walk = native_walk
        engine = SpeculativeEngine(target, proposer, max_requests=2, max_model_len=1024)
        runs.append([(r.token_ids, r.stats.verify_steps, r.stats.committed_tokens) for r in engine.generate(requests)])
    assert runs[0] == runs[1]
    assert sum(steps for _, steps, _ in runs[0]) < sum(committed for _, _, committed in runs[0])  # drafts accepted
