"""--spec-policy adaptive: the choice between speculative and plain steps, and that it never changes tokens."""

from collections import deque

import pytest
from conftest import tiny_draft_config, write_hf_checkpoint
from greedy_check import assert_same_or_near_tie
from scripted_proposer import ScriptedProposer

from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import LocalProposer
from gateway import launcher
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.spec_policy import AdaptiveSpeculation, batch_bucket
from verify_worker.target_loader import load_target


def test_batch_sizes_are_measured_in_power_of_two_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_it_measures_both_modes_then_runs_the_faster_and_probes_the_other():
    policy = AdaptiveSpeculation(probe_every=4, refresh_every=8)
    batch = ["a"]
    assert policy.speculate(batch)  # nothing measured: speculation first
    policy.observe(batch, True, True, 0.010, [2], [True])  # a speculative step: 10 ms, 2 tokens
    assert not policy.speculate(batch)  # then plain decoding
    policy.observe(batch, False, False, 0.004, [1], [False])  # 4 ms per token: 2 tokens per 10 ms do not pay
    assert policy.preferred_mode(batch) == "plain"
    schedule = []
    for _ in range(12):
        schedule.append(policy.speculate(batch))
        policy.observe(batch, schedule[-1], None, 0.0, [1], [False])  # untimed steps still count towards probes
    # a probe after 4 plain steps; it confirmed plain decoding, so the next one comes after 8
    assert schedule == [False] * 3 + [True] + [False] * 8


def test_probes_that_confirm_plain_decoding_come_less_often():
    """Speculation loses (2 tokens per 10 ms against 4 ms per token): each probe that confirms it doubles the
    plain steps before the next (4, 8, 16, then the cap of 16); a probe that finds speculation paying (the
    request now commits 8 tokens per step) brings back the first spacing, and so does a request never
    measured. (No probe budget here: see the next test for that.)"""
    policy = AdaptiveSpeculation(probe_every=4, max_probe_every=16, probe_budget=None)
    batch = ["a"]
    policy.observe(batch, True, True, 0.010, [2], [True])
    policy.observe(batch, False, False, 0.004, [1], [False])
    gaps, plain_run = [], 0
    for _ in range(70):
        if policy.speculate(batch):
            gaps.append(plain_run)
            plain_run = 0
            policy.observe(batch, True, True, 0.010, [2], [True])
        else:
            plain_run += 1
            policy.observe(batch, False, False, 0.004, [1], [False])
    assert gaps[:5] == [3, 8, 16, 16, 16]  # (the first run counts the plain step measured above)
    while not policy.speculate(batch):
        policy.observe(batch, False, False, 0.004, [1], [False])
    for _ in range(40):  # the probe commits 8 tokens: now speculation pays, and stays preferred
        policy.observe(batch, True, True, 0.010, [8], [True])
    assert policy.preferred_mode(batch) == "speculative" and policy.probe_spacing[1] == 4
    policy.probe_spacing[1] = 16
    policy.speculate(batch)  # a measured request: the spacing is kept
    assert policy.probe_spacing[1] == 16
    policy.observe(["b"], False, False, 0.004, [1], [False])
    policy.speculate(["b"])  # b was never measured: probes come at the first spacing again
    assert policy.probe_spacing[1] == 4


