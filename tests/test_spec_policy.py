"""--spec-policy adaptive: the choice between speculative and plain steps, and that it never changes tokens."""

from conftest import tiny_draft_config, write_hf_checkpoint
from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import LocalProposer
from gateway import launcher
from greedy_check import assert_same_or_near_tie
from verify_worker.engine import SpeculativeEngine
from verify_worker.request import GenerationRequest
from verify_worker.spec_policy import AdaptiveSpeculation, batch_bucket
from verify_worker.target_loader import load_target


def test_batch_sizes_are_measured_in_power_of_two_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_it_measures_both_modes_then_runs_the_faster_and_probes_the_other():
    policy = AdaptiveSpeculation(period=8, probe=2)
    assert policy.speculate(1)  # nothing measured: speculation first
    policy.observe(1, True, committed_tokens=2, seconds=0.01)  # 200 tokens/s
    assert not policy.speculate(1)  # then plain decoding
    policy.observe(1, False, committed_tokens=1, seconds=0.004)  # 250 tokens/s: plain is faster
    assert policy.preferred_mode(1) == "plain"
    schedule = []
    for _ in range(16):
        schedule.append(policy.speculate(1))
        policy.observe(1, None, 0, 0.0)  # steps that measure nothing still advance the probe schedule
    assert schedule.count(True) == 4 and schedule.count(False) == 12  # 2 probe steps in each period of 8
    assert policy.speculate(3) and policy.preferred_mode(3) is None  # another bucket is measured on its own


def test_a_faster_speculative_mode_takes_over_as_its_measurements_come_in():
    policy = AdaptiveSpeculation(period=64, probe=4, weight=0.5)
    policy.observe(4, True, committed_tokens=4, seconds=0.01)  # 100 tokens/s per request
    policy.observe(4, False, committed_tokens=4, seconds=0.008)  # 125
    assert policy.preferred_mode(4) == "plain"
    for _ in range(3):
        policy.observe(4, True, committed_tokens=16, seconds=0.01)  # 400: the drafter started to pay
    assert policy.preferred_mode(4) == "speculative" and policy.speculate(4)


def test_adaptive_greedy_decoding_gives_the_plain_tokens_and_uses_both_modes(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", seed=4)
    target = load_target(tmp_path)
    drafter = random_drafter(tiny_draft_config(block_size=4), seed=2, std=0.2)
    requests = [GenerationRequest((5, 6, 7, i), 40) for i in range(3)]
    plain = SpeculativeEngine(target, None, max_requests=3).generate(requests)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=4, max_requests=3)
    policy = AdaptiveSpeculation(period=4, probe=1)
    engine = SpeculativeEngine(target, proposer, max_requests=3, policy=policy)
    modes = set()
    states = [engine.add(r) for r in requests]
    while engine.has_work():
        engine.step()
        if engine.last_report.decode_requests:
            modes.add(engine.last_report.policy_plain)
    for request, state, want in zip(requests, states, plain):
        assert_same_or_near_tie(target, list(request.prompt_ids), state.output_ids, want.token_ids)
    assert modes == {True, False} and policy.preferred_mode(3) is not None


def test_dflash_serve_passes_the_policy_to_the_verify_worker():
    default = launcher.build_children(launcher.parse_args([]))["verify"].argv
    assert default[default.index("--spec-policy") + 1] == "always"
    adaptive = launcher.build_children(launcher.parse_args(["--spec-policy", "adaptive"]))["verify"].argv
    assert adaptive[adaptive.index("--spec-policy") + 1] == "adaptive"
