"""cuda_ext's row attention (the target's attention under --batch-invariant): its host build against the PyTorch
reference, and what it is for: a row's bits depend on that row alone (not on the other rows, the query count,
the step's key length or the number of key chunks). On a GPU: the CUDA build equals the host build bit for bit,
and a CUDA graph replays it."""

import pytest
import torch

from cuda_ext import build
from cuda_ext.row_attention import op, reference

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or build.cuda_library() is None,
                               reason="no GPU, or the CUDA build is off (benchmarks/gpu_session.sh runs these)")
needs_host = pytest.mark.skipif(build.host_library() is None, reason="no C++ compiler here")


def _case(dtype, seed=0, capacity=900, dim=64, heads=4, kv_heads=2, queries=5, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, kv_heads, capacity, dim, generator=generator).to(dtype).to(device)
    values = torch.randn(3, kv_heads, capacity, dim, generator=generator).to(dtype).to(device)
    q = torch.randn(2, heads, queries, dim, generator=generator).to(dtype).to(device)
    slots = torch.tensor([2, 0], device=device)
    starts = torch.tensor([[10], [600]])
    positions = (starts + torch.arange(queries)).to(device)  # [2, queries]
    return q, keys, values, slots, positions


@needs_host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 8, 32), (6, 2, 128)])
def test_the_host_build_is_causal_attention_over_each_rows_keys(dtype, heads, kv_heads, dim):
    q, keys, values, slots, positions = _case(dtype, heads=heads, kv_heads=kv_heads, dim=dim)
    got = op.row_attention_kernel(q, keys, values, slots, positions, 3, 0.125)  # float32
    want = reference.row_attention(q, keys, values, slots, positions, 605, 0.125)
    assert got.shape == (2, 5, heads * dim) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 2e-6


@needs_host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_depend_on_that_row_alone(dtype):
    q, keys, values, slots, positions = _case(dtype)
    together = op.row_attention(q, keys, values, slots, positions, 605, 0.125)  # [2, 5, heads * dim]
    for b in range(2):
        for i in range(5):
            for key_length in (int(positions[b, i]) + 1, 605, 900):  # its own keys only, or the longest row's, or all
                alone = op.row_attention(q[b: b + 1, :, i: i + 1], keys, values, slots[b: b + 1],
                                         positions[b: b + 1, i: i + 1], key_length, 0.125)
                assert torch.equal(alone[0, 0], together[b, i]), (b, i, key_length)
    beside = op.row_attention(q.flip(0), keys, values, slots.flip(0), positions.flip(0), 605, 0.125)
    assert torch.equal(beside.flip(0), together)  # the order of the batch does not matter either


@needs_host
def test_a_long_query_block_goes_in_pieces_with_the_same_bits(monkeypatch):
    q, keys, values, slots, positions = _case(torch.bfloat16)
    whole = op.row_attention(q, keys, values, slots, positions, 605, 0.125)
    monkeypatch.setattr(op, "WORKSPACE_BYTES", 2 * 4 * 3 * (2 + 64) * 4 * 2)  # two queries' chunk states a call
    calls = []
    kernel = op.row_attention_kernel
    monkeypatch.setattr(op, "row_attention_kernel", lambda *a: calls.append(a[0].shape[2]) or kernel(*a))
    assert torch.equal(op.row_attention(q, keys, values, slots, positions, 605, 0.125), whole)
    assert calls == [2, 2, 1]
    assert op.row_attention(q[:, :, :0], keys, values, slots, positions[:, :0], 605, 0.125).shape == (2, 0, 256)


@needs_host
def test_refused_and_degenerate_inputs():
    q, keys, values, slots, positions = _case(torch.float32)
    with pytest.raises(ValueError, match="arguments the kernel does not take"):  # a slot outside the cache
        op.row_attention(q, keys, values, torch.tensor([2, 3]), positions, 605, 0.125)
    with pytest.raises(ValueError, match="inconsistent arguments"):  # the cache and q in different dtypes
        op.row_attention_kernel(q, keys.bfloat16(), values.bfloat16(), slots, positions, 3, 0.125)
    before = op.row_attention(q, keys, values, slots, torch.full_like(positions, -1), 605, 0.125)
    assert torch.equal(before, torch.zeros_like(before))  # a row before every key sees nothing: zeros
    past = op.row_attention(q, keys, values, slots, positions + 2000, 605, 0.125)  # padding rows past the step's keys
    clipped = op.row_attention(q, keys, values, slots, torch.full_like(positions, 767), 605, 0.125)
    assert torch.equal(past, clipped)  # see the step's keys only (3 chunks of 256)


@needs_host
def test_the_custom_op_has_a_consistent_fake_implementation():
    """torch.library.opcheck: schema, fake (meta) implementation and the real one agree, so a traced or captured
    step can hold the op."""
    torch.library.opcheck(op.row_attention_kernel, (*_case(torch.bfloat16), 3, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_build_is_the_host_build_bit_for_bit(dtype):
    case = _case(dtype, dim=128, heads=8, kv_heads=2, queries=9)
    host = op.row_attention(*case, 605, 0.125)
    cuda = op.row_attention(*(t.cuda() for t in case), 605, 0.125)
    assert torch.equal(cuda.cpu(), host)


@needs_gpu
def test_tensors_on_another_device_are_refused_before_the_launch():
    q, keys, values, slots, positions = _case(torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="inconsistent arguments"):  # a host pointer would fault the CUDA context
        op.row_attention(q, keys, values, slots, positions.cpu(), 605, 0.125)


@needs_gpu
def test_a_cuda_graph_replays_the_row_attention():
    q, keys, values, slots, positions = _case(torch.bfloat16, device="cuda")
    op.row_attention(q, keys, values, slots, positions, 605, 0.125)  # built and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op.row_attention(q, keys, values, slots, positions, 605, 0.125)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, op.row_attention(q, keys, values, slots, positions, 605, 0.125))