def test_probes_cost_at_most_their_budget_of_the_plain_decoding_time():
    """A probe that costs 6 ms over the 4 ms plain step it replaces, under a 5% budget, comes at most once every
    30 plain steps (6 ms is 5% of 120 ms), whatever the doubling schedule says (4, 8, 16); once probes cost
    little (0.1 ms over), the doubling schedule alone spaces them again. The first probe comes before any was
    measured: the budget needs what a probe costs."""
    policy = AdaptiveSpeculation(probe_every=4, max_probe_every=16, probe_budget=0.05)
    batch = ["a"]
    policy.observe(batch, True, True, 0.010, [2], [True])
    policy.observe(batch, False, False, 0.004, [1], [False])

    def gaps(probe_seconds: float, probes: int) -> list[int]:
        found, plain_run = [], 0
        while len(found) < probes:
            if policy.speculate(batch):
                found.append(plain_run)
                plain_run = 0
                policy.observe(batch, True, None, probe_seconds, [2], [True])  # a probe: untimed, catching up
            else:
                plain_run += 1
                policy.observe(batch, False, False, 0.004, [1], [False])
        return found

    costly = gaps(0.010, 5)
    assert costly == [3, 30, 30, 30, 30]
    assert 4 * (0.010 - 0.004) / (sum(costly[1:]) * 0.004) <= 0.05  # after the first: 24 ms of probes per 480 ms
    cheap = gaps(0.0041, 10)
    assert policy.budget_spacing(1) == 1  # 0.1 ms is 5% of 2 ms: the budget alone would allow a probe every step
    assert cheap[-2:] == [16, 16]  # the doubling schedule's cap (the window still holds costly probes at first)
    assert AdaptiveSpeculation(probe_budget=None).budget_spacing(1) == 0


def test_a_new_request_resets_the_probes_only_where_it_could_tip_the_batch():
    """16 streams where plain decoding wins by far (a speculative step costs 6 plain steps and commits 3 tokens
    a request): a request joining the batch keeps the grown probe spacing, since even as good as the best
    request seen (4 tokens a step) it could not make speculation pay. Alone in its batch, a new request
    could: there the spacing starts again."""
    policy = AdaptiveSpeculation(probe_every=4, max_probe_every=64)
    batch = [f"r{i}" for i in range(16)]
    policy.observe(batch, True, True, 0.030, [3] * 15 + [4], [True] * 16)
    policy.observe(batch, False, False, 0.005, [1] * 16, [False] * 16)
    # r15's 4 starts from the others' 3 (its prior, 2 steps): the best seen is its figure, between the two
    assert policy.preferred_mode(batch) == "plain" and 3 < policy.best_acceptance == policy.acceptance["r15"] < 4
    policy.probe_spacing[16] = 64
    joined = batch[1:] + ["new"]
    assert not policy.speculate(joined) and policy.probe_spacing[16] == 64
    policy.observe(["solo"], True, True, 0.010, [4], [True])  # batch size 1: 10 ms for 4 tokens
    policy.observe(["solo"], False, False, 0.004, [1], [False])  # against 4 ms a token: plain (16 > 10)...
    policy.acceptance["solo"] = 2.0  # ...and this request now commits only 2 a step
    policy.probe_spacing[1] = 64
    assert policy.preferred_mode(["solo"]) == "plain"
    policy.speculate(["another"])  # as good as the best seen (4 tokens: 16 ms of plain steps > 10): probe soon
    assert policy.probe_spacing[1] == 4


def test_a_wave_of_new_requests_is_judged_by_what_it_plausibly_averages_not_by_the_best_request():
    """32 past requests committed 2.5 to 4.5 tokens a speculative step (mean 3.45, sd 0.71), one reached 7.
    A speculative step of 16 costs 5 plain steps: 16 new requests at once would need to average 5, beyond the
    mean plus two standard errors (3.81), so the grown spacing stays; were each as good as the best (7) it
    would reset every wave. A new request alone (a step costs 4.5 plain ones there) plausibly reaches mean +
    2 sd (4.88): its batch probes soon."""
    policy = AdaptiveSpeculation(probe_every=4, max_probe_every=64)
    for i in range(32):
        policy.acceptance[f"old{i}"] = 2.5 + (i % 5) * 0.5
        policy.forget(f"old{i}")
    policy.forget("old0")  # forgotten again (after its last step): counted once
    policy.best_acceptance = 7.0
    assert len(policy.past_acceptance) == 32
    wave = [f"new{i}" for i in range(16)]
    policy.step_samples[(16, True)] = deque([0.025])
    policy.step_samples[(16, False)] = deque([0.005])
    policy.probe_spacing[16] = 64
    assert not policy.speculate(wave) and policy.probe_spacing[16] == 64
    policy.step_samples[(1, True)] = deque([0.0045])
    policy.step_samples[(1, False)] = deque([0.001])
    policy.probe_spacing[1] = 64
    policy.speculate(["alone"])
    assert policy.probe_spacing[1] == 4


