"""The drafter's every layer in one C++ call (draft_block.cpp) computes what the per-op path computes, bit for bit:
the block's hidden states and every layer's cache, for DFlash and DFlash 2 (live convolutions), sliding-window
and full layers, float32 and bfloat16 caches, one thread and a pool; and a request outside the cache is refused
before anything is written."""

import pytest
import torch
from conftest import tiny_draft_config

from draft_worker.draft_checkpoint import load_drafter, random_drafter
from shared.cpu_kernels.library import cpu_kernels
from shared.demo_models import default_pair
from shared.draft_config import DFlash2Settings

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")

CONV = DFlash2Settings(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


def bf16_drafter(dflash2: bool, layers: int, seed: int = 4, layout: str = "bf16"):
    """A random drafter whose weights a bfloat16 checkpoint could hold (so the C++ layout applies), its DFlash 2
    convolutions live (not the identity they start as), packed for the C++ kernels."""
    overrides = {}
    if layers > 1:  # a sliding-window layer (causal inside the block) beside a full one
        overrides = dict(layer_types=("sliding_attention",) + ("full_attention",) * (layers - 1), sliding_window=5)
    cfg = tiny_draft_config(layers=layers, block_size=8, dflash2=CONV if dflash2 else None, **overrides)
    drafter = random_drafter(cfg, seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if dflash2:
            for layer in drafter.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.kernel_projection.weight.normal_(0, 0.1, generator=gen)
                    conv.base_kernel.normal_(0, 1, generator=gen)
        for param in drafter.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return drafter.pack(layout)


def run_block(drafter, one_call: bool, kv_dtype, pool=None):
    """Ingest two requests' contexts, then denoise one block each; -> (block hidden [2, B, H], keys, values)."""
    cfg = drafter.config
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(20, cfg.num_taps * cfg.hidden_size, generator=gen)
    embeds = torch.randn(2, cfg.block_size, cfg.hidden_size, generator=gen)
    cache = drafter.new_cache(3, 64)
    cache.keys = [k.to(kv_dtype) for k in cache.keys]
    cache.values = [v.to(kv_dtype) for v in cache.values]
    native, drafter.native_block = drafter.native_block, (drafter.native_block if one_call else None)
    drafter.pool = pool
    try:
        with torch.inference_mode():
            drafter.ingest_context(cache, torch.tensor([0] * 12 + [2] * 8),
                                   torch.cat([torch.arange(12), torch.arange(8)]), features)
            hidden = drafter.block_hidden(cache, torch.tensor([0, 2]), torch.tensor([12, 8]), embeds)
    finally:
        drafter.native_block, drafter.pool = native, None
    return hidden, cache.keys, cache.values


@pytest.mark.parametrize("layout", ["bf16", pytest.param("amx", marks=pytest.mark.skipif(
    cpu_kernels() is None or not cpu_kernels().amx, reason="no AMX here"))])
@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
def test_one_call_block_equals_the_per_op_block_bit_for_bit(dflash2, layers, kv_dtype, layout):
    drafter = bf16_drafter(dflash2, layers, layout=layout)
    assert drafter.native_block is not None and drafter.native_block.c_shape.amx == (layout == "amx")
    assert drafter.native_block.context is not None  # the context rows go in through the one-call ingest too
    per_op = run_block(drafter, one_call=False, kv_dtype=kv_dtype)
    one_call = run_block(drafter, one_call=True, kv_dtype=kv_dtype)
    assert torch.equal(per_op[0], one_call[0])
    for ours, theirs in zip(per_op[1] + per_op[2], one_call[1] + one_call[2]):
        assert torch.equal(ours, theirs)


def test_one_call_block_is_the_same_on_a_pool_of_threads():
    drafter = bf16_drafter(True, 2, seed=6)
    kernels = cpu_kernels()
    alone = run_block(drafter, one_call=True, kv_dtype=torch.float32)
    for threads in (2, 3):
        pool = kernels.worker_pool(threads)
        try:
            shared = run_block(drafter, one_call=True, kv_dtype=torch.float32, pool=pool)
        finally:
            pool.close()
        assert torch.equal(alone[0], shared[0])
        assert all(torch.equal(a, b) for a, b in zip(alone[1] + alone[2], shared[1] + shared[2]))


def test_a_block_outside_the_cache_is_refused_before_anything_is_written():
    drafter = bf16_drafter(True, 2)
    cfg = drafter.config
    cache = drafter.new_cache(2, 16)
    before = [k.clone() for k in cache.keys]
    embeds = torch.zeros(2, cfg.block_size, cfg.hidden_size)
    # slot 0's block fits; slot 1's (positions 12-19 of 16) does not
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache"):
        drafter.block_hidden(cache, torch.tensor([0, 1]), torch.tensor([0, 12]), embeds)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys))


def test_context_rows_outside_the_cache_are_refused_before_anything_is_written():
    drafter = bf16_drafter(True, 2)
    assert drafter.native_block.context is not None  # the one-call ingest refuses them (the per-op path does too)
    cfg = drafter.config
    cache = drafter.new_cache(2, 16)
    before = [k.clone() for k in cache.keys + cache.values]
    features = torch.ones(3, cfg.num_taps * cfg.hidden_size)
    for slots, positions in (([0, 0, 1], [14, 15, 16]), ([0, 2, 1], [0, 1, 2])):  # a position, then a slot, outside
        with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache"):
            drafter.ingest_context(cache, torch.tensor(slots), torch.tensor(positions), features)
        assert all(torch.equal(a, b) for a, b in zip(before, cache.keys + cache.values))


def test_the_served_demo_drafter_takes_the_one_call_path():
    """Packed as the proposers pack it, the embedded DFlash 2 drafter denoises in one C++ call (a weight that
    fell off the C++ layout would silently send it back to the per-op path)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the draft worker runs PyTorch on two cores: the drafter on the C++ kernels
    try:
        drafter = load_drafter(default_pair().draft, dtype=torch.float32, device="cpu").pack()
    finally:
        torch.set_num_threads(before)
    assert drafter.kernels is not None
    assert drafter.native_block is not None and drafter.native_block.c_shape.conv_kernel > 0
    assert drafter.native_block.context is not None
