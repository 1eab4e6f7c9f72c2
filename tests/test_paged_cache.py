"""The paged KV cache (shared/kv_cache.py with engine/page_tables.py and engine/paging.py): the pool's bookkeeping,
every backend of the Qwen3 / Llama family reading through a scrambled page table exactly as through a slot a
request, and the engine's greedy and sampled output unchanged by paging, by prefix hits by page and by preemption
when the pool runs out."""

import random

import pytest
import torch

from draft_worker.local_proposer import LocalProposer
from shared.demo_models import DEMO_DIR
from shared.generation_request import GenerationRequest
from shared.kv_cache import PositionalKVCache
from shared.sampling_params import SamplingParams
from verify_worker.engine import SpeculativeEngine
from verify_worker.engine.page_tables import PageTables
from verify_worker.families.llama.backends import EagerLayers
from verify_worker.target_loader import load_target

PAGE = 64


def small_cache(num_pages: int, slots: int = 3, capacity: int = 4 * PAGE) -> PositionalKVCache:
    return PositionalKVCache(2, slots, 2, capacity, 8, torch.float32, page_size=PAGE, num_pages=num_pages)


def test_pages_are_given_held_indexed_and_evicted_least_recent_tail_first():
    cache = small_cache(6, capacity=8 * PAGE)
    tables = PageTables(cache)
    tokens = tuple(range(3 * PAGE + 5))
    tables.assign(0, tables.lookup(tokens))
    assert tables.grow(0, len(tokens)) and tables.slots[0].pages == [0, 1, 2, 3]
    assert cache.page_table[0, :4].tolist() == [0, 1, 2, 3]
    tables.index(0, tokens, None)
    assert tables.cached_pages == 3  # full pages only
    hit = tables.lookup(tokens + (9,))
    assert hit.pages == [0, 1, 2]
    assert tables.lookup(tokens[:2 * PAGE + 1]).pages == [0, 1]  # the last token is never reused
    assert tables.lookup((7,) + tokens[1:]) is None  # a chain: the first page differs, so nothing after it hits
    tables.assign(1, hit)  # one copy for two requests
    assert tables.holders[:4] == [2, 2, 2, 1]
    assert not tables.grow(1, 8 * PAGE)  # 5 more pages wanted, 2 available: nothing taken
    assert tables.available == 2 and tables.slots[1].pages == [0, 1, 2]
    tables.release(0)
    assert tables.available == 3 and list(tables.evictable) == []  # still held by slot 1; page 3 is free
    tables.release(1)
    assert list(tables.evictable) == [2, 1, 0]  # a chain's tail goes first
    tables.assign(2, None)
    assert tables.grow(2, 4 * PAGE)
    assert tables.slots[2].pages == [3, 4, 5, 2]  # free pages first, then the least recently used cached one
    assert tables.lookup(tokens + (9,)).pages == [0, 1]  # page 2's entry went with it


def test_a_request_s_last_page_partly_filled_is_copied_to_the_token():
    """An ended request's last page is indexed with the tokens it holds; a prompt that begins with some of them
    holds the full pages before it and gets those rows copied into a page of its own (the indexed one is never
    written)."""
    cache = small_cache(6)
    tables = PageTables(cache)
    tokens = tuple(range(PAGE + 20))
    tables.assign(0, None)
    assert tables.grow(0, len(tokens))
    k, v = torch.randn(1, len(tokens), 2, 8), torch.randn(1, len(tokens), 2, 8)
    cache.write(0, torch.tensor([0]), torch.arange(len(tokens))[None], k, v)
    tables.index(0, tokens, None, last=True)
    assert tables.cached_pages == 2 and tables.cached_tokens == PAGE + 20
    tables.release(0)
    hit = tables.lookup(tokens[:PAGE + 10] + (999, 5))
    assert hit.pages == [0] and hit.partial.page == 1 and hit.rows == 10
    assert tables.assign(1, hit) == PAGE + 10
    assert tables.slots[1].pages[0] == 0 and tables.slots[1].pages[1] not in (0, 1)
    keys, _ = cache.read(0, torch.tensor([1]), PAGE + 10)
    assert torch.equal(keys[0].transpose(0, 1), k[0, :PAGE + 10])
    assert tables.lookup(tokens + (1,)).rows == 20  # the indexed page kept its rows


