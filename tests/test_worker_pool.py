"""Holding a C++ kernel pool awake (worker_pool.h): its helpers spin between jobs while held, sleep once no hold
is left, never change a result, and a proposer can run on the target's pool."""

import time

import pytest
import torch

from shared.cpu_kernels.library import cpu_kernels, pool_awake

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")


def _cpu_seconds_while_idle(seconds: float) -> float:
    """This process's CPU time (every thread) over `seconds` of the main thread sleeping."""
    before = time.process_time()
    time.sleep(seconds)
    return time.process_time() - before


def _cpu_seconds_over_short_sleeps(count: int, seconds: float) -> float:
    """This process's CPU time (every thread) over `count` sleeps of the main thread with nothing between."""
    before = time.process_time()
    for _ in range(count):
        time.sleep(seconds)
    return time.process_time() - before


def test_held_helpers_spin_and_a_released_pool_sleeps():
    pool = cpu_kernels().worker_pool(2)
    try:
        time.sleep(0.01)  # the fresh helper has fallen asleep
        asleep = _cpu_seconds_while_idle(0.02)
        with pool.awake():
            held = _cpu_seconds_over_short_sleeps(8, 0.0005)  # gaps under the 2 ms a held helper spins through
        released = _cpu_seconds_while_idle(0.02)
    finally:
        pool.close()
    assert held > 0.0015, f"a held helper spun for only {held * 1e3:.1f} ms of about 4"
    assert asleep < 0.004 and released < 0.004, (asleep, released)


def test_a_hold_gives_up_after_two_ms_without_a_job():
    pool = cpu_kernels().worker_pool(2)
    try:
        with pool.awake():
            time.sleep(0.005)  # past the cap: the helper sleeps though the pool is still held
            late = _cpu_seconds_while_idle(0.03)
    finally:
        pool.close()
    assert late < 0.006, f"a forgotten hold kept a helper spinning ({late * 1e3:.1f} ms of 30)"


def test_holds_nest_and_change_no_product():
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(70, 48, generator=generator).to(torch.bfloat16).float()
    tiles = kernels.bf16_tiles(weight)
    x = torch.randn(9, 48, generator=generator)
    alone = kernels.bf16_matmul(x, tiles, 70)
    pool = kernels.worker_pool(2)
    try:
        with pool.awake(), pool.awake():
            with pool.awake(on=False):  # a wait inside a step: one hold fewer, one still held
                inside = kernels.bf16_matmul(x, tiles, 70, pool=pool)
                still_held = _cpu_seconds_over_short_sleeps(8, 0.0005)
            assert torch.equal(kernels.bf16_matmul(x, tiles, 70, pool=pool), alone)
        assert torch.equal(inside, alone)
        assert still_held > 0.0015, f"one of two holds released the pool ({still_held * 1e3:.1f} ms spun)"
        assert _cpu_seconds_while_idle(0.02) < 0.004  # every hold ended: asleep
    finally:
        pool.close()


def test_an_unmatched_release_does_not_cancel_the_next_hold():
    pool = cpu_kernels().worker_pool(2)
    try:
        pool._hold(pool.handle, 0)  # through the C ABI: a release with no hold
        with pool.awake():
            held = _cpu_seconds_over_short_sleeps(8, 0.0005)
    finally:
        pool.close()
    assert held > 0.0015, f"the hold after an unmatched release did not hold ({held * 1e3:.1f} ms spun)"


def test_closing_a_held_pool_is_safe_and_no_pool_is_no_hold():
    pool = cpu_kernels().worker_pool(2)
    with pool.awake():
        pool.close()  # the hold's end must not reach the freed pool
    with pool.awake():  # a closed pool: nothing to hold
        pass
    with pool_awake(None), pool_awake(None, on=False):
        pass


def test_a_proposer_runs_on_the_pool_it_is_given_and_closes_only_its_own():
    from draft_worker.local_proposer import LocalProposer
    from shared.demo_models import default_pair
    from draft_worker.draft_checkpoint import load_drafter
    from verify_worker.target_loader import load_target

    pair = default_pair()
    target = load_target(pair.target, dtype="float32", kernel_threads=2)
    drafter = load_drafter(pair.draft, dtype=torch.float32)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=2,
                             max_model_len=256, layout="bf16")
    try:
        proposer.share_kernel_threads(2, target.pool)
        assert proposer.pool is target.pool and proposer.drafter.pool is target.pool
        proposer.share_kernel_threads(2)  # its own pool now; the target's stays open
        assert proposer.pool is not target.pool and proposer.pool.threads == 2
        assert target.pool.handle
        own = proposer.pool
        proposer.share_kernel_threads(1)
        assert proposer.pool is None and not own.handle and target.pool.handle
    finally:
        proposer.share_kernel_threads(1)
        target.pool.close()