def test_a_request_whose_scored_probe_is_pending_counts_as_being_measured():
    """A lone new request that could tip its batch is probed after 8 plain steps; the probe's drafts are scored
    7 steps later (a scored greedy probe). Meanwhile it is being measured, not unmeasured, so the spacing the
    probe's verdict doubled (16) holds: the next probe comes 16 plain steps later, not 8. A probe whose
    acceptance never comes in (a drafter fallback) stops counting after `measuring_steps`."""
    def probes(policy, score_after):
        at, probed_at = [], None
        for step in range(60):
            speculative = policy.speculate(["new"])
            if speculative:
                at.append(step)
                probed_at = step
            policy.observe(["new"], speculative, None if speculative else False, 0.001, [1], [False])
            if score_after is not None and probed_at is not None and step == probed_at + score_after:
                policy.record_acceptance("new", 2.0)  # measured now: it would not tip the batch
        return at

    def policy():
        made = AdaptiveSpeculation(probe_every=8, max_probe_every=64, best_acceptance=6.0)
        made.step_samples[(1, True)] = deque([0.0045])  # 4.5 plain steps: a request as good as 6 would pay
        made.step_samples[(1, False)] = deque([0.001])
        made.last_mode, made.steps_in_mode = False, 0
        return made

    scored = probes(policy(), score_after=7)
    assert scored[:2] == [8, 8 + 16 + 1]  # 8 plain steps, the probe, 16 plain steps, the next probe
    lost = probes(policy(), score_after=None)  # nothing comes in: 16 steps after a probe it is unmeasured again
    assert lost[:3] == [8, 25, 25 + 16 + 1]  # (the third probe would come 32 plain steps after the second)


def test_requests_that_ask_for_drafts_and_seeded_sampled_ones_pin_their_steps_to_speculation():
    """A request with num_speculative_tokens > 0 gets drafts, and seeded sampling stays reproducible run to run
    (its draws depend on the schedule): their steps draft whatever the measured times prefer; pin_seeded=False
    lifts the second."""
    policy = AdaptiveSpeculation()
    policy.observe(["a"], True, True, 0.010, [2], [True])
    policy.observe(["a"], False, False, 0.004, [1], [False])  # plain decoding measures faster
    assert not policy.speculate(["a"])
    assert policy.speculate(["a"], asked=True) and policy.speculate(["a"], seeded_sampling=True)
    assert not AdaptiveSpeculation(pin_seeded=False, step_samples=policy.step_samples,
                                   acceptance=policy.acceptance).speculate(["a"], seeded_sampling=True)


def test_the_decision_follows_the_requests_own_acceptance():
    policy = AdaptiveSpeculation(prior_steps=0, prior_floor=0)  # its samples alone are a request's figure
    policy.observe(["a"], True, True, 0.010, [2], [True])
    policy.observe(["a"], False, False, 0.004, [1], [False])
    policy.observe(["b"], True, True, 0.010, [6], [True])  # b: 6 tokens per 10 ms beat 4 ms per token
    assert policy.preferred_mode(["a"]) == "plain" and policy.preferred_mode(["b"]) == "speculative"
    assert policy.preferred_mode(["new"]) == "speculative"  # a new request starts at the mean acceptance (4)
    policy.forget("b")
    assert "b" not in policy.acceptance
    # b, forgotten, counts at the mean over a and the finished b (4): with a's 2, speculation wins at 1, so
    # batches of 2 are measured on their own (where it loses at 1 they decode plainly at first: the next test)
    assert policy.preferred_mode(["a", "b"]) is None


