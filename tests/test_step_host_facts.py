"""The host's facts in a StepBatch (key_length, slot_range) and in the drafter's block: the same rows as a step
that reads them back from the device, and with them the step reads nothing back (what a CUDA graph capture
needs); the graph itself on a GPU."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from verify_worker.families.interface import StepBatch
from verify_worker.target_loader import load_target

READS_BACK = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__int__, torch.Tensor.__bool__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.equal}


class DeviceReads(TorchFunctionMode):
    """Records every torch function that hands a tensor's value to the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS_BACK:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def steps(target, batch_facts: dict, slots: list[int]):
    """A prefill of 3 ragged rows then one verify block of 4, in a fresh cache; the logits of both."""
    cache = target.new_cache(6, 64)
    prompts = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [42, 43, 44, 45, 46]])
    positions = torch.arange(5)[None].expand(3, -1) + torch.tensor([[0], [2], [1]])
    slot_tensor = torch.tensor(slots)
    outs = []
    for ids, pos in ((prompts, positions), (prompts[:, :4] + 3, positions[:, -1:] + 1 + torch.arange(4))):
        facts = {key: value(pos) for key, value in batch_facts.items()}
        outs.append(target.logits(target.step(StepBatch(ids, pos, slot_tensor, **facts), cache).hidden))
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [[2, 3, 4], [4, 0, 2]])
def test_host_facts_give_the_rows_of_a_step_without_them(qwen3_pair, dtype, slots):
    folder = qwen3_pair[3]
    target = load_target(folder, dtype=dtype)
    consecutive = slots == list(range(slots[0], slots[0] + 3))
    reference = steps(target, {}, slots)
    exact = {"key_length": lambda pos: int(pos.max()) + 1,
             "slot_range": lambda pos: (slots[0], slots[0] + 3) if consecutive else None}
    by_index = {"key_length": lambda pos: int(pos.max()) + 1}
    for facts in (exact, by_index):
        for got, want in zip(steps(target, facts, slots), reference):
            assert torch.equal(got, want)


def test_a_larger_key_length_gives_the_same_greedy_rows(qwen3_pair):
    """A bucketed key length (what a captured graph attends over): the mask hides the extra keys."""
    target = load_target(qwen3_pair[3], pack=False)
    reference = steps(target, {}, [0, 1, 2])
    for got, want in zip(steps(target, {"key_length": lambda pos: 48}, [0, 1, 2]), reference):
        assert (got - want).abs().max() <= 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_with_host_facts_the_step_reads_nothing_back(qwen3_pair):
    """The path a GPU takes (the "fused" layout, PyTorch's attention): no value goes to the host during the step
    when the batch carries the facts, and the check would see the reads of a step without them."""
    target = load_target(qwen3_pair[3], pack=False).pack("fused")
    cache = target.new_cache(4, 32)
    ids, positions, slots = torch.tensor([[3, 4, 5]]), torch.tensor([[0, 1, 2]]), torch.tensor([1])
    with DeviceReads() as without:
        target.step(StepBatch(ids, positions, slots), cache)
    assert without.calls, "the check sees no read back: it cannot fail"
    for facts in ({"key_length": 3, "slot_range": (1, 2)}, {"key_length": 16}):
        with DeviceReads() as reads:
            target.logits(target.step(StepBatch(ids, positions, slots, **facts), cache).hidden)
        assert reads.calls == []


@pytest.mark.parametrize("version", [1, 2])
def test_the_drafters_block_with_host_facts_reads_nothing_back_and_gives_the_same_rows(version):
    """The drafter's block on the path a GPU takes (unpacked modules, PyTorch's attention): with the host's
    facts it gives the rows of a block without them and reads nothing back (without them: once, not per layer)."""
    from conftest import tiny_draft_config

    from draft_worker.dflash2_model import upgrade_to_dflash2
    from draft_worker.draft_checkpoint import random_drafter
    from shared.draft_config import DFlash2Settings

    drafter = random_drafter(tiny_draft_config(layers=2, block_size=6), seed=9, std=0.2)
    if version == 2:
        drafter = upgrade_to_dflash2(drafter, DFlash2Settings(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4))
    generator = torch.Generator().manual_seed(0)
    cache = drafter.new_cache(4, 32)
    for slot, length in ((1, 13), (2, 9), (3, 4)):
        features = torch.randn(length, 2 * 64, generator=generator)
        drafter.ingest_context(cache, torch.full((length,), slot), torch.arange(length), features)
    block = torch.randn(3, 6, 64, generator=generator)
    starts = torch.tensor([13, 9, 4])
    for slots, slot_range in ((torch.tensor([1, 2, 3]), (1, 4)), (torch.tensor([3, 1, 2]), None)):
        with DeviceReads() as without:
            want = drafter.block_hidden(cache, slots, starts, block)
        assert 0 < len(without.calls) <= 4  # the length and the slot check (int, int, cpu, equal): once, not per layer
        with DeviceReads() as reads:
            got = drafter.block_hidden(cache, slots, starts, block, key_length=19, slot_range=slot_range)
        assert reads.calls == []
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_graph_replay_gives_the_eager_steps_bits(qwen3_pair):
    from verify_worker.cuda_graph_step import CudaGraphStep, StepShape

    target = load_target(qwen3_pair[3], device="cuda", dtype="bfloat16")
    cache = target.new_cache(4, 64)
    first = (torch.zeros(2, 4, dtype=torch.long), torch.arange(4).repeat(2, 1), torch.tensor([3, 1]))
    graph = CudaGraphStep(target, cache, StepShape(batch=2, tokens=4, key_length=32), *first)
    assert torch.equal(graph.outputs.logits, target.logits(target.step(
        StepBatch(*(t.cuda() for t in first), key_length=32), cache).hidden))  # built from its first step
    generator = torch.Generator().manual_seed(0)
    for start in (3, 11):  # two replays with different inputs: the graph reads the new ones
        ids = torch.randint(0, 128, (2, 4), generator=generator).cuda()
        positions = (torch.tensor([[start], [start + 5]]) + torch.arange(4)).cuda()
        slots = torch.tensor([2, 0]).cuda()
        replayed = graph.run(ids, positions, slots).logits.clone()
        eager = target.logits(target.step(StepBatch(ids, positions, slots, key_length=32), cache).hidden)
        assert torch.equal(replayed, eager)
    with pytest.raises(ValueError, match="for 2 rows of 4 tokens"):
        graph.run(ids[:1], positions[:1], slots[:1])
