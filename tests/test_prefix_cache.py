"""Prefixes computed once (verify_worker/engine/prefix_cache.py): the index's choices, and greedy output identical
with caching on and off, speculative (the demo pair's DFlash and DFlash 2 drafters, a random drafter on a tiny
Qwen3) and plain, on a multi-turn trace whose prompts share prefixes of many lengths (ending inside the first
prompt, inside an answer, inside a verify block), and on a GLM-5.2 (MLA, DSA) target; sampled requests draw the same
tokens."""

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from shared.demo_models import DEMO_DIR
from shared.generation_request import GenerationRequest
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.engine.prefix_cache import PrefixCache, PrefixHit, common_prefix
from verify_worker.target_loader import load_target

HELD_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts_heldout.json"


def test_common_prefix_agrees_with_a_plain_scan_across_chunk_edges():
    rng = random.Random(0)
    for _ in range(200):
        a = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 700)))
        cut = rng.randrange(0, len(a) + 1)
        b = a[:cut] + tuple(rng.randrange(3) for _ in range(rng.randrange(0, 300)))
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == want


def test_the_longest_prefix_wins_the_last_token_is_never_reused_and_hits_align():
    cache = PrefixCache(align=4, keep_at_least=1)
    cache.store(0, (1, 2, 3, 4, 5, 6, 7, 8, 9), None)
    cache.store(1, (1, 2, 3, 4, 5, 6), torch.arange(6.0)[:, None])
    cache.store(2, (9, 9), None)
    hit = cache.lookup((1, 2, 3, 4, 5, 6, 7))  # 6 tokens shared at most (the last is prefilled)
    assert hit.slot in (0, 1) and hit.tokens == 4  # aligned down to a multiple of 4
    cache.store(hit.slot, (1, 2, 3, 4, 5, 6, 7, 8, 9), None)
    assert cache.lookup((1, 2, 3, 4, 5, 6, 7, 8, 9)) == PrefixHit(hit.slot, 8, None)
    assert cache.lookup((5, 5, 5)) is None
    plain = PrefixCache(keep_at_least=1)
    plain.store(1, (1, 2, 3, 4, 5, 6), torch.arange(6.0)[:, None])
    hit = plain.lookup((1, 2, 3, 9))
    assert (hit.slot, hit.tokens, hit.features.flatten().tolist()) == (1, 3, [0.0, 1.0, 2.0])
    plain.forget(1)  # the request took the slot itself
    assert plain.lookup((1, 2, 3, 9)) is None


def test_a_request_that_hits_nothing_takes_an_empty_slot_then_the_least_recently_used():
    cache = PrefixCache(keep_at_least=1)
    cache.store(3, (1,), None)
    cache.store(1, (2,), None)
    assert cache.evictable([1, 3, 5]) == 5
    assert cache.evictable([1, 3]) == 3  # stored first: used least recently
    cache.touch(3)  # copied from just now: the most recently used
    assert cache.evictable([1, 3]) == 1 and cache.empty_slot([1, 3]) is None
    cache.forget(3)
    assert cache.evictable([1, 3]) == 3 == cache.empty_slot([1, 3])


def test_short_prefixes_are_not_kept_so_short_requests_cycle_one_slot():
    """The readiness probe's 4 tokens every 2 s must not push an agent's history out of the cache."""
    cache = PrefixCache()
    cache.store(0, tuple(range(100)), None)
    for _ in range(10):  # probes on a 2-slot engine: each takes the empty slot and leaves it empty
        slot = cache.evictable([1, 0])
        assert slot == 1
        cache.store(slot, (0, 5, 6), None)
    assert cache.lookup(tuple(range(120))).tokens == 100


def trace(first: list[int], tail: list[list[int]], engine: SpeculativeEngine, max_tokens: int) -> list:
    """An agent's turns, one after the other: each prompt is the last prompt, its answer and a new message.
    Returns each turn's (tokens, verify steps): the drafter's context is the same with a hit, so are its drafts."""
    prompt, outputs = list(first), []
    for turn, message in enumerate([[]] + tail):
        prompt = prompt + (outputs[-1][0] if outputs else []) + message
        result = engine.generate([GenerationRequest(tuple(prompt), max_tokens, request_id=f"t{turn}")])[0]
        outputs.append((result.token_ids, result.stats.verify_steps))
    return outputs


def served_twice(target, proposer_of, prompts_and_tails, max_tokens: int, **engine_args):
    """Each trace with caching on and off: (outputs on, outputs off, prompt tokens cached on)."""
    results = []
    for caching in (True, False):
        proposer = proposer_of()
        engine = SpeculativeEngine(target, proposer, prefix_caching=caching, **engine_args)
        outputs = [trace(first, tails, engine, max_tokens) for first, tails in prompts_and_tails]
        results.append((outputs, engine.prefix_hit_tokens))
    (on, cached_on), (off, cached_off) = results
    assert cached_off == 0
    return on, off, cached_on