def test_a_larger_batch_takes_plain_decoding_from_a_smaller_one_until_measured_itself():
    """A speculative step's cost over a plain one's grows with the batch: where a smaller batch size already
    prefers plain decoding for these requests, a larger one decodes plainly from its first step instead of
    speculating to be measured (at 48 demo streams such steps cost 20-40 ms against 4.6 ms plain)."""
    policy = AdaptiveSpeculation()
    policy.observe(["a"], True, True, 0.010, [2], [True])
    policy.observe(["a"], False, False, 0.004, [1], [False])  # batches of 1: 2 tokens per 10 ms lose to 4 ms
    assert not policy.speculate(["a", "c", "d"])  # batches of 3-4: no step of their own yet, plain
    assert policy.preferred_mode(["a", "c", "d"]) == "plain"
    policy.observe(["e"], True, True, 0.010, [6], [True])  # a request for which speculation wins at 1
    # where speculation wins at 1 (e2 is new: the mean of a and e, 4 tokens), a batch of 2 is measured first
    assert policy.preferred_mode(["e", "e2"]) is None and policy.speculate(["e", "e2"])
    # once a batch size is measured in both modes its own times decide, whatever a smaller one prefers
    policy.observe(["a", "c", "d"], False, False, 0.004, [1, 1, 1], [False, False, False])
    policy.observe(["a", "c", "d"], True, True, 0.005, [2, 2, 2], [True, True, True])
    assert policy.preferred_mode(["a", "c", "d"]) == "speculative"


def test_the_per_step_overhead_counts_for_the_mode_that_takes_more_steps():
    """2.2 tokens per 10 ms speculative step against 4 ms plain steps: plain by decode time alone (8.8 ms for
    the same tokens). With 2 ms a step outside the decode time (server loop, bookkeeping) the plain steps for
    those tokens take 13.2 ms against 12: speculation pays."""
    policy = AdaptiveSpeculation()
    policy.observe(["a"], True, True, 0.010, [3], [True])
    policy.observe(["a"], True, True, 0.010, [1], [True])  # acceptance 3, then 0.9 * 3 + 0.1 * 1 = 2.8 ...
    policy.acceptance["a"] = 2.2  # (set exactly, for round figures)
    policy.observe(["a"], False, False, 0.004, [1], [False])
    assert policy.step_overhead() == 0.0 and policy.preferred_mode(["a"]) == "plain"
    for seconds in (0.002, 0.002, 0.5):  # a median: one slow turn (a stall, a new request admitted) moves nothing
        policy.observe_overhead(seconds)
    assert policy.step_overhead() == 0.002 and policy.preferred_mode(["a"]) == "speculative"


