"""Engine behaviour: stop tokens, max tokens, queueing, aborts, seeded reproducibility, request validation."""

import pytest
import torch
from greedy_check import assert_same_or_near_tie

from draft_worker.local_proposer import LocalProposer
from shared.errors import RequestError
from shared.generation_request import GenerationRequest
from shared.sampling import batch_sampling_probs
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine


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
        (((1,), -1), "max_tokens must be an integer >= 0"),
        (((1,) * 250, 10), "exceeds this model.s context of 256 tokens"),
    ],
)
def test_invalid_requests_are_rejected(qwen3_pair, request_args, message):
    engine = make_engine(qwen3_pair)
    with pytest.raises(RequestError, match=message):
        engine.add(GenerationRequest(*request_args))
    assert not engine.has_work()


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": -1}, "top_k must be an integer from 0"), ({"top_k": 2**63}, "top_k must be an integer from 0"),
    ({"top_k": 10**30}, "top_k"), ({"seed": 2**64}, "seed must be an integer"), ({"seed": -2**63 - 1}, "seed"),
    ({"temperature": float("nan")}, "temperature must be a finite"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1e-300}, "temperature"), ({"top_p": float("nan")}, "top_p"), ({"top_p": -0.0}, "top_p"),
    ({"top_p": 1e308}, "top_p"),
])
def test_invalid_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_edge_sampling_values_compute_a_distribution():
    """A temperature below 1e-5 is greedy (float32 logits / T would overflow); a top_p below float32's range
    keeps the most likely token alone; the whole int64 range of top_k and seed is usable."""
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=-0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    logits = torch.tensor([[[0.5, 2.0, 1.0, -1.0]]])
    probs = batch_sampling_probs(logits, [SamplingParams(1.0, top_p=5e-324, top_k=2**63 - 1, seed=-2**63)])
    assert torch.equal(probs, torch.tensor([[[0.0, 1.0, 0.0, 0.0]]]))


def test_chunked_prefill_gives_the_same_output_and_keeps_streams_running(qwen3_pair):
    _, target, drafter, _ = qwen3_pair
    long_prompt = tuple((i * 7) % 120 for i in range(150))
    want = make_engine(qwen3_pair, spec=False).generate([GenerationRequest(long_prompt, 12)])[0].token_ids
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4, max_requests=2,
                             max_model_len=256)
    engine = SpeculativeEngine(target, proposer, max_requests=2, max_model_len=256, max_prefill_tokens=32)
    short = engine.add(GenerationRequest((1, 2, 3), 40))
    engine.step()
    tokens_before = len(short.output_ids)
    long = engine.add(GenerationRequest(long_prompt, 12))
    steps_prefilling = 0
    while long.status.value in ("waiting", "prefilling"):
        engine.step()
        steps_prefilling += 1
        assert engine.last_report.prefill_tokens <= 32
        seconds = engine.last_report.seconds  # a step that prefilled and decoded times both, and the cache work
        assert seconds["prefill"] > 0 and seconds["verify"] > 0 and seconds["cache"] > 0
    assert steps_prefilling == 5  # 150 prompt tokens in chunks of at most 32
    assert len(short.output_ids) >= tokens_before + 5  # the running stream decoded during every chunk
    while engine.has_work():
        engine.step()
    assert_same_or_near_tie(target, list(long_prompt), long.output_ids, want)


def test_a_short_last_chunk_beside_a_wide_one_stays_inside_the_cache(qwen3_pair):
    """Step 2 prefills 38 tokens of a 294-token prompt beside 200 of another: the shorter row's padding would
    reach positions past the cache (capacity 304) unless it is kept inside."""
    _, target, drafter, _ = qwen3_pair
    long_prompt = tuple((i * 7) % 120 for i in range(294))
    other = tuple((i * 5) % 120 for i in range(200))
    requests = [GenerationRequest(long_prompt, 4), GenerationRequest(other, 20)]
    alone = [SpeculativeEngine(target, None, max_requests=1, max_model_len=300).generate([r])[0].token_ids
             for r in requests]
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4, max_requests=2,
                             max_model_len=300)
    engine = SpeculativeEngine(target, proposer, max_requests=2, max_model_len=300, max_prefill_tokens=256)
    for request, result, want in zip(requests, engine.generate(requests), alone):
        assert_same_or_near_tie(target, list(request.prompt_ids), result.token_ids, want)


