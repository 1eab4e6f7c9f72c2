"""A step that raises fails only the request that causes it: the engine undoes the step and steps the batch
in halves until the cause stands alone; every other request goes on, token for token as if served alone.

The fault is injected around the real target (its forward still runs): a request whose prompt starts with
POISON makes the target raise, at its prefill or later in its decode."""

import pytest
import torch
from greedy_check import assert_same_or_near_tie

from draft_worker.local_proposer import LocalProposer
from shared.errors import WorkerFault
from shared.generation_request import GenerationRequest
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.request_snapshot import RequestSnapshot
from verify_worker.scheduler import padding_groups

POISON = 127  # the last id of the tiny vocabulary (128)


class PoisonedTarget:
    """The real target, raising for the slot of a POISON request: at once (prefill) or from position `after`."""

    def __init__(self, target, after: int | None = None, error: type[Exception] = ValueError):
        self.target, self.after, self.error = target, after, error
        self.poisoned_slots: set[int] = set()
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def reset(self, state, slot: int) -> None:
        """The slot is handed to another request: the poison was the request's, not the slot's."""
        self.poisoned_slots.discard(slot)
        self.target.reset(state, slot)

    def step(self, batch, state, taps):
        self.calls += 1
        ids, positions, slots = batch.input_ids, batch.positions, batch.slots
        for row, slot in enumerate(slots.tolist()):
            if ids[row, 0] == POISON and positions[row, 0] == 0:
                self.poisoned_slots.add(slot)
                if self.after is None:
                    raise self.error("poisoned prefill")
            if slot in self.poisoned_slots and self.after is not None and positions[row].max() >= self.after:
                raise self.error("poisoned decode")
        return self.target.step(batch, state, taps)


def engine_on(target, drafter, spec=True, max_requests=8):
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4,
                             max_requests=max_requests, max_model_len=256) if spec else None
    return SpeculativeEngine(target, proposer, max_requests=max_requests, max_model_len=256)


def run(engine, requests):
    """Steps until done; returns {request id: (tokens, finish reason, error)} from the step events."""
    for request in requests:
        engine.add(request)
    out = {r.request_id: ([], None, None) for r in requests}
    while engine.has_work():
        for event in engine.step():
            tokens, _, _ = out[event.request_id]
            out[event.request_id] = (tokens + event.new_token_ids, event.finish_reason, event.error)
    return out


VICTIMS = [(5, 6, 7), (9, 9, 2, 4), (30, 31), (100, 3, 8, 1, 2), (44,), (7, 7, 7)]


@pytest.mark.parametrize("after", [None, 12], ids=["at-prefill", "mid-decode"])
@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_a_poisoned_request_fails_alone_and_the_batch_goes_on(qwen3_pair, after, spec):
    _, target, drafter, _ = qwen3_pair
    alone = {p: run(engine_on(target, drafter, spec), [GenerationRequest(p, 40, request_id="x")])["x"][0]
             for p in VICTIMS}
    poisoned = PoisonedTarget(target, after=after)
    engine = engine_on(poisoned, drafter, spec)
    victims = [GenerationRequest(p, 40, request_id=f"v{i}") for i, p in enumerate(VICTIMS)]
    sampled = GenerationRequest((3, 4), 40, SamplingParams(1.0, seed=5), request_id="sampled")
    poison = GenerationRequest((POISON, 1, 2), 40, request_id="poison")
    out = run(engine, victims[:3] + [poison, sampled] + victims[3:])
    tokens, finish, error = out["poison"]
    assert finish == "error" and "ValueError: poisoned" in error
    assert (len(tokens) > 0) == (after is not None)  # mid-decode: it streamed tokens before it failed
    for request in victims:
        got, finish, error = out[request.request_id]
        assert error is None and finish == "length" and len(got) == 40
        assert_same_or_near_tie(target, list(request.prompt_ids), got, alone[request.prompt_ids])
    assert out["sampled"][1] == "length" and len(out["sampled"][0]) == 40
    if not spec:  # the undone step's draws are drawn again: a seeded sampled request is as when served alone
        solo = run(engine_on(target, drafter, spec), [GenerationRequest((3, 4), 40, SamplingParams(1.0, seed=5))])
        assert out["sampled"][0] == next(iter(solo.values()))[0]
    assert sorted(engine.free_slots) == list(range(8)) and not engine.has_work()
    if spec:
        assert not engine.proposer.slots  # the drafter holds no context of the failed request either
    again = run(engine, [GenerationRequest(VICTIMS[0], 40, request_id="again")])["again"]
    assert again[2] is None and again[0] == alone[VICTIMS[0]]  # and the engine serves on