def test_the_engine_reports_a_decode_steps_overhead_not_a_prefills(tmp_path):
    """engine.observe_loop(seconds): the caller's turn around step() minus the step's decode time (draft,
    transfer, verify) reaches the policy; a turn whose step prefilled says nothing about decode steps."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    drafter = random_drafter(tiny_draft_config(block_size=4), seed=2, std=0.2)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4, max_requests=1)
    policy = AdaptiveSpeculation()
    engine = SpeculativeEngine(target, proposer, max_requests=1, policy=policy)
    engine.add(GenerationRequest((5, 6, 7), 8))
    engine.step()  # the prompt
    assert engine.last_report.prefill_tokens
    engine.observe_loop(1.0)
    assert not policy.overhead_samples
    engine.step()  # a decode step
    report = engine.last_report
    decode = sum(report.seconds[p] for p in ("draft", "transfer", "verify"))
    assert report.decode_requests == 1 and not report.prefill_tokens and decode > 0
    engine.observe_loop(decode + 0.003)
    assert list(policy.overhead_samples) == [pytest.approx(0.003)]


def test_an_unmeasured_plain_mode_does_not_hold_the_batch_forever():
    """Under continuous prefill no plain step may be pure enough to time: the probe schedule still drafts."""
    policy = AdaptiveSpeculation(probe_every=3)
    policy.observe(["a"], True, True, 0.010, [2], [True])
    schedule = []
    for _ in range(8):
        schedule.append(policy.speculate(["a"]))
        policy.observe(["a"], schedule[-1], None, 0.01, [1], [schedule[-1]])
    assert schedule == [False, False, False, True, False, False, False, True]


def test_a_probe_that_catches_up_on_context_still_measures_acceptance(tmp_path):
    """Block 4, a probe after 4 plain steps: its draft call carries more than a block of features (a catch-up
    step, untimed), yet its drafts, scored against the plain steps after it, update the acceptance lengths."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    drafter = random_drafter(tiny_draft_config(block_size=4), seed=2, std=0.2)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4, max_requests=1)
    # a probe after every 4 plain steps (no budget: against a plain step of 1 us any probe would cost too much)
    policy = AdaptiveSpeculation(probe_every=4, max_probe_every=4, probe_budget=None)
    policy.step_samples[(1, True)] = deque([1.0])  # drafting looks slow, at either draft count: plain decoding is
    policy.step_samples[(1, False)] = deque([1e-6])  # preferred
    policy.widths.narrow_samples[1] = deque([1.0])
    engine = SpeculativeEngine(target, proposer, max_requests=1, policy=policy)
    state = engine.add(GenerationRequest((5, 6, 7), 60))
    means, catch_ups = [], 0
    while engine.has_work():
        engine.step()
        report = engine.last_report
        catch_ups += report.catch_up
        if report.decode_requests and policy.mean_acceptance is not None:
            means.append(policy.mean_acceptance)
    assert catch_ups >= 5 and len(means) >= 5
    assert state.stats.draft_tokens == 0 and not policy.acceptance  # scored, never verified; forgotten at the end


def _plain_runs(target, requests):
    """The requests decoded plainly, and each one's prompt + output (a scripted drafter's reference)."""
    plain = SpeculativeEngine(target, None, max_requests=len(requests)).generate(requests)
    return plain, {r.request_id: list(r.prompt_ids) + want.token_ids for r, want in zip(requests, plain)}


class _TwoRightThenWrong(ScriptedProposer):
    """Proposes the target's own next two tokens, then a wrong one."""

    def propose(self, items):
        results = super().propose(items)
        for result in results:
            if len(result.tokens) > 2:
                result.tokens[2] = (result.tokens[2] + 1) % 128
        return results