@pytest.mark.parametrize("drafter_name", [None, "draft", "draft2"])
def test_the_demo_pair_answers_the_same_with_caching_on_and_off(drafter_name):
    target = load_target(DEMO_DIR / "target")
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))
    code = [p["prompt"] for p in json.loads(HELD_OUT.read_text())]
    first = tokenizer.encode(code[0]).ids
    tails = [tokenizer.encode(text).ids for text in ("\n# next\n", code[1][:40], "\ndef ")]
    drafter = None if drafter_name is None else load_drafter(DEMO_DIR / drafter_name)

    def proposer():
        return None if drafter is None else LocalProposer(drafter, target.embed_weight, target.lm_head_weight,
                                                         block_size=8, max_requests=4, max_model_len=1024)

    on, off, cached = served_twice(target, proposer, [(first, tails), (first[:len(first) // 2], tails[:1])], 24,
                                   max_requests=4, max_model_len=1024, max_prefill_tokens=32)
    assert on == off
    assert cached > len(first)  # later turns reused what earlier ones computed


@pytest.mark.parametrize("slots", [1, 2], ids=["moved", "copied"])
def test_a_random_drafter_on_qwen3_and_a_glm52_target_answer_the_same_with_caching_on_and_off(qwen3_pair, tmp_path,
                                                                                            slots):
    """One slot: a hit takes the kept slot itself; two: the prefix is copied into the empty one."""
    from test_glm_moe_dsa import random_glm

    _, qwen3, drafter, _ = qwen3_pair
    rng = random.Random(4)
    first = [rng.randrange(120) for _ in range(37)]
    tails = [[rng.randrange(120) for _ in range(n)] for n in (3, 9, 1)]

    def proposer():
        return LocalProposer(drafter, qwen3.embed_weight, qwen3.lm_head_weight, block_size=8, max_requests=slots,
                             max_model_len=256)

    on, off, cached = served_twice(qwen3, proposer, [(first, tails)], 12, max_requests=slots, max_model_len=256,
                                   max_prefill_tokens=16)
    assert on == off and cached > 0
    random_glm(seed=2, max_position_embeddings=256).save_pretrained(tmp_path / "glm")
    glm = load_target(tmp_path / "glm")
    on, off, cached = served_twice(glm, lambda: None, [(first, tails)], 8, max_requests=slots, max_model_len=256)
    assert on == off and cached > 0


def test_sampled_requests_draw_the_same_tokens_with_caching_on_and_off(qwen3_pair):
    _, target, drafter, _ = qwen3_pair
    prompt = tuple(range(3, 40))
    outs = []
    for caching in (True, False):
        engine = SpeculativeEngine(target, LocalProposer(drafter, target.embed_weight, target.lm_head_weight,
                                                         block_size=8, max_requests=2, max_model_len=256),
                                   max_requests=2, max_model_len=256, prefix_caching=caching)
        runs = [engine.generate([GenerationRequest(prompt + (i,), 10, SamplingParams(1.0, seed=i))])[0].token_ids
                for i in range(4)]
        outs.append(runs)
    assert outs[0] == outs[1]


def test_concurrent_prompts_share_one_kept_prefix_by_copies(qwen3_pair):
    """Two requests admitted together after a third left its prefix: each prefills only past it, in a slot of its
    own the prefix is copied into, and the prefix stays kept; their output is the uncached engine's."""
    _, target, drafter, _ = qwen3_pair
    rng = random.Random(9)
    shared = tuple(rng.randrange(120) for _ in range(40))
    later = [GenerationRequest(shared + tuple(rng.randrange(120) for _ in range(n)), 10, request_id=f"r{n}")
             for n in (3, 5)]
    outputs = []
    for caching in (True, False):
        engine = SpeculativeEngine(target, LocalProposer(drafter, target.embed_weight, target.lm_head_weight,
                                                         block_size=8, max_requests=3, max_model_len=256),
                                   max_requests=3, max_model_len=256, prefix_caching=caching, page_size=None)
        engine.generate([GenerationRequest(shared + (7,), 6, request_id="first")])
        results = engine.generate(later)
        outputs.append([(r.token_ids, r.stats.verify_steps) for r in results])
        if caching:
            assert [r.stats.cached_tokens for r in results] == [40, 40]
            assert len(engine.prefix_cache.entries) == 3  # the first's prefix kept, beside the two new ones
    assert outputs[0] == outputs[1]


def test_a_prompt_arriving_while_another_of_its_prefix_runs_copies_that_prefix(qwen3_pair):
    """A second request of one system prompt, admitted while the first still decodes: the first's committed
    prompt positions are copied into its slot (they are final), and its output is the uncached engine's."""
    _, target, drafter, _ = qwen3_pair
    rng = random.Random(12)
    system = tuple(rng.randrange(120) for _ in range(48))
    first = GenerationRequest(system + (5, 6), 30, request_id="first")
    second = GenerationRequest(system + (9,), 12, request_id="second")
    outputs = []
    for caching in (True, False):
        engine = SpeculativeEngine(target, LocalProposer(drafter, target.embed_weight, target.lm_head_weight,
                                                         block_size=8, max_requests=2, max_model_len=256),
                                   max_requests=2, max_model_len=256, prefix_caching=caching, page_size=None)
        states = [engine.add(first)]
        while not engine.running:  # the first's prompt is prefilled; it decodes
            engine.step()
        states.append(engine.add(second))
        while engine.has_work():
            engine.step()
        outputs.append([(s.output_ids, s.stats.verify_steps) for s in states])
        assert states[1].stats.cached_tokens == (48 if caching else 0)
    assert outputs[0] == outputs[1]
