"""Engine behaviour: stop tokens, max tokens, queueing, aborts, seeded reproducibility, request validation."""

import pytest

from draft_worker.local_proposer import LocalProposer
from greedy_check import assert_same_or_near_tie
from shared.errors import RequestError
from shared.sampling import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.request import GenerationRequest


def make_engine(pair, spec=True, max_requests=4, block_size=8):
    _, target, drafter, _ = pair
    proposer = None
    if spec:
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=block_size,
                                 max_requests=max_requests, max_model_len=256)
    return SpeculativeEngine(target, proposer, max_requests=max_requests, max_model_len=256)


def test_stop_token_ends_the_request_identically(qwen3_pair):
    prompt = (4, 5, 6)
    plain = make_engine(qwen3_pair, spec=False).generate([GenerationRequest(prompt, 40)])[0].token_ids
    stop = plain[10]
    first = plain.index(stop)
    for spec in (False, True):
        result = make_engine(qwen3_pair, spec).generate([GenerationRequest(prompt, 40, stop_token_ids=(stop,))])[0]
        assert result.token_ids == plain[: first + 1] and result.finish_reason == "stop"


def test_max_tokens_is_exact_at_every_block_size(qwen3_pair):
    for max_tokens in (1, 2, 7, 9):
        result = make_engine(qwen3_pair, block_size=8).generate([GenerationRequest((1, 2), max_tokens)])[0]
        assert len(result.token_ids) == max_tokens and result.finish_reason == "length"


def test_more_requests_than_slots_all_complete(qwen3_pair):
    target = qwen3_pair[1]
    prompts = [(i, i + 1, i + 2) for i in range(0, 90, 10)]
    plain = make_engine(qwen3_pair, spec=False, max_requests=9).generate([GenerationRequest(p, 20) for p in prompts])
    engine = make_engine(qwen3_pair, spec=True, max_requests=3)
    results = engine.generate([GenerationRequest(p, 20) for p in prompts])
    for prompt, got, want in zip(prompts, results, plain):
        assert_same_or_near_tie(target, list(prompt), got.token_ids, want.token_ids)
    assert sorted(engine.free_slots) == [0, 1, 2] and not engine.proposer.slots


def test_abort_frees_the_slot_and_the_drafter_cache(qwen3_pair):
    engine = make_engine(qwen3_pair, max_requests=2)
    state = engine.add(GenerationRequest((1, 2, 3), 50))
    engine.step()
    engine.step()
    assert state.request_id in engine.proposer.slots and len(engine.free_slots) == 1
    assert engine.abort(state.request_id)
    assert len(engine.free_slots) == 2 and state.request_id not in engine.proposer.slots
    assert not engine.has_work() and state.finish_reason == "abort"


def test_seeded_request_is_the_same_alone_or_in_a_batch(qwen3_pair):
    request = GenerationRequest((9, 8, 7), 30, SamplingParams(temperature=0.8, top_p=0.95, seed=1234))
    alone = make_engine(qwen3_pair).generate([request])[0].token_ids
    others = [GenerationRequest((i, 3), 30, SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    batched = make_engine(qwen3_pair).generate(others[:1] + [request] + others[1:])[1].token_ids
    assert alone == batched


def test_unseeded_requests_differ(qwen3_pair):
    params = SamplingParams(temperature=1.0)
    outs = make_engine(qwen3_pair).generate([GenerationRequest((1, 2), 20, params) for _ in range(3)])
    assert len({tuple(r.token_ids) for r in outs}) > 1


@pytest.mark.parametrize(
    "request_args,message",
    [
        (((), 5), "the prompt is empty"),
        (((1, 500), 5), "prompt token id 500 is outside the vocabulary"),
        (((1,), 0), "max_tokens must be a positive integer"),
        (((1,) * 250, 10), "exceeds the maximum model length 256"),
    ],
)
def test_invalid_requests_are_rejected(qwen3_pair, request_args, message):
    engine = make_engine(qwen3_pair)
    with pytest.raises(RequestError, match=message):
        engine.add(GenerationRequest(*request_args))
    assert not engine.has_work()


def test_invalid_sampling_params_are_rejected():
    with pytest.raises(RequestError, match="top_k must be an integer >= 0"):
        SamplingParams(top_k=-1)