def test_a_greedy_probe_is_a_plain_step_whose_drafts_are_scored_like_a_verify(tmp_path):
    """Plain decoding preferred: every probe of greedy requests drafts but verifies nothing (each step commits
    one token a request, exactly the plain output), and each probe's drafts, scored against the tokens the
    next steps commit, give the acceptance a verify would: 2 drafts match, so 3 tokens a step."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    requests = [GenerationRequest((5, 6, 7, i), 30) for i in range(2)]
    plain, sequences = _plain_runs(target, requests)
    proposer = _TwoRightThenWrong(sequences, 8, target.config.num_layers, error_rate=0.0)
    # a probe's 7 drafts are scored 7 steps later (no budget: plain steps of 1 ms make any probe too costly)
    policy = AdaptiveSpeculation(probe_every=8, max_probe_every=8, probe_budget=None)
    policy.step_samples[(2, True)] = deque([1.0])
    policy.widths.narrow_samples[2] = deque([1.0])  # slow at the narrow draft count too
    policy.step_samples[(2, False)] = deque([1e-3])  # plain: 8 tokens x 1 ms < 1 s
    engine = SpeculativeEngine(target, proposer, max_requests=2, policy=policy)
    states = [engine.add(r) for r in requests]
    scored, probes = [], 0
    while engine.has_work():
        engine.step()
        report = engine.last_report
        probes += report.catch_up or any(engine.policy.shadow_drafts)
        assert report.draft_tokens == 0 and report.policy_plain  # nothing verified: plain steps only
        scored += [policy.acceptance[s.request_id] for s in states if s.request_id in policy.acceptance]
    assert probes >= 3 and scored and all(a == pytest.approx(3.0) for a in scored)
    for state, want in zip(states, plain):
        assert state.output_ids == want.token_ids


def test_a_request_that_asks_for_drafts_drafts_alone_while_the_others_decode_plainly(tmp_path):
    """Plain decoding preferred for the batch: the request that asks for 2 drafts (like the gateway's readiness
    probe) gets them verified every step, the three that leave the choice to the server draft nothing (before,
    the one request made every row of the step speculate), and every output is the plain one."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    requests = [GenerationRequest((5, 6, 7, i), 24, num_speculative_tokens=2 if i == 0 else None)
                for i in range(4)]
    plain, sequences = _plain_runs(target, requests)
    proposer = ScriptedProposer(sequences, 8, target.config.num_layers, error_rate=0.0)
    policy = AdaptiveSpeculation(probe_every=10 ** 6, max_probe_every=10 ** 6)  # no probe in this test
    policy.step_samples[(4, True)] = deque([1.0])
    policy.step_samples[(4, False)] = deque([1e-3])
    engine = SpeculativeEngine(target, proposer, max_requests=4, policy=policy)
    states = [engine.add(r) for r in requests]
    decode_steps = 0
    while engine.has_work():
        engine.step()
        report = engine.last_report
        if report.decode_requests == 4 and not states[0].finish_reason:
            decode_steps += 1
            assert report.policy_plain and report.draft_tokens == 2  # the asking row's drafts only
    assert decode_steps >= 3
    assert states[0].stats.draft_tokens > 0 and all(s.stats.draft_tokens == 0 for s in states[1:])
    for state, want in zip(states, plain):
        assert state.output_ids == want.token_ids


def test_adaptive_greedy_decoding_gives_the_plain_tokens_and_uses_both_modes(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    drafter = random_drafter(tiny_draft_config(block_size=4), seed=2, std=0.2)
    requests = [GenerationRequest((5, 6, 7, i), 40) for i in range(3)]
    plain = SpeculativeEngine(target, None, max_requests=3).generate(requests)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4, max_requests=3)
    policy = AdaptiveSpeculation(probe_every=2, refresh_every=2)
    engine = SpeculativeEngine(target, proposer, max_requests=3, policy=policy)
    modes = set()
    states = [engine.add(r) for r in requests]
    while engine.has_work():
        engine.step()
        if engine.last_report.decode_requests:
            modes.add(engine.last_report.policy_plain)
    for request, state, want in zip(requests, states, plain):
        assert_same_or_near_tie(target, list(request.prompt_ids), state.output_ids, want.token_ids)
    assert modes == {True, False} and policy.step_seconds(3, True) and policy.step_seconds(3, False)
    assert not policy.acceptance  # every finished request was forgotten


class _CountingPolicy:
    """The engine's view of a policy: every attribute it reaches is logged."""

    def __init__(self, policy: AdaptiveSpeculation):
        self.policy, self.calls = policy, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.policy, name)


