"""Per-token log-probabilities: the target's own distribution (transformers' log_softmax as the reference),
the same under speculative and plain decoding, accepted drafts and bonus tokens alike."""

import pytest
import torch
from greedy_check import assert_same_or_near_tie
from test_greedy_identity import ScriptedProposer

from draft_worker.local_proposer import LocalProposer
from shared.errors import RequestError
from shared.generation_request import MAX_TOP_LOGPROBS, GenerationRequest
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.logprobs import token_logprobs

PROMPTS = [(3, 17, 22, 9), (5,), (60, 61, 62, 63, 64)]
TOP = 3


def reference_logprobs(hf, prompt, tokens) -> torch.Tensor:
    """transformers' log-probabilities [len(tokens), vocab] of the positions that chose each output token."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1)


def check_against_reference(hf, prompt, result):
    want = reference_logprobs(hf, prompt, result.token_ids)
    assert len(result.logprobs) == len(result.token_ids)
    for i, (token, got) in enumerate(zip(result.token_ids, result.logprobs)):
        assert got.logprob == pytest.approx(want[i, token].item(), abs=1e-4)
        assert len(got.top_ids) == TOP and got.top_logprobs == sorted(got.top_logprobs, reverse=True)
        assert got.top_logprobs == pytest.approx(want[i].topk(TOP).values.tolist(), abs=1e-4)
        assert got.top_logprobs == pytest.approx(want[i, got.top_ids].tolist(), abs=1e-4)


@pytest.mark.parametrize("mode", ["plain", "scripted", "drafter"])
def test_greedy_logprobs_are_the_targets_own(qwen3_pair, mode):
    hf, target, drafter, _ = qwen3_pair
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=256)
    requests = [GenerationRequest(p, 24, logprobs=TOP, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    want = plain.generate(requests)
    if mode == "plain":
        results = want
    else:
        proposer = ScriptedProposer({r.request_id: list(r.prompt_ids) + w.token_ids for r, w in zip(requests, want)},
                                    8, target.config.num_layers) if mode == "scripted" else \
            LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=3, max_model_len=256)
        engine = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=256)
        results = engine.generate(requests)
        if mode == "scripted":  # long accepted prefixes: most tokens came from accepted drafts
            assert sum(r.stats.accepted_tokens for r in results) > sum(len(r.token_ids) for r in results) / 2
    for prompt, result, plain_result in zip(PROMPTS, results, want):
        assert_same_or_near_tie(target, list(prompt), result.token_ids, plain_result.token_ids)
        check_against_reference(hf, prompt, result)


def test_sampled_logprobs_ignore_temperature_and_top_p(qwen3_pair):
    hf, target, drafter, _ = qwen3_pair
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=1, max_model_len=256)
    engine = SpeculativeEngine(target, proposer, max_requests=1, max_model_len=256)
    sampling = SamplingParams(temperature=1.7, top_p=0.8, seed=4)
    result = engine.generate([GenerationRequest(PROMPTS[0], 20, sampling, logprobs=TOP)])[0]
    check_against_reference(hf, PROMPTS[0], result)


def test_no_logprobs_unless_asked_and_stop_tokens_keep_theirs(qwen3_pair):
    _, target, _, _ = qwen3_pair
    engine = SpeculativeEngine(target, None, max_requests=2, max_model_len=256)
    full = engine.generate([GenerationRequest(PROMPTS[0], 12, logprobs=0)])[0]
    assert [t.top_ids for t in full.logprobs] == [[]] * 12
    stop = full.token_ids[5]
    cut = engine.generate([GenerationRequest(PROMPTS[0], 12, stop_token_ids=(stop,), logprobs=0)])[0]
    first = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[: first + 1] and cut.logprobs == full.logprobs[: first + 1]
    assert engine.generate([GenerationRequest(PROMPTS[0], 4)])[0].logprobs is None


@pytest.mark.parametrize("bad", [-1, MAX_TOP_LOGPROBS + 1, 1.5, True])
def test_bad_logprobs_counts_are_refused(qwen3_pair, bad):
    engine = SpeculativeEngine(qwen3_pair[1], None, max_requests=1, max_model_len=256)
    with pytest.raises(RequestError, match="logprobs must be an integer from 0 to 20"):
        engine.add(GenerationRequest(PROMPTS[0], 4, logprobs=bad))


def test_token_logprobs_is_log_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    rows = token_logprobs(logits, [0, 0], 2)
    want = torch.log_softmax(logits, -1)
    assert rows[0].logprob == pytest.approx(want[0, 0].item()) and rows[0].top_ids == [2, 1]
    assert rows[1].top_logprobs == pytest.approx(want[1, [0, 1]].tolist())


@pytest.mark.parametrize("chunk,slice_floats", [(3, 1 << 24), (2048, 1 << 24), (2048, 300)])
def test_prompt_logprobs_across_prefill_chunks_and_a_zero_token_request(qwen3_pair, chunk, slice_floats, monkeypatch):
    hf, target, _, _ = qwen3_pair
    # 300 floats: logits of 2 rows at a time (vocabulary 128), so the scoring slices are exercised too
    monkeypatch.setattr(SpeculativeEngine._score_prompt, "__defaults__", (slice_floats,))
    engine = SpeculativeEngine(target, None, max_requests=2, max_model_len=256, max_prefill_tokens=chunk)
    prompt = (60, 61, 62, 63, 64, 9, 3, 17)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)  # [P, vocab]
    scored, generated = engine.generate([GenerationRequest(prompt, 0, logprobs=2, prompt_logprobs=True),
                                         GenerationRequest(prompt, 3, logprobs=2, prompt_logprobs=True)])
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.logprobs == []
    assert len(generated.token_ids) == 3  # batched beside each other: equal up to float32 rounding
    assert [t.logprob for t in generated.prompt_logprobs] == pytest.approx([t.logprob for t in scored.prompt_logprobs],
                                                                            abs=1e-5)
    assert len(scored.prompt_logprobs) == len(prompt) - 1
    for position, (token, got) in enumerate(zip(prompt[1:], scored.prompt_logprobs)):
        assert got.logprob == pytest.approx(want[position, token].item(), abs=1e-4)
        assert got.top_logprobs == pytest.approx(want[position].topk(2).values.tolist(), abs=1e-4)
    prefill_only = engine.generate([GenerationRequest(prompt, 0)])[0]  # echo without logprobs: nothing to score
    assert prefill_only.token_ids == [] and prefill_only.prompt_logprobs is None
    with pytest.raises(RequestError, match="prompt log-probabilities need logprobs"):
        engine.add(GenerationRequest(prompt, 2, prompt_logprobs=True))