def test_the_partial_page_found_is_the_one_a_prompt_begins_with_most_of():
    """Many ended requests' last pages under one parent: the lookup's pick (a neighbour in sorted order) is the
    brute force's best."""
    from verify_worker.engine.prefix_cache import common_prefix

    cache = small_cache(40, slots=1, capacity=PAGE)
    tables = PageTables(cache)
    rng = random.Random(5)
    held = []
    for _ in range(30):
        tokens = tuple(rng.randrange(3) for _ in range(rng.randrange(16, PAGE)))
        tables.assign(0, None)
        assert tables.grow(0, len(tokens))
        tables.index(0, tokens, None, last=True)
        tables.release(0)
        held.append(tokens)
    for _ in range(200):
        prompt = tuple(rng.randrange(3) for _ in range(rng.randrange(2, PAGE)))
        best = max(common_prefix(tokens, prompt[:-1]) for tokens in held)
        hit = tables.lookup(prompt)
        assert (hit.rows if hit is not None else 0) == best


def test_fresh_pages_are_zeroed_and_unassigned_positions_name_the_scratch_page():
    cache = small_cache(4)
    for tensor in cache.keys + cache.values:
        tensor.fill_(float("nan"))  # what torch.empty may hold
    tables = PageTables(cache)
    tables.assign(0, None)
    assert tables.grow(0, PAGE + 1)
    assert not cache.keys[0][:2].isnan().any() and cache.keys[0][2:4].isnan().all()
    assert cache.page_table[0].tolist() == [0, 1, cache.scratch_page, cache.scratch_page]


def test_a_paged_read_equals_the_slot_read_of_the_same_writes():
    torch.manual_seed(0)
    paged, slotted = small_cache(12), PositionalKVCache(2, 3, 2, 4 * PAGE, 8, torch.float32)
    tables = PageTables(paged)
    random.Random(1).shuffle(tables.free)  # pages in no order
    for slot in range(3):
        tables.assign(slot, None)
        assert tables.grow(slot, 3 * PAGE)
    slots = torch.tensor([2, 0, 1])
    positions = torch.arange(3 * PAGE - 10).expand(3, -1) + torch.tensor([[0], [5], [10]])
    k, v = torch.randn(3, positions.shape[1], 2, 8), torch.randn(3, positions.shape[1], 2, 8)
    for cache in (paged, slotted):
        cache.write(1, slots, positions, k, v)
    for read_slots in (slots, slice(0, 2)):
        for got, want in zip(paged.read(1, read_slots, 150), slotted.read(1, read_slots, 150)):
            assert torch.equal(got, want)


