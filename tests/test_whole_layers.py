"""The target's layers in one kernel call (shared/cpu_kernels/decoder_layer.cpp) compute exactly what the
per-op kernel path computes: hidden states, taps (in the asked order) and every cache entry equal bit for bit,
for Qwen3 (q/k norms) and Llama (none), verify blocks, padding rows and slots in any order; layers it does not
take keep the per-op path."""

import pytest
import torch

from shared.cpu_kernels.library import cpu_kernels
from tests.conftest import write_hf_checkpoint
from verify_worker.families.llama.backends import KernelLayers
from verify_worker.target_loader import load_target

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")


needs_amx = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().amx, reason="no AMX here")


def _packed(folder, family: str, layout: str = "bf16", **overrides):
    write_hf_checkpoint(folder, family, seed=5, dtype=torch.bfloat16, max_position_embeddings=512, **overrides)
    return load_target(folder, dtype="float32", pack=False).pack(layout)


def _run(target, whole: bool, prompt, ids, positions, slots):
    """Prefill then one step, through whole layers or the per-op path; (output, cache)."""
    saved = target.backend
    target.backend = saved if whole else KernelLayers(saved.kernels)
    try:
        cache = target.new_cache(6, 64)
        batch, context = prompt.shape
        with torch.inference_mode():
            target(prompt, torch.arange(context)[None].expand(batch, -1), cache, slots)
            return target(ids, positions, cache, slots, (1, 0)), cache
    finally:
        target.backend = saved


@pytest.mark.parametrize("layout", ["bf16", pytest.param("amx", marks=needs_amx)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("batch,seq,slots", [(1, 1, [0]), (1, 8, [3]), (3, 5, [4, 0, 2]), (4, 2, [1, 2, 3, 4])],
                         ids=["plain", "verify8", "scattered", "consecutive"])
def test_whole_layers_equal_the_per_op_path_bit_for_bit(tmp_path, family, batch, seq, slots, kv_dtype, layout):
    target = _packed(tmp_path, family, layout)
    target.kv_dtype = kv_dtype  # a bfloat16 cache: what --dtype auto keeps under float32 maths
    assert target.whole_layers is not None and len(target.whole_layers.layers) == target.config.num_layers
    assert target.whole_layers.c_shape.amx == (layout == "amx")
    generator = torch.Generator().manual_seed(batch * 10 + seq)
    context = 11
    prompt = torch.randint(0, 128, (batch, context), generator=generator)
    ids = torch.randint(0, 128, (batch, seq), generator=generator)
    positions = context + torch.arange(seq)[None].expand(batch, -1).clone()
    positions[-1, seq // 2:] = context + seq // 2 + 20  # a padded row: its tail sits at later, unseen positions
    slots = torch.tensor(slots)
    (fused, fused_cache), (per_op, per_op_cache) = (_run(target, w, prompt, ids, positions, slots) for w in (True, False))
    assert torch.equal(fused.hidden, per_op.hidden) and torch.equal(fused.taps, per_op.taps)
    for a, b in zip(fused_cache.keys + fused_cache.values, per_op_cache.keys + per_op_cache.values):
        assert a.dtype == kv_dtype and torch.equal(a, b)


def test_a_position_outside_the_cache_is_refused_before_anything_is_written(tmp_path):
    target = _packed(tmp_path, "qwen3")
    cache = target.new_cache(2, 16)
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache"):
        target(torch.tensor([[1, 2]]), torch.tensor([[15, 16]]), cache, torch.tensor([1]))
    assert all(not t.any() for t in cache.keys + cache.values)


def test_layers_with_a_bias_keep_the_per_op_path(tmp_path):
    target = _packed(tmp_path, "llama", attention_bias=True)
    assert target.kernels is not None and target.whole_layers is None


def _step(target, prompt, ids, positions, slots):
    """Prefill then one step (the whole-layer path); (output, logits of the step, cache)."""
    cache = target.new_cache(6, 64)
    batch, context = prompt.shape
    with torch.inference_mode():
        target(prompt, torch.arange(context)[None].expand(batch, -1), cache, slots)
        out = target(ids, positions, cache, slots, (1, 0))
        return out, target.logits(out.hidden), cache


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("batch,seq,slots", [(1, 1, [0]), (1, 8, [3]), (3, 5, [4, 0, 2])],
                         ids=["plain", "verify8", "scattered"])
def test_the_stack_shared_between_threads_gives_the_same_bits(tmp_path, threads, batch, seq, slots):
    target = _packed(tmp_path, "qwen3")
    target.kv_dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(threads * 100 + batch)
    context = 23
    prompt = torch.randint(0, 128, (batch, context), generator=generator)
    ids = torch.randint(0, 128, (batch, seq), generator=generator)
    positions = context + torch.arange(seq)[None].expand(batch, -1)
    slots = torch.tensor(slots)
    alone = _step(target, prompt, ids, positions, slots)
    target.share_kernel_threads(threads)
    assert target.pool is not None and target.pool.threads == threads and target.head.pool is target.pool
    shared = _step(target, prompt, ids, positions, slots)
    target.share_kernel_threads(1)
    assert target.pool is None and target.head.pool is None
    (out_a, logits_a, cache_a), (out_s, logits_s, cache_s) = alone, shared
    assert torch.equal(out_a.hidden, out_s.hidden) and torch.equal(out_a.taps, out_s.taps)
    assert torch.equal(logits_a, logits_s)
    for a, b in zip(cache_a.keys + cache_a.values, cache_s.keys + cache_s.values):
        assert torch.equal(a, b)


def test_a_pooled_product_equals_the_single_thread_one_call_after_call():
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(83, 40, generator=generator).to(torch.bfloat16).float()  # 6 tiles, the last partial
    tiles = kernels.bf16_tiles(weight)
    pool = kernels.worker_pool(2)
    try:
        for rows in [1, 2, 7, 13, 1, 30] * 20:  # many jobs in a row: each must run every part exactly once
            x = torch.randn(rows, 40, generator=generator)
            assert torch.equal(kernels.bf16_matmul(x, tiles, 83, pool=pool), kernels.bf16_matmul(x, tiles, 83))
    finally:
        pool.close()
        pool.close()  # closing twice is harmless


def test_load_target_shares_the_kernel_threads_it_is_given(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", seed=5, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the verify worker runs PyTorch on 2 cores: the C++ kernels are its float32 path
    try:
        target = load_target(tmp_path, dtype="float32", kernel_threads=2)
        assert target.whole_layers is not None and target.pool is not None and target.pool.threads == 2
        assert load_target(tmp_path, dtype="float32").pool is None
    finally:
        torch.set_num_threads(before)



def test_one_pool_used_from_two_threads_at_once_still_computes_every_product():
    from concurrent.futures import ThreadPoolExecutor

    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 64, generator=generator).to(torch.bfloat16).float()
    tiles = kernels.bf16_tiles(weight)
    inputs = [torch.randn(rows, 64, generator=generator) for rows in (1, 9, 3, 17) * 10]
    expected = [kernels.bf16_matmul(x, tiles, 200) for x in inputs]
    pool = kernels.worker_pool(2)
    try:
        with ThreadPoolExecutor(2) as callers:  # ctypes releases the GIL: the two callers' jobs may overlap
            got = list(callers.map(lambda x: kernels.bf16_matmul(x, tiles, 200, pool=pool), inputs))
    finally:
        pool.close()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