class FlakyProposer:
    """Wraps a real proposer: unavailable on some calls, and 'restarted' (a fresh drafter with an empty
    cache) on another, as a dead and restarted draft worker would be."""

    def __init__(self, make, fail_calls, restart_call):
        self.make, self.inner = make, make()
        self.block_size, self.target_layer_ids = self.inner.block_size, self.inner.target_layer_ids
        self.num_target_layers = self.inner.num_target_layers
        self.fail_calls, self.restart_call, self.calls, self.resyncs = fail_calls, restart_call, 0, 0

    def propose(self, items):
        from shared.proposals import ProposerUnavailable

        self.calls += 1
        if self.calls in self.fail_calls:
            raise ProposerUnavailable("drafter down")
        if self.calls == self.restart_call:
            self.inner = self.make()
        results = self.inner.propose(items)
        self.resyncs += sum(r.tokens is None for r in results)
        return results

    def release(self, request_id):
        self.inner.release(request_id)


def test_drafter_outage_and_restart_keep_outputs_identical(qwen3_pair):
    _, target, drafter, _ = qwen3_pair
    prompts = [(1, 2, 3), (7, 8), (50, 51, 52, 53)]
    plain = make_engine(qwen3_pair, spec=False).generate([GenerationRequest(p, 40) for p in prompts])
    flaky = FlakyProposer(lambda: LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4,
                                                max_requests=4, max_model_len=256), fail_calls={3, 4}, restart_call=8)
    engine = SpeculativeEngine(target, flaky, max_requests=4, max_model_len=256)
    states = [engine.add(GenerationRequest(p, 40)) for p in prompts]
    fallbacks = 0
    while engine.has_work():
        engine.step()
        fallbacks += engine.last_report.fallback
    assert fallbacks == 2 and flaky.resyncs == 3  # after the restart every request resent its whole context
    for prompt, state, want in zip(prompts, states, plain):
        assert_same_or_near_tie(target, list(prompt), state.output_ids, want.token_ids)
        assert state.stats.draft_tokens > 0


def test_prompt_chunks_go_in_forwards_of_similar_lengths():
    """A forward pads its rows to its longest chunk: chunks of very different lengths go in separate forwards,
    chunks of one length (or nearly) in one, and every chunk in exactly one."""
    from verify_worker.scheduler import padding_groups

    def lengths(chunks):
        return [[n for _, n in group] for group in padding_groups([(object(), n) for n in chunks])]

    assert lengths([]) == []
    assert lengths([8, 8, 8, 8]) == [[8, 8, 8, 8]]
    assert lengths([100, 10, 11, 98]) == [[10, 11], [98, 100]]
    assert lengths([5, 500]) == [[5], [500]]
    demo = [89, 32, 55, 95, 38, 95, 39, 34, 79, 116, 31, 81, 53, 33, 52, 20]  # the benchmark's 16 prompts
    groups = lengths(demo)
    assert sorted(n for group in groups for n in group) == sorted(demo)
    padded = sum(len(group) * max(group) for group in groups)
    assert padded <= 1.25 * sum(demo) < 16 * max(demo)  # 1856 padded rows before, for 942 tokens


def test_plan_prefill_keeps_unfinished_chunks_whole_multiples_of_the_alignment():
    """A budget of 200 shared first come first served: the 150-token prompt whole, the 40-token one whole, and
    the 300-token one nothing (10 tokens left is no whole multiple of 64; it waits); first in line it gets 192."""
    from verify_worker.request import RequestState
    from verify_worker.scheduler import plan_prefill

    states = [RequestState(GenerationRequest(tuple(range(n)), 4), 0, torch.Generator()) for n in (150, 40, 300)]
    assert [n for _, n in plan_prefill(states, 200, 64)] == [150, 40]
    assert [n for _, n in plan_prefill(states[2:], 200, 64)] == [192]
    assert [n for _, n in plan_prefill(states, 200)] == [150, 40, 10]  # no alignment: the budget to the token
    states[2].cache_len = 192  # prefilled
    assert [n for _, n in plan_prefill(states[2:], 100, 64)] == [64]
