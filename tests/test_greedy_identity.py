"""Greedy speculative decoding is lossless: identical to plain greedy decoding and to transformers' generate."""

import pytest
import torch
from greedy_check import assert_same_or_near_tie
from scripted_proposer import ScriptedProposer

from draft_worker.local_proposer import LocalProposer
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine

NEW_TOKENS = 64
PROMPTS = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77],
           [100, 2], [8, 8, 8, 8, 1]]


def hf_greedy(hf, prompt, n=NEW_TOKENS):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family_setup(request, qwen3_pair, llama_pair):
    hf, target, drafter, _ = qwen3_pair if request.param == "qwen3" else llama_pair
    reference = [hf_greedy(hf, p) for p in PROMPTS]
    plain = SpeculativeEngine(target, None, max_requests=5, max_model_len=256).generate(
        [GenerationRequest(tuple(p), NEW_TOKENS) for p in PROMPTS]
    )
    return target, drafter, reference, [r.token_ids for r in plain]


def test_plain_greedy_equals_transformers(family_setup):
    target, _, reference, plain = family_setup
    for prompt, ours, want in zip(PROMPTS, plain, reference):
        assert len(ours) == NEW_TOKENS
        assert_same_or_near_tie(target, prompt, ours, want)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("batch", [1, 5])
def test_dflash_drafter_greedy_equals_plain(family_setup, block_size, batch):
    target, drafter, reference, plain = family_setup
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=block_size,
                             max_requests=5, max_model_len=256)
    engine = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=256)
    results = engine.generate([GenerationRequest(tuple(p), NEW_TOKENS) for p in PROMPTS[:batch]])
    for prompt, result, want, hf_want in zip(PROMPTS, results, plain, reference):
        assert len(result.token_ids) == NEW_TOKENS
        assert result.stats.draft_tokens > 0
        assert_same_or_near_tie(target, prompt, result.token_ids, want)
        assert_same_or_near_tie(target, prompt, result.token_ids, hf_want)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_plain_with_every_host_kernel(family_setup, block_size, monkeypatch):
    """DFLASH_KERNELS=host: the drafter's block attention and the verify step on cuda_ext's host builds (the CUDA
    kernels' per-row code); still the plain tokens."""
    monkeypatch.setenv("DFLASH_KERNELS", "host")
    target, drafter, _, plain = family_setup
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=block_size,
                             max_requests=5, max_model_len=256)
    engine = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=256)
    results = engine.generate([GenerationRequest(tuple(p), NEW_TOKENS) for p in PROMPTS])
    for prompt, result, want in zip(PROMPTS, results, plain):
        assert result.stats.draft_tokens > 0
        assert_same_or_near_tie(target, prompt, result.token_ids, want)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("batch", [1, 5])
def test_high_acceptance_greedy_equals_plain(family_setup, block_size, batch):
    """With mostly-correct drafts, multi-token commits and rollbacks happen every step."""
    target, _, reference, plain = family_setup
    requests = [GenerationRequest(tuple(p), NEW_TOKENS) for p in PROMPTS[:batch]]
    sequences = {r.request_id: list(p) + want for r, p, want in zip(requests, PROMPTS, plain)}
    proposer = ScriptedProposer(sequences, block_size, target.config.num_layers)
    results = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=256).generate(requests)
    for prompt, result, want, hf_want in zip(PROMPTS, results, plain, reference):
        assert_same_or_near_tie(target, prompt, result.token_ids, want)
        assert_same_or_near_tie(target, prompt, result.token_ids, hf_want)
        assert len(result.token_ids) == NEW_TOKENS
        if block_size > 2:
            assert result.stats.acceptance_length > 1.5  # speculation really committed several tokens per step
        assert result.stats.accepted_tokens < result.stats.draft_tokens  # and some drafts were rejected


def test_per_request_speculation_knob(family_setup):
    """num_speculative_tokens caps drafts per request; 0 is plain decoding; outputs stay identical."""
    target, drafter, _, plain = family_setup
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8,
                             max_requests=5, max_model_len=256)
    engine = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=256)
    knobs = [0, 1, 3, None, 7]
    results = engine.generate([GenerationRequest(tuple(p), NEW_TOKENS, num_speculative_tokens=k)
                               for p, k in zip(PROMPTS, knobs)])
    for prompt, knob, result, want in zip(PROMPTS, knobs, results, plain):
        assert_same_or_near_tie(target, prompt, result.token_ids, want)
        cap = 7 if knob is None else knob
        assert result.stats.draft_tokens <= cap * result.stats.verify_steps
        assert (result.stats.draft_tokens == 0) == (knob == 0)