def test_a_decode_step_asks_the_policy_once_and_records_once(tmp_path):
    """One plan before drafting, one record after committing (a request that ends is also forgotten), whatever
    the step is: speculative, plain, a scored probe; and the output stays the plain one."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    requests = [GenerationRequest((5, 6, 7, i), 30) for i in range(2)]
    plain, sequences = _plain_runs(target, requests)
    proposer = _TwoRightThenWrong(sequences, 8, target.config.num_layers, error_rate=0.0)
    policy = AdaptiveSpeculation(probe_every=3, refresh_every=3, probe_budget=None)
    counting = _CountingPolicy(policy)
    engine = SpeculativeEngine(target, proposer, max_requests=2, policy=counting)
    states = [engine.add(r) for r in requests]
    decode_steps, modes = 0, set()
    while engine.has_work():
        counting.calls.clear()
        engine.step()
        if engine.last_report.decode_requests:
            decode_steps += 1
            modes.add(engine.last_report.policy_plain)
            assert counting.calls.count("plan") == 1 and counting.calls.count("record") == 1, counting.calls
            assert set(counting.calls) <= {"plan", "record", "forget"}, counting.calls
    assert decode_steps >= 5 and modes == {True, False}
    for state, want in zip(states, plain):
        assert state.output_ids == want.token_ids


def test_dflash_serve_passes_the_policy_to_the_verify_worker():
    default = launcher.build_children(launcher.parse_args([]))["verify"].settings
    assert default.speculation.spec_policy == "adaptive"  # the default: drafting where it pays
    always = launcher.build_children(launcher.parse_args(["--spec-policy", "always"]))["verify"].settings
    assert always.speculation.spec_policy == "always"


def test_new_requests_start_from_the_past_requests_mean_not_the_mean_over_steps():
    """One past request committed 7 tokens a step and speculated 40 steps; eight others committed 3 and were
    probed once each. Over steps the mean is near 7; over requests it is 3.4. Sixteen new requests where a
    speculative step costs 5 plain ones start plainly (before, they started speculating)."""
    policy = AdaptiveSpeculation(prior_steps=0, prior_floor=0)  # each probe's sample is its request's figure
    for _ in range(40):
        policy.record_acceptance("lucky", 7.0)
    for i in range(8):
        policy.record_acceptance(f"r{i}", 3.0)
    for request_id in ["lucky"] + [f"r{i}" for i in range(8)]:
        policy.forget(request_id)
    assert policy.mean_acceptance > 5 and policy.past_spread[0] == pytest.approx((7 + 8 * 3) / 9)
    policy.step_samples[(16, True)] = deque([0.025])
    policy.step_samples[(16, False)] = deque([0.005])
    assert policy.preferred_mode([f"new{i}" for i in range(16)]) == "plain"


def test_new_requests_count_at_the_mean_over_running_and_finished_requests():
    """While requests come and go, the running ones measured are a few probed ones: one at 8 tokens a step must
    not make 15 new requests count at 8 (their batch then speculated at 14 ms a step against 2 ms plain)."""
    policy = AdaptiveSpeculation(prior_steps=0, prior_floor=0)  # its samples alone are a request's figure
    for i in range(16):
        policy.record_acceptance(f"r{i}", 3.0)
        policy.forget(f"r{i}")
    policy.record_acceptance("hot", 8.0)
    policy.step_samples[(16, True)] = deque([0.014])
    policy.step_samples[(16, False)] = deque([0.002])
    assert policy.preferred_mode(["hot"] + [f"new{i}" for i in range(15)]) == "plain"
    assert policy.preferred_mode(["hot"] * 16) == "speculative"  # measured requests count at their own


class _Recording(ScriptedProposer):
    """Records which requests each draft call carries."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[list[str]] = []

    def propose(self, items):
        self.calls.append([item.request_id for item in items])
        return super().propose(items)