def test_generate_raises_for_a_failed_request(qwen3_pair):
    _, target, drafter, _ = qwen3_pair
    with pytest.raises(RuntimeError, match="request poison failed: ValueError: poisoned prefill"):
        engine_on(PoisonedTarget(target), drafter).generate([GenerationRequest((POISON, 1), 8, request_id="poison")])


def test_a_worker_fault_is_not_blamed_on_a_request(qwen3_pair):
    """A fault of the worker itself (a lost tensor-parallel rank) propagates at once, without retries."""
    _, target, drafter, _ = qwen3_pair
    poisoned = PoisonedTarget(target, error=WorkerFault)
    engine = engine_on(poisoned, drafter)
    for i, prompt in enumerate(VICTIMS):
        engine.add(GenerationRequest(prompt, 8, request_id=f"v{i}"))
    engine.add(GenerationRequest((POISON, 1), 8, request_id="poison"))
    with pytest.raises(WorkerFault):
        engine.step()
    # the step's forwards (one per group of similar prompt lengths) up to the poisoned one, and no retry
    chunks = [(i, len(prompt)) for i, prompt in enumerate(VICTIMS + [(POISON, 1)])]
    poisoned_group = next(g for g, group in enumerate(padding_groups(chunks)) if (len(VICTIMS), 2) in group)
    assert poisoned.calls == poisoned_group + 1


def test_a_snapshot_puts_a_request_back(qwen3_pair):
    """What a step changes on a sampled request (outputs, cache length, features, stats, its random stream) is
    put back by the snapshot taken before it, so an undone step leaves no trace."""
    _, target, drafter, _ = qwen3_pair
    engine = engine_on(target, drafter)
    state = engine.add(GenerationRequest((3, 4, 5), 40, SamplingParams(1.0, seed=11), logprobs=2))
    for _ in range(3):
        engine.step()
    before = (list(state.output_ids), state.cache_len, len(state.feature_chunks), len(state.logprobs),
              state.stats.as_dict(), state.generator.get_state().clone())
    snapshot = RequestSnapshot.take(state)
    next_draws = state.uniforms(4)
    state.generator.set_state(before[-1])
    engine.step()
    assert len(state.output_ids) > len(before[0])  # the step did change it
    snapshot.restore()
    assert (list(state.output_ids), state.cache_len, len(state.feature_chunks), len(state.logprobs),
            state.stats.as_dict()) == before[:-1]
    assert torch.equal(state.uniforms(4), next_draws)
    assert state.sent_chunks == 0 and state.drafter_context_len == 0  # its context goes to the drafter again


class CommittingTarget(PoisonedTarget):
    """A poisoned target whose commit and reset record per slot what a recurrent family would keep: the tokens
    of each step's rows it is told to keep, a request's record starting over at each reset."""

    commits_state = True

    def __init__(self, target, after=None):
        super().__init__(target, after)
        self.kept: dict[int, int] = {}

    def commit(self, state, slots, kept):
        for slot, n in zip(slots.tolist(), kept.tolist()):
            self.kept[slot] += n

    def reset(self, state, slot):
        self.kept[slot] = 0


@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_commits_count_exactly_the_kept_tokens_even_across_a_failed_step(qwen3_pair, spec):
    """Every committed step tells the family how many tokens of each row it keeps, and an undone step commits
    nothing: at any point a slot's committed tokens equal its request's cache length."""
    _, target, drafter, _ = qwen3_pair
    family = CommittingTarget(target, after=12)
    engine = engine_on(family, drafter, spec)
    states = [engine.add(GenerationRequest(p, 30, request_id=f"v{i}")) for i, p in enumerate(VICTIMS)]
    states.append(engine.add(GenerationRequest((POISON, 1, 2), 30, request_id="poison")))
    failed = 0
    while engine.has_work():
        events = engine.step()
        failed += sum(e.error is not None for e in events)
        for state in states:
            if state.slot >= 0:
                assert family.kept[state.slot] == state.cache_len, state.request_id
    assert failed == 1
