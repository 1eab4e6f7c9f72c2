"""Decode steps padded to bucketed shapes (verify_worker/step_buckets.py, what CUDA graphs replay): the real rows
come out as in the unpadded step, bit for bit on CPU, and the engine serves the same tokens with them."""

import pytest
import torch
from conftest import tiny_draft_config

from cuda_ext.build import host_library
from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import LocalProposer
from shared.demo_models import default_pair
from shared.errors import ConfigError
from shared.generation_request import GenerationRequest
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.families.interface import StepBatch
from verify_worker.step_buckets import StepBuckets, key_bucket, row_bucket
from verify_worker.target_loader import load_target


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert [key_bucket(n, 4096) for n in (1, 256, 257, 1000, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]
    assert key_bucket(3000, 2100) == 2100  # never past the cache


NEEDS_HOST_BUILD = pytest.mark.skipif(host_library() is None, reason="the rows layout's CPU path needs a C++ compiler")


@pytest.mark.parametrize("which", ["tiny bfloat16", "demo float32",
                                   pytest.param("tiny rows layout", marks=NEEDS_HOST_BUILD)])
def test_padded_rows_and_tokens_leave_the_real_rows_bits(qwen3_pair, which):
    """bfloat16 (batch-invariant attention, oneDNN GEMMs), the demo target on the C++ kernels' layer stack, and the
    rows layout of --batch-invariant (what --cuda-graphs pads on a GPU; padding rows past the step's keys)."""
    if which == "tiny bfloat16":
        target, taps, vocab = load_target(qwen3_pair[3], dtype="bfloat16"), (1, 2), 128
    elif which == "tiny rows layout":
        target, taps, vocab = load_target(qwen3_pair[3], dtype="bfloat16", batch_invariant=True), (1, 2), 128
    else:
        target, taps, vocab = load_target(default_pair().target), (1, 3), 4096
    generator = torch.Generator().manual_seed(0)
    cache = target.new_state(5, 600)
    prompt = torch.randint(0, vocab, (4, 300), generator=generator)
    for slot in range(4):  # a context in each slot
        target.step(StepBatch(prompt[slot: slot + 1], torch.arange(300)[None], torch.tensor([slot])), cache)
    buckets = StepBuckets(target, cache, scratch_slot=4, block_size=8, taps=taps)
    for rows, tokens, slots in ((3, 1, [0, 2, 3]), (3, 5, [1, 2, 3]), (1, 8, [2]), (2, 1, [3, 0])):
        ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
        positions = torch.tensor([280 + 5 * r for r in range(rows)])[:, None] + torch.arange(tokens)
        want = target.step(StepBatch(ids, positions, torch.tensor(slots)), cache, taps)
        got = buckets.step(ids, positions, slots, int(positions.max()) + 1)
        assert got.hidden.shape == want.hidden.shape and torch.equal(got.hidden, want.hidden), (rows, tokens)
        assert torch.equal(got.taps, want.taps)


@pytest.mark.parametrize("batch_invariant", [False, pytest.param(True, marks=NEEDS_HOST_BUILD)])
def test_the_engine_serves_the_same_tokens_with_padded_steps(qwen3_pair, batch_invariant):
    target = load_target(qwen3_pair[3], dtype="bfloat16", batch_invariant=batch_invariant)
    drafter = random_drafter(tiny_draft_config(block_size=8), seed=1, std=0.2).to(torch.bfloat16)
    prompts = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66, 67, 68], [100, 2], [8, 8, 8, 1]]

    def serve(step_buckets):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=5,
                                 max_model_len=256)
        engine = SpeculativeEngine(target, proposer, max_requests=5, max_model_len=256, step_buckets=step_buckets)
        requests = [GenerationRequest(tuple(p), 40) for p in prompts[:3]] + [
            GenerationRequest(tuple(p), 40, SamplingParams(temperature=1.0, top_p=0.9, seed=i))
            for i, p in enumerate(prompts[3:])]
        return engine.generate(requests), engine

    plain, _ = serve(None)
    padded, engine = serve("eager")
    assert engine.state.num_slots == 6  # the scratch slot
    for got, want in zip(padded, plain):
        assert got.token_ids == want.token_ids and got.stats.draft_tokens > 0


def test_the_shapes_a_warm_up_covers():
    class Target:
        graphable_steps = True

    class State:
        capacity = 1032

    buckets = StepBuckets(Target(), State(), scratch_slot=6, block_size=8, taps=())
    shapes = buckets.all_shapes(6)
    assert {s.batch for s in shapes} == {1, 2, 4, 8} and {s.tokens for s in shapes} == {1, 8}
    assert sorted({s.key_length for s in shapes}) == [256, 512, 1024, 1032]
    assert len(shapes) == 4 * 2 * 4 and buckets.shape(5, 3, 700) in shapes and buckets.shape(1, 1, 1032) in shapes