def test_a_scored_probe_drafts_a_few_requests_in_turn(tmp_path):
    """Eight greedy streams, plain decoding preferred: a scored probe drafts at most probe_rows (3) of them, those
    never measured first, then those probed longest ago, so successive probes measure every stream in turn. Each
    request's context still reaches the drafter whole and in order (the scripted drafter checks), and the
    output is the plain one."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    requests = [GenerationRequest((5, 6, 7, i), 40) for i in range(8)]
    plain, sequences = _plain_runs(target, requests)
    proposer = _Recording(sequences, 8, target.config.num_layers, error_rate=0.0)
    # no probe budget: the probes' measured cost (timing) would space them further on a busy machine
    policy = AdaptiveSpeculation(probe_every=4, max_probe_every=4, probe_rows=3, probe_budget=None)
    policy.step_samples[(8, True)] = deque([1.0])
    policy.widths.narrow_samples[8] = deque([1.0])  # slow at the narrow draft count too
    policy.step_samples[(8, False)] = deque([1e-3])  # plain: 8 tokens x 1 ms < 1 s
    engine = SpeculativeEngine(target, proposer, max_requests=8, policy=policy)
    states = [engine.add(r) for r in requests]
    while engine.has_work():
        engine.step()
    assert len(proposer.calls) >= 6 and all(1 <= len(call) <= 3 for call in proposer.calls)
    ids = [s.request_id for s in states]
    assert set(proposer.calls[0] + proposer.calls[1] + proposer.calls[2]) == set(ids)  # each in turn
    assert not set(proposer.calls[0]) & set(proposer.calls[1])
    for state, want in zip(states, plain):
        assert state.output_ids == want.token_ids and state.stats.draft_tokens == 0


def test_a_requests_first_steps_do_not_set_its_figure_alone():
    """Demo requests commit least in their first steps (1, 1, 2 tokens, later 8). Where finished requests
    averaged 4 and a speculative step costs 2.5 plain ones, a new request's first three steps leave it
    speculating; as its first sample alone its figure would be 1 and it would decode plainly from step two."""
    def after_first_steps(policy):
        for i in range(8):
            for _ in range(10):
                policy.observe([f"old{i}"], True, True, 0.005, [4], [True])
            policy.forget(f"old{i}")
        policy.observe(["p"], False, False, 0.002, [1], [False])  # 2 ms plain, 5 ms speculative: pays at 2.5
        for tokens in (1, 1, 2):
            policy.observe(["new"], True, True, 0.005, [tokens], [True])
        return policy.preferred_mode(["new"]), policy.acceptance["new"]
    mode, figure = after_first_steps(AdaptiveSpeculation())
    assert mode == "speculative" and 2.5 < figure < 4
    alone = AdaptiveSpeculation(prior_steps=0, prior_floor=0)  # the samples alone: 1, then moved little
    assert after_first_steps(alone) == ("plain", pytest.approx(1.36, abs=0.01))


def test_a_probe_after_many_plain_tokens_outweighs_the_old_samples():
    """Ten speculative steps at 1.5 tokens, then a sample of 6: right after them it moves the figure a
    little; after 40 tokens of plain decoding (the text may have turned predictable since) most of the way."""
    def figure(plain_tokens):
        policy = AdaptiveSpeculation()
        for _ in range(10):
            policy.record_acceptance("r", 1.5)
        for _ in range(plain_tokens):
            policy.observe(["r"], False, False, 0.002, [1], [False])
        policy.record_acceptance("r", 6.0)
        return policy.acceptance["r"]
    assert figure(0) < 2.5 and figure(40) > 3.5


def test_a_request_kept_plain_by_a_hard_stretch_drifts_back_to_speculating():
    """Finished requests averaged 4 tokens a step, a speculative step costs 2.5 plain ones. A request measured
    at 1.5 for ten steps decodes plainly; as its samples age over the tokens it commits plainly, the requests'
    mean draws its figure back, and after about 30 tokens it speculates again (to be measured by that step)."""
    policy = AdaptiveSpeculation()
    for i in range(8):
        policy.record_acceptance(f"old{i}", 4.0)
        policy.forget(f"old{i}")
    policy.step_samples[(1, True)] = deque([0.005])
    policy.step_samples[(1, False)] = deque([0.002])
    for _ in range(10):
        policy.record_acceptance("r", 1.5)
    modes = []
    for _ in range(40):
        modes.append(policy.preferred_mode(["r"]))
        policy.observe(["r"], False, False, 0.002, [1], [False])
    assert "speculative" in modes and 15 <= modes.index("speculative") < 40 and modes[-1] == "speculative"
