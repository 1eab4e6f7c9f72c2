"""cuda_ext's kernels, through their host builds (the same per-row code the CUDA kernels run), against their
PyTorch references: verification (exactly: same tokens, same counts), the DFlash 2 walk (same path; q to float32
accuracy) and the drafter's block attention (float32 accuracy; each row alone). Also: the custom ops' fake
implementations (torch.compile traces them whole), the dispatch switch, and nvcc compiling every kernel for
sm_90 and sm_121 where nvcc is installed."""

import ctypes
import os
import shutil

import pytest
import torch

from cuda_ext import build, dispatch
from cuda_ext.block_attention import reference as attention_reference
from cuda_ext.block_attention.op import block_attention, block_attention_kernel
from cuda_ext.block_attention.op import kernel_available as block_attention_available
from cuda_ext.dflash2_walk import reference as walk_reference
from cuda_ext.dflash2_walk.op import walk, walk_kernel
from cuda_ext.verify.op import verify_block, verify_block_kernel, verify_greedy
from cuda_ext.verify.reference import DENSE, SPARSE
from shared.sampling import CDF_CHUNK, sample_from

pytestmark = pytest.mark.skipif(build.host_library() is None, reason="no C++ compiler: the host build is off")


def verify_case(batch: int, width: int, vocab: int, seed: int, k: int = 6, ties: bool = False):
    """A verify step's inputs: greedy and sampled rows mixed, ragged draft counts 0..width, every proposal form;
    greedy drafts that mostly match the argmax and sampled drafts drawn from q, so both partial and full
    acceptances happen. With ties, logits are small integers (argmax ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, 3, (batch, width + 1, vocab), generator=g).float() if ties
              else torch.randn(batch, width + 1, vocab, generator=g) * 3)  # [b, n+1, V]
    probs = torch.softmax(logits, -1)
    sampled = torch.rand(batch, generator=g) < 0.6
    sampled[0], sampled[-1] = False, True
    scores = torch.where(sampled[:, None, None], probs, logits)
    q_form = (torch.arange(batch) % 3).to(torch.int32)  # POINT_MASS, SPARSE, DENSE in turn
    q_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(batch * width)]).view(batch, width, k)
    q_probs = torch.softmax(torch.randn(batch, width, k, generator=g), -1)
    q_dense = torch.softmax(torch.randn(batch, width, vocab, generator=g), -1)
    draws = torch.rand(batch, width, generator=g, dtype=torch.float64)
    from_sparse = q_ids.gather(-1, sample_from(q_probs, draws)[..., None])[..., 0]
    from_dense = sample_from(q_dense, draws)
    from_target = sample_from(probs[:, :width], draws)  # what point-mass proposals (a greedy drafter) might guess
    greedy_guess = torch.where(torch.rand(batch, width, generator=g) < 0.8, logits[:, :width].argmax(-1),
                               torch.randint(0, vocab, (batch, width), generator=g))
    draft = torch.where(sampled[:, None], torch.where((q_form == SPARSE)[:, None], from_sparse,
                                                      torch.where((q_form == DENSE)[:, None], from_dense,
                                                                  from_target)), greedy_guess)
    num = torch.randint(0, width + 1, (batch,), generator=g)
    num[1 % batch] = width
    accept_u = torch.rand(batch, width, generator=g, dtype=torch.float64)
    sample_u = torch.rand(batch, generator=g, dtype=torch.float64)
    return scores, draft, num, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u


@pytest.mark.parametrize("vocab", [257, 4096])
@pytest.mark.parametrize("block", [2, 3, 8, 16])
def test_verify_kernel_equals_the_reference(vocab, block):
    width = block - 1
    outcomes = set()  # (sampled, how the row ended), to show the cases are not all alike
    for seed in range(6):
        args = verify_case(12, width, vocab, seed, ties=seed == 5)
        want = verify_block(*args, use_kernel=False)
        got = verify_block(*args, use_kernel=True)
        assert torch.equal(got, want), (seed, got.tolist(), want.tolist())
        assert got.dtype == torch.int64 and got.shape == (12, 2)
        for row, (accepted, _) in enumerate(got.tolist()):
            drafted = int(args[2][row])
            ended = "full" if accepted == drafted else ("none" if accepted == 0 else "partial")
            outcomes.add((bool(args[3][row]), ended))
    assert {(False, "full"), (False, "none"), (True, "full"), (True, "none")} <= outcomes
    assert width < 3 or {(False, "partial"), (True, "partial")} <= outcomes


def test_verify_kernel_takes_a_step_the_reference_must_densify():
    """A sparse q whose ids repeat (their probabilities add up, as scattering them does) and a row whose residual
    is all zero (the draw falls back to p): equal to the reference, which builds the dense q."""
    scores, draft, num, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u = verify_case(4, 3, 300, 7)
    scores = torch.softmax(scores, -1)  # every row sampled: probabilities
    sampled[:], q_form[:] = True, SPARSE
    q_ids[0, :, 1] = q_ids[0, :, 0]  # a repeated id
    # row 1: p has half its (unnormalised) mass on the draft, q all of it: rejected at u 0.6, max(0, p - q) is
    # zero everywhere, so the token comes from p: the draft itself
    scores[1] = 0.5 * torch.nn.functional.one_hot(draft[1, 0], 300).float().expand(4, 300)
    q_ids[1, 0], q_probs[1, 0] = draft[1, 0], 0.0
    q_probs[1, 0, 0] = 1.0
    accept_u[1, 0], num[1] = 0.6, 1
    args = scores, draft, num, sampled, q_form, q_dense, q_ids, q_probs, accept_u, sample_u
    got = verify_block(*args, use_kernel=True)
    assert torch.equal(got, verify_block(*args, use_kernel=False))
    assert got[1].tolist() == [0, int(draft[1, 0])]


def test_the_greedy_verify_equals_the_reference_and_refuses_bad_rows():
    """verify_greedy (the serving loop's all-greedy step: only scores, drafts and counts reach the host build)
    against the reference on batches whose drafts mostly match, or not, argmax ties included; and its refusals name
    the rows."""
    for seed in range(6):
        scores, draft, num = verify_case(12, 5, 64, seed, ties=seed == 3)[:3]
        want = verify_block(scores, draft, num, torch.zeros(12, dtype=torch.bool), use_kernel=False)
        assert verify_greedy(scores, draft, num) == (want[:, 0].tolist(), want[:, 1].tolist()), seed
    scores, draft, num = verify_case(3, 4, 100, 1)[:3]
    draft[2, 0], num[2] = 100, 4
    with pytest.raises(IndexError, match=r"rows \[2\]"):
        verify_greedy(scores, draft, num)
    draft[2, 0], num[0] = 5, 9
    with pytest.raises(IndexError, match=r"rows \[0\] hold a draft count outside 0..4"):
        verify_greedy(scores, draft, num)
    num[0] = 4
    with pytest.raises(ValueError, match="inconsistent shapes"):
        verify_greedy(scores[:, :3], draft, num)


def test_verify_kernel_refuses_a_token_outside_the_vocabulary():
    args = list(verify_case(3, 4, 100, 1))
    args[1][2, 0], args[2][2] = 100, 4  # a draft id past the vocabulary in a row that uses it
    with pytest.raises(IndexError, match=r"rows \[2\]"):
        verify_block(*args, use_kernel=True)
    args[1][2, 0] = 5
    args[2][0] = 9  # more drafts than the block holds
    with pytest.raises(IndexError, match=r"rows \[0\] hold a draft count outside 0..4"):
        verify_block(*args, use_kernel=True)
    args[2][0] = 4
    dense_rows = (args[4] == DENSE) & args[3] & (args[2] > 0)
    assert bool(dense_rows.any())
    args[5] = torch.zeros(0)  # dense rows without their q
    with pytest.raises(IndexError, match="without its tensors"):
        verify_block(*args, use_kernel=True)
    args[5] = torch.zeros(3, 4, 99)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        verify_block(*args, use_kernel=True)


@pytest.mark.parametrize("vocab", [1, 255, 256, 257, 4096, 70_000])
def test_the_draw_sums_in_the_kernels_chunks(vocab):
    """sample_from's cumulative sums are the chunked ones the kernels make (chunks of CDF_CHUNK, in order); a
    plain Python loop in that order finds the same token, at the boundaries too."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(3, vocab, generator=g) ** 4
    for row in range(3):
        values = probs[row].double().tolist()
        starts, running = [], 0.0
        for begin in range(0, vocab, CDF_CHUNK):
            starts.append(running)
            chunk = 0.0
            for v in values[begin:begin + CDF_CHUNK]:
                chunk += v
            running += chunk
        cdf = []
        for c, begin in enumerate(range(0, vocab, CDF_CHUNK)):
            within = 0.0
            for v in values[begin:begin + CDF_CHUNK]:
                within += v
                cdf.append(starts[c] + within)
        exact = torch.tensor(cdf, dtype=torch.float64)
        for u in torch.rand(50, generator=g, dtype=torch.float64).tolist() + [0.0]:
            expected = min(int((exact > u * running).nonzero()[0]) if (exact > u * running).any() else vocab - 1,
                           vocab - 1)
            assert int(sample_from(probs[row], torch.tensor(u, dtype=torch.float64))) == expected
        boundary = cdf[len(cdf) // 2] / running  # a uniform exactly at a cumulative value picks the next id
        assert int(sample_from(probs[row], torch.tensor(boundary, dtype=torch.float64))) >= len(cdf) // 2
    # the verify kernel's draw (a sampled row with no drafts: the token from p) at uniforms on the cumulative
    # values themselves, where any other order of the sums would pick a neighbour
    picks = list(range(0, vocab, max(1, vocab // 40))) + [min(vocab - 1, CDF_CHUNK), min(vocab - 1, CDF_CHUNK - 1)]
    within = torch.nn.functional.pad(probs.double(), (0, -vocab % CDF_CHUNK)).view(3, -1, CDF_CHUNK).cumsum(-1)
    ends = within[..., -1].cumsum(-1)
    cdf = (torch.cat([torch.zeros(3, 1, dtype=torch.float64), ends[:, :-1]], 1)[..., None] + within).flatten(1)
    u = (cdf[:, picks] / ends[:, -1:]).flatten()  # [3 * picks]
    rows = torch.arange(3).repeat_interleave(len(picks))
    scores = probs[rows][:, None]  # [R, 1, vocab]
    none = torch.zeros(len(rows), 0, dtype=torch.long)
    args = (scores, none, torch.zeros(len(rows), dtype=torch.long), torch.ones(len(rows), dtype=torch.bool), None,
            None, None, None, torch.ones(len(rows), 0, dtype=torch.float64), u)
    got = verify_block(*args, use_kernel=True)[:, 1]
    assert torch.equal(got, sample_from(probs[rows], u))
    assert torch.equal(got, verify_block(*args, use_kernel=False)[:, 1])


def walk_case(batch: int, rows: int, k: int, vocab: int, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    unary, candidates = torch.randn(batch, rows, vocab, generator=g).topk(k, -1)
    anchors = torch.randint(0, vocab, (batch,), generator=g)
    projected = torch.randn(batch, rows, rank, generator=g)
    predecessor, successor = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g) * 0.3
    temperatures = torch.where(torch.rand(batch, generator=g) < 0.5, 0.0, 0.3 + torch.rand(batch, generator=g))
    uniforms = torch.rand(batch, rows, generator=g, dtype=torch.float64)
    return unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms


@pytest.mark.parametrize("block", [2, 8, 16])
@pytest.mark.parametrize("k,vocab", [(1, 257), (32, 4096), (1024, 4096)])
def test_walk_kernel_takes_the_reference_path(block, k, vocab):
    args = walk_case(6, block - 1, k, vocab, 32, seed=block * k)
    tokens, choices, q = walk(*args, use_kernel=True)
    want_tokens, want_choices, want_q = walk_reference.walk(*args)
    assert torch.equal(tokens, want_tokens) and torch.equal(choices, want_choices)
    assert torch.allclose(q, want_q, atol=2e-6, rtol=1e-5)
    greedy = args[6] <= 0
    assert torch.equal(q[greedy].argmax(-1), choices[greedy]) and bool((q[greedy].sum(-1) == 1).all())


@pytest.mark.skipif(build.host_library() is None or build.host_flags() == build.HOST_FLAGS,
                    reason="no host build, or this CPU builds it without AVX2 anyway")
def test_host_build_with_avx2_gives_the_bits_of_one_without():
    """The AVX2 flags change how the host build computes, never what: the DFlash 2 walk (sampled and greedy rows,
    1024 candidates) through the default build and through one compiled without them, bit for bit."""
    from shared.native_build import cached_library

    plain = build._bind(ctypes.CDLL(str(cached_library("libdflash_ext_host.so", [shutil.which(os.environ.get(
        "CXX", "c++")), *build.HOST_FLAGS], build.host_sources(), build.headers()))), "host", [])
    unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms = walk_case(
        6, 7, 1024, 4096, 256, seed=9)
    outputs = []
    for entry in (plain["dflash2_walk"], build.host_library()["dflash2_walk"]):
        tokens, choices = torch.empty(6, 7, dtype=torch.int64), torch.empty(6, 7, dtype=torch.int64)
        q = torch.empty(6, 7, 1024)
        assert entry(unary.data_ptr(), candidates.data_ptr(), anchors.data_ptr(), projected.data_ptr(),
                     predecessor.data_ptr(), successor.data_ptr(), temperatures.data_ptr(), uniforms.data_ptr(), 6, 7,
                     1024, 256, 4096, tokens.data_ptr(), choices.data_ptr(), q.data_ptr()) == 0
        outputs.append((tokens, choices, q))
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_walk_kernel_breaks_ties_like_the_reference_and_refuses_bad_ids():
    unary, candidates, anchors, projected, predecessor, successor, _, uniforms = walk_case(3, 7, 8, 64, 4, seed=3)
    unary, projected = torch.zeros_like(unary), torch.zeros_like(projected)  # every score ties at 0
    temperatures = torch.zeros(3)
    tokens, choices, _ = walk(unary, candidates, anchors, projected, predecessor, successor, temperatures, None,
                              use_kernel=True)
    assert bool((choices == 0).all()) and torch.equal(tokens, candidates[..., 0])  # the first (best) candidate
    anchors[1] = 64
    with pytest.raises(IndexError, match="outside the vocabulary"):
        walk(unary, candidates, anchors, projected, predecessor, successor, temperatures, None, use_kernel=True)


def attention_case(seed: int, block: int, contexts: list[int], heads=4, kv_heads=2, dim=64, capacity=96, slots=6):
    g = torch.Generator().manual_seed(seed)
    batch = len(contexts)
    q = torch.randn(batch, heads, block, dim, generator=g)
    keys = torch.randn(slots, kv_heads, capacity, dim, generator=g)
    values = torch.randn(slots, kv_heads, capacity, dim, generator=g)
    slot_ids = torch.randperm(slots, generator=g)[:batch]
    context = torch.tensor(contexts)
    positions = context[:, None] + torch.arange(block)  # the block right after each request's context
    return q, keys, values, slot_ids, context + block, positions


@pytest.mark.parametrize("block", [2, 5, 16])
@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (False, 6), (True, 9)])
def test_block_attention_kernel_equals_the_reference(block, causal, window):
    q, keys, values, slots, ends, positions = attention_case(block, block, [0, 13, 40, 1])
    want = attention_reference.block_attention(q, keys, values, slots, ends, positions, window, causal, 0.125)
    got = block_attention(q, keys, values, slots, ends, positions, window, causal, 0.125, use_kernel=True)
    assert got.shape == want.shape == (4, block, 4 * 64)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


def test_block_attention_rows_depend_on_their_own_keys_only():
    """Each request's rows are the same numbers alone and beside requests of other context lengths (no padding:
    a row reads only its own keys), and GQA maps query heads to their KV heads (8 heads on 2 KV heads)."""
    q, keys, values, slots, ends, positions = attention_case(4, 8, [3, 50, 17], heads=8, kv_heads=2)
    together = block_attention(q, keys, values, slots, ends, positions, 0, False, 0.125, use_kernel=True)
    for b in range(3):
        alone = block_attention(q[b:b + 1], keys, values, slots[b:b + 1], ends[b:b + 1], positions[b:b + 1], 0, False,
                                0.125, use_kernel=True)
        assert torch.equal(alone[0], together[b])
    want = attention_reference.block_attention(q, keys, values, slots, ends, positions, 0, False, 0.125)
    assert torch.allclose(together, want, atol=2e-6, rtol=1e-5)


def test_block_attention_kernel_refuses_slots_and_lengths_outside_the_cache():
    q, keys, values, slots, ends, positions = attention_case(6, 4, [10, 30])
    for bad_slots, bad_ends in ((torch.tensor([0, 6]), ends), (slots, torch.tensor([14, 97]))):
        with pytest.raises(ValueError, match="outside the cache"):
            block_attention(q, keys, values, bad_slots, bad_ends, positions, 0, False, 0.125, use_kernel=True)


def test_block_attention_kernel_reads_bfloat16_caches():
    q, keys, values, slots, ends, positions = attention_case(5, 8, [10, 30])
    q, keys, values = (t.to(torch.bfloat16) for t in (q, keys, values))
    got = block_attention(q, keys, values, slots, ends, positions, 0, False, 0.125, use_kernel=True)
    want = attention_reference.block_attention(q.float(), keys.float(), values.float(), slots, ends, positions, 0,
                                               False, 0.125)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, atol=1e-2, rtol=1e-2)


def test_custom_ops_have_consistent_fake_implementations():
    """torch.library.opcheck: each op's schema, fake (meta) implementation and real one agree, so torch.compile
    and CUDA graph capture can trace a step that calls them."""
    verify_args = verify_case(4, 3, 257, 0)
    torch.library.opcheck(verify_block_kernel, verify_args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(walk_kernel, walk_case(3, 4, 8, 64, 8, seed=1), test_utils=("test_schema", "test_faketensor"))
    q, keys, values, slots, ends, positions = attention_case(0, 4, [5, 9])
    torch.library.opcheck(block_attention_kernel, (q, keys, values, slots, ends, positions, 0, False, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_compiled_step_traces_the_verify_op_whole():
    """torch.compile with fullgraph (no graph break allowed) through the verify op: its fake implementation
    carries the trace, the compiled call returns the kernel's result."""
    args = verify_case(3, 4, 257, 2)

    def step(*tensors):
        return verify_block_kernel(*tensors) + 0

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(*args), verify_block(*args, use_kernel=False))


def test_the_dispatch_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("DFLASH_KERNELS", "auto")
    assert dispatch.kernel_entry("verify", cpu, cpu_default=True) is not None
    assert dispatch.kernel_entry("block_attention", cpu) is None  # CPU attention stays the drafter's own
    monkeypatch.setenv("DFLASH_KERNELS", "host")
    assert dispatch.kernel_entry("block_attention", cpu) is not None
    q, keys = torch.zeros(1, 4, 8, 64), torch.zeros(2, 2, 16, 64)
    assert block_attention_available(q, keys)
    assert not block_attention_available(torch.zeros(1, 4, 8, 320), torch.zeros(2, 2, 16, 320))  # head size
    assert not block_attention_available(q, keys.half())  # float16 caches take the reference
    cuda = torch.device("cuda")  # no CUDA call is made before the build is looked up: this runs without a GPU
    assert dispatch.kernel_entry("block_attention", cuda, cuda_default=False) is None  # measured slower on an H200
    monkeypatch.setenv("DFLASH_KERNELS", "reference")
    assert dispatch.kernel_entry("verify", cpu, cpu_default=True) is None
    monkeypatch.setenv("DFLASH_KERNELS", "fast")
    with pytest.raises(ValueError, match="DFLASH_KERNELS must be one of auto, host, reference"):
        dispatch.kernel_mode()


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed here")
def test_nvcc_compiles_every_kernel_for_sm90_and_sm121(tmp_path):
    """What CI checks without a GPU: every kernel.cu compiles for sm_90 and sm_121; the objects link into the
    library the loader opens, whose entry points all bind, and whose probe says why it cannot run where no GPU
    (or no driver) is (on a GPU machine it says nothing)."""
    import ctypes
    import subprocess

    objects = build.compile_objects(tmp_path, archs=("90", "121"))
    every = (*build.KERNELS, *build.CUDA_ONLY_KERNELS)
    assert sorted(o.name for o in objects) == sorted([f"{k}.o" for k in every] + ["errors.o"])
    assert all(o.stat().st_size > 0 for o in objects)
    library = tmp_path / "libdflash_ext_cuda.so"
    subprocess.run([build.find_nvcc(), "-shared", "-o", str(library), *map(str, objects)], check=True,
                   capture_output=True, text=True, timeout=300)
    loaded = build.CudaBuild(ctypes.CDLL(str(library)))
    assert sorted(loaded.entries) == sorted(every)
    why = loaded.probe()
    assert (why == "") == torch.cuda.is_available(), why


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or build.cuda_library() is None,
                               reason="no GPU, or the CUDA build is off (benchmarks/gpu_kernels.py runs these)")


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@needs_gpu
@pytest.mark.parametrize("vocab", [257, 4096, 151_936])
def test_cuda_verify_equals_the_host_build(vocab):
    """The CUDA kernel splits the vocabulary over a block's threads; its tokens equal the host build's (and so the
    reference's) for the same inputs."""
    for seed in range(3):
        args = verify_case(12, 7, vocab, seed, ties=seed == 2)
        assert torch.equal(verify_block(*_cuda(args), use_kernel=True), verify_block(*args, use_kernel=True))


@needs_gpu
def test_cuda_walk_and_block_attention_equal_the_host_build_bit_for_bit():
    """The same per-row code, no contraction, our own exp: the CUDA results are the host build's bits."""
    args = walk_case(6, 15, 32, 4096, 64, seed=11)
    for got, want in zip(walk(*_cuda(args), use_kernel=True), walk(*args, use_kernel=True)):
        assert torch.equal(got.cpu(), want)
    args = attention_case(12, 16, [0, 70, 33, 5], heads=8, kv_heads=2, capacity=128) + (0, False, 0.125)
    got = block_attention(*_cuda(args), use_kernel=True).cpu()
    assert torch.equal(got, block_attention(*args, use_kernel=True))


@needs_gpu
def test_cuda_verify_replays_in_a_cuda_graph():
    args = _cuda(verify_case(8, 7, 4096, 3))
    static = [a.clone() for a in args]
    verify_block_kernel(*static)  # warm-up outside the capture (builds, allocations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify_block_kernel(*static)
    fresh = _cuda(verify_case(8, 7, 4096, 4))
    for buffer, value in zip(static, fresh):
        buffer.copy_(value)
    graph.replay()
    assert torch.equal(out.cpu(), verify_block(*[a.cpu() for a in fresh], use_kernel=False))