def test_a_warm_up_before_the_first_request_changes_no_token(qwen3_pair):
    """engine.warm_up (what --cuda-graphs runs at start-up, there capturing every shape) writes the scratch slot
    alone: the tokens served after it are those served without it; it refuses once requests are in."""
    target = load_target(qwen3_pair[3], dtype="bfloat16")
    drafter = random_drafter(tiny_draft_config(block_size=8), seed=1, std=0.2).to(torch.bfloat16)
    prompts = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66, 67, 68]]

    def serve(warm: bool):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=3,
                                 max_model_len=256)
        engine = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=256, step_buckets="eager")
        lines = []
        if warm:
            assert engine.warm_up(progress=lines.append) == len(engine.buckets.all_shapes(3)) == 3 * 2 * 2
            assert lines[-1].startswith("warmed up for 12/12 decode step shapes")
        return [r.token_ids for r in engine.generate([GenerationRequest(tuple(p), 30) for p in prompts])], engine

    cold, _ = serve(False)
    warm, engine = serve(True)
    assert warm == cold
    engine.add(GenerationRequest((1, 2), 4))
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()


def test_padded_steps_refuse_what_they_cannot_run(qwen3_pair):
    target = load_target(qwen3_pair[3])
    with pytest.raises(ValueError, match="does not take padded steps"):
        StepBuckets(object(), None, 0, 8, ())
    with pytest.raises(ValueError, match="CUDA graphs need the target on a CUDA device"):
        StepBuckets(target, target.new_state(2, 64), 1, 8, (), graphs=True)
    with pytest.raises(ConfigError, match="step buckets must be"):
        SpeculativeEngine(target, None, step_buckets="graphs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cuda_graph_steps_serve_the_eager_padded_tokens(qwen3_pair, batch_invariant):
    """On a GPU: every decode step replayed from a CUDA graph per bucket; greedy tokens as the eager padded steps
    give them (near ties judged on CPU; exactly, and as unpadded plain decoding, with --batch-invariant), and
    graphs captured for the buckets used."""
    from greedy_check import assert_same_or_near_tie

    dtype = "bfloat16" if batch_invariant else "auto"
    target = load_target(qwen3_pair[3], device="cuda", dtype=dtype, batch_invariant=batch_invariant)
    drafter = random_drafter(tiny_draft_config(block_size=8), seed=1, std=0.2).to("cuda", target.embed_weight.dtype)
    prompts = [[3, 17, 22, 9, 41, 7, 99], [5], [60, 61, 62, 63, 64, 65, 66, 67, 68]]

    def serve(step_buckets, with_drafts=True):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=3,
                                 max_model_len=256) if with_drafts else None
        engine = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=256, step_buckets=step_buckets)
        if step_buckets == "cuda-graphs":  # as the verify worker does at start-up
            assert engine.warm_up() == len(engine.buckets.all_shapes(3)) == len(engine.buckets.captured)
        return engine.generate([GenerationRequest(tuple(p), 40) for p in prompts]), engine

    eager, _ = serve("eager")
    graphed, engine = serve("cuda-graphs")
    assert len(engine.buckets.captured) == len(engine.buckets.all_shapes(3))  # replayed, none captured late
    if batch_invariant:
        plain, _ = serve(None, with_drafts=False)
        assert [r.token_ids for r in graphed] == [r.token_ids for r in eager] == [r.token_ids for r in plain]
        return
    for prompt, got, want in zip(prompts, graphed, eager):
        assert_same_or_near_tie(qwen3_pair[1], prompt, got.token_ids, want.token_ids)


def test_a_failed_capture_leaves_eager_steps(qwen3_pair, caplog):
    """Where a CUDA graph cannot be captured (here: no CUDA at all), the step runs eagerly, says so once, and the
    later steps stay eager."""
    target = load_target(qwen3_pair[3], dtype="bfloat16")
    cache = target.new_state(3, 64)
    buckets = StepBuckets(target, cache, scratch_slot=2, block_size=4, taps=(1,))
    buckets.graphs = True  # as on a GPU whose capture then fails
    ids, positions = torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0, 1], [0, 1]])
    with caplog.at_level("WARNING", logger="dflash.step_buckets"):
        got = buckets.step(ids, positions, [0, 1], 2)
    assert not buckets.graphs and not buckets.captured
    assert "decode steps run eagerly from now on" in caplog.text
    want = target.step(StepBatch(ids, positions, torch.tensor([0, 1])), cache, (1,))
    assert torch.equal(got.hidden, want.hidden) and torch.equal(got.taps, want.taps)
