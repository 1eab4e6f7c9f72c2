"""min_tokens and stop token ids in the engine: a stop token is never chosen before min_tokens (its logits are
masked there), greedily the output equals transformers' generate with min_new_tokens (its
MinNewTokensLengthLogitsProcessor masks the same way), and speculative equals plain decoding token for token."""

import pytest
import torch
from greedy_check import assert_same_or_near_tie

from draft_worker.local_proposer import LocalProposer
from shared.errors import RequestError
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine

PROMPTS = [(3, 17, 22, 9, 41, 7, 99), (5,), (100, 2)]
NEW_TOKENS, LEAST = 40, 24


def hf_greedy(hf, prompt, stop: int, least: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=least, do_sample=False,
                          eos_token_id=stop, pad_token_id=stop, attention_mask=torch.ones(1, len(prompt),
                                                                                          dtype=torch.long))
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(stop) + 1] if stop in tokens[least:] else tokens


@pytest.fixture(scope="module")
def early_stops(qwen3_pair):
    """Per prompt, a token plain greedy decoding emits among its first tokens: as a stop token it would end the
    output early, so min_tokens has to hold it back."""
    _, target, _, _ = qwen3_pair
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=128).generate(
        [GenerationRequest(p, NEW_TOKENS) for p in PROMPTS])
    return [result.token_ids[2] for result in plain]


def requests(stops: list[int], least: int, **extra) -> list[GenerationRequest]:
    return [GenerationRequest(p, NEW_TOKENS, stop_token_ids=(stop,), min_tokens=least, **extra)
            for p, stop in zip(PROMPTS, stops)]


def test_a_stop_token_ends_the_output_without_min_tokens(qwen3_pair, early_stops):
    _, target, _, _ = qwen3_pair
    results = SpeculativeEngine(target, None, max_requests=3, max_model_len=128).generate(requests(early_stops, 0))
    for result, stop in zip(results, early_stops):
        assert result.finish_reason == "stop" and len(result.token_ids) <= 3 and result.token_ids[-1] == stop


@pytest.mark.parametrize("block_size", [None, 4, 8])
def test_min_tokens_greedy_equals_transformers_and_plain(qwen3_pair, early_stops, block_size):
    hf, target, drafter, _ = qwen3_pair
    proposer = None if block_size is None else LocalProposer(
        drafter, target.embed_weight, target.lm_head_weight, block_size=block_size, max_requests=3,
        max_model_len=128)
    engine = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=128)
    results = engine.generate(requests(early_stops, LEAST))
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=128).generate(requests(early_stops, LEAST))
    for prompt, stop, result, alone in zip(PROMPTS, early_stops, results, plain):
        assert stop not in result.token_ids[:LEAST] and len(result.token_ids) > LEAST
        assert result.token_ids == alone.token_ids and result.finish_reason == alone.finish_reason
        assert_same_or_near_tie(target, list(prompt), result.token_ids, hf_greedy(hf, list(prompt), stop, LEAST))
        if block_size is not None:
            assert result.stats.draft_tokens > 0


def test_log_probabilities_stay_the_targets_own_under_the_mask(qwen3_pair, early_stops):
    """The reported log-probabilities are the unmasked target's (as vLLM reports them): the same with and
    without min_tokens for the tokens both outputs share."""
    _, target, _, _ = qwen3_pair
    engine = SpeculativeEngine(target, None, max_requests=3, max_model_len=128)
    masked = engine.generate(requests(early_stops, LEAST, logprobs=0))
    free = engine.generate([GenerationRequest(p, 2, logprobs=0) for p in PROMPTS])
    for a, b in zip(masked, free):
        assert [t.logprob for t in a.logprobs[:2]] == [t.logprob for t in b.logprobs[:2]]


def test_min_tokens_past_max_tokens_is_refused(qwen3_pair):
    _, target, _, _ = qwen3_pair
    engine = SpeculativeEngine(target, None, max_requests=1, max_model_len=128)
    with pytest.raises(RequestError, match="min_tokens"):
        engine.add(GenerationRequest((1, 2), 4, min_tokens=5))