def _scrambled_paged_state(target, slots: int, capacity: int):
    state = target.new_paged_state(slots, capacity, PAGE, 4 * slots * (capacity // PAGE + 1))
    tables = PageTables(state)
    rng = random.Random(3)
    rng.shuffle(tables.free)
    for slot in range(slots):
        tables.assign(slot, None)
        assert tables.grow(slot, capacity)
    return state


@pytest.mark.parametrize("backend", ["whole stack (demo)", "op by op (tiny Qwen3)", "PyTorch (tiny Qwen3)"])
def test_every_backend_reads_pages_as_it_reads_slots(qwen3_pair, backend):
    """A prefill then a verify block of 9 through a scrambled page table: the same bits as a slot a request."""
    target = load_target(DEMO_DIR / "target") if backend.endswith("(demo)") else qwen3_pair[1]
    saved = target.backend
    if backend.startswith("PyTorch"):
        target.backend = None
    try:
        with torch.inference_mode():
            outputs = []
            for state in (target.new_state(3, 256), _scrambled_paged_state(target, 3, 256)):
                gen = torch.Generator().manual_seed(5)
                ids = torch.randint(0, 100, (3, 150), generator=gen)
                slots = torch.tensor([1, 2, 0])
                first = target(ids, torch.arange(150).expand(3, -1), state, slots, ())
                block = torch.randint(0, 100, (3, 9), generator=gen)
                second = target(block, 150 + torch.arange(9).expand(3, -1), state, slots, ())
                outputs.append((first.hidden, second.hidden))
        for got, want in zip(*outputs):
            assert torch.equal(got, want)
        if backend.startswith("PyTorch"):
            assert isinstance(EagerLayers.of(first.hidden, target.rows_layout, True), EagerLayers)
    finally:
        target.backend = saved


def _outputs(engine, requests):
    return [(r.token_ids, r.finish_reason) for r in engine.generate(requests)]


def test_greedy_output_is_the_same_paged_with_preemption_and_slot_by_slot(qwen3_pair):
    """Eight requests of mixed lengths on a pool of 12 pages (a request of 256 positions takes 5): admission waits,
    decoding requests are preempted and rebuilt, and every output equals the slot-a-request engine's."""
    _, target, drafter, _ = qwen3_pair
    rng = random.Random(7)
    prefix = tuple(rng.randrange(120) for _ in range(70))
    prompts = [(prefix if i % 2 else ()) + tuple(rng.randrange(120) for _ in range(5 + 17 * i)) for i in range(8)]
    requests = [GenerationRequest(p, min(80, 250 - len(p)), request_id=f"r{i}") for i, p in enumerate(prompts)]

    def engine(**args):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=8,
                                 max_model_len=256)
        return SpeculativeEngine(target, proposer, max_requests=8, max_model_len=256, max_prefill_tokens=64, **args)

    small = engine(kv_pages=12)
    paged = _outputs(small, requests)
    assert small.preemptions > 0
    assert small.pages.used == 0 and small.pages.available == 12  # every page back: free or cached
    assert paged == _outputs(engine(page_size=None), requests)
    assert paged == _outputs(engine(kv_pages=12, prefix_caching=False), requests)


def test_prefix_hits_by_page_share_pages_and_answer_as_uncached(qwen3_pair):
    """Prompts sharing prefixes that end inside a page and inside a verify block: hits are whole pages held and the
    rows of the next page copied, two running requests hold one copy of their common full pages, and the output
    is the uncached engine's."""
    _, target, drafter, _ = qwen3_pair
    rng = random.Random(11)
    system = tuple(rng.randrange(120) for _ in range(150))
    prompts = [system[:n] + tuple(rng.randrange(120) for _ in range(7)) for n in (150, 150, 131, 70, 64)]
    results = []
    for caching in (True, False):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=3,
                                 max_model_len=256)
        engine = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=256, prefix_caching=caching)
        first = engine.generate([GenerationRequest(prompts[0], 20, request_id="first")])
        states = [engine.add(GenerationRequest(p, 20, request_id=f"r{i}")) for i, p in enumerate(prompts[1:3])]
        engine.step()
        if caching:  # both hold the first's two full pages of the system prompt
            shared = engine.pages.slots[states[0].slot].pages[:2]
            assert shared == engine.pages.slots[states[1].slot].pages[:2]
            assert [engine.pages.holders[p] for p in shared] == [2, 2]
        while engine.has_work():
            engine.step()
        later = engine.generate([GenerationRequest(p, 20, request_id=f"l{i}") for i, p in enumerate(prompts[3:])])
        results.append([first[0].token_ids] + [s.output_ids for s in states] + [r.token_ids for r in later])
        cached = [s.stats.cached_tokens for s in states] + [r.stats.cached_tokens for r in later]
        assert cached == ([150, 131, 70, 64] if caching else [0, 0, 0, 0])  # to the token
    assert results[0] == results[1]


def test_sampled_requests_draw_the_same_tokens_paged_and_preempted(qwen3_pair):
    """Seeded sampling: speculative, paged as slot by slot (the same batches); plain, with preemptions too (a
    preempted request keeps its random stream). Speculative drafts depend on the batch beside them (a DFlash block
    is as wide as the batch's widest), so under preemption a sampled request's tokens differ while their
    distribution does not (tests/test_sampling_lossless.py)."""
    _, target, drafter, _ = qwen3_pair
    requests = [GenerationRequest(tuple(range(3, 40 + 20 * i)), 100, SamplingParams(1.0, seed=i), request_id=f"s{i}")
                for i in range(4)]
    for speculative, paged in ((True, {}), (False, {"kv_pages": 6})):
        outs = []
        for args in (paged, {"page_size": None}):
            proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8,
                                     max_requests=4, max_model_len=256) if speculative else None
            engine = SpeculativeEngine(target, proposer, max_requests=4, max_model_len=256, **args)
            outs.append(_outputs(engine, requests))
            if "kv_pages" in args:
                assert engine.preemptions > 0
        assert outs[0] == outs[1]


def test_a_pool_smaller_than_one_request_is_refused(qwen3_pair):
    with pytest.raises(Exception, match="cannot hold one request"):
        SpeculativeEngine(qwen3_pair[1], max_requests=2, max_model_len=256, kv_pages=3)
