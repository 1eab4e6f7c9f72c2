"""The C++ CPU kernels (shared/cpu_kernels): built here with the system compiler, checked against PyTorch."""

import pytest
import torch

from shared.cpu_kernels import library
from shared.cpu_kernels.arguments import bf16_exact
from shared.cpu_kernels.library import CpuKernels, cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")


def _bf16_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16).float()  # [out, in]


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (40, 37), (512, 256), (7, 300)])
def test_bf16_matmul_equals_the_float64_product(rows, out_features, in_features):
    weight = _bf16_weight(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    kernels = cpu_kernels()
    got = kernels.bf16_matmul(x, kernels.bf16_tiles(weight), out_features)  # [rows, out]
    want = (x.double() @ weight.double().t()).float()
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_each_row_is_computed_alone():
    """A row's result does not depend on the other rows of the call: rows of every count (the kernel's 6-row
    blocks, their remainders, the widened-tile path past 6 rows) equal the same row multiplied alone, bit for bit.
    This is what makes a verify block's rows equal one-token rows."""
    weight = _bf16_weight(72, 200, seed=0)
    kernels = cpu_kernels()
    tiles = kernels.bf16_tiles(weight)
    x = torch.randn(40, 200, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kernels.bf16_matmul(x[i:i + 1], tiles, 72) for i in range(40)])  # [40, 72]
    for rows in (2, 3, 6, 7, 12, 17, 40):
        for start in (0, 40 - rows):
            assert torch.equal(kernels.bf16_matmul(x[start:start + rows], tiles, 72), alone[start:start + rows])


@pytest.mark.skipif(cpu_kernels() is None or cpu_kernels().gemm_isa != "avx512", reason="no AVX-512F here")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 41])
def test_avx512_kernel_equals_the_avx2_kernel_bit_for_bit(rows):
    """The AVX-512 product runs the same per-element sums as the AVX2 one (more at once): equal bit for bit, so
    a CPU's choice of kernel changes no token. Widths cover partial tiles, tile groups and their remainders
    (1..300 tiles); depths cover short and odd K."""
    kernels = cpu_kernels()
    for case, (out_features, in_features) in enumerate([(16, 8), (40, 37), (7, 300), (513, 256), (4100, 65),
                                                        (130, 768)]):
        weight = _bf16_weight(out_features, in_features, seed=rows * 10 + case)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(case)) * 3
        tiles = kernels.bf16_tiles(weight)
        wide = kernels.bf16_matmul(x, tiles, out_features, isa="avx512")
        assert torch.equal(wide, kernels.bf16_matmul(x, tiles, out_features, isa="avx2")), (out_features, in_features)
        assert torch.equal(wide, kernels.bf16_matmul(x, tiles, out_features))  # what every caller gets


needs_amx = pytest.mark.skipif(cpu_kernels() is None or not cpu_kernels().amx, reason="no AMX here")


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 9, 16, 17, 41])
def test_amx_product_is_the_bfloat16_product(rows):
    """The "amx" layout multiplies x rounded to bfloat16 (as PyTorch rounds) by the bfloat16 weights with float32
    sums: it equals the float64 product of those rounded values within float32 summation error, and differs
    from the float32 product by about bfloat16's rounding of x. Shapes cover partial 32-deep blocks, odd K,
    partial tiles and tile groups, and rows past one 16-row tile."""
    kernels = cpu_kernels()
    for case, (out_features, in_features) in enumerate([(16, 8), (40, 37), (7, 300), (513, 256), (130, 768),
                                                        (4100, 65)]):
        weight = _bf16_weight(out_features, in_features, seed=rows * 10 + case)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(case)) * 3
        got = kernels.bf16_matmul(x, kernels.bf16_tiles(weight, "amx"), out_features, isa="amx")
        rounded = x.to(torch.bfloat16).double()
        want = rounded @ weight.double().t()
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * in_features ** 0.5), (out_features,
                                                                                               in_features)
        exact = x.double() @ weight.double().t()
        assert not torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


@needs_amx
def test_amx_rows_are_computed_alone_and_pooled_alike():
    """Row invariance on AMX: rows of every count (within one 16-row tile, across tiles) equal the same row
    multiplied alone, bit for bit, and a product shared between a pool's threads gives the same bits."""
    weight = _bf16_weight(72, 200, seed=0)
    kernels = cpu_kernels()
    tiles = kernels.bf16_tiles(weight, "amx")
    x = torch.randn(40, 200, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kernels.bf16_matmul(x[i:i + 1], tiles, 72, isa="amx") for i in range(40)])  # [40, 72]
    pool = kernels.worker_pool(2)
    try:
        for rows in (2, 3, 9, 16, 17, 33, 40):
            for start in (0, 40 - rows):
                part = x[start:start + rows]
                assert torch.equal(kernels.bf16_matmul(part, tiles, 72, isa="amx"), alone[start:start + rows])
                assert torch.equal(kernels.bf16_matmul(part, tiles, 72, isa="amx", pool=pool),
                                   alone[start:start + rows])
    finally:
        pool.close()


@needs_amx
def test_amx_keeps_non_finite_values():
    weight = _bf16_weight(16, 32, seed=4)
    kernels = cpu_kernels()
    x = torch.zeros(3, 32)
    x[0, 5], x[1, 7], x[2, 0] = float("nan"), float("inf"), 3.4e38  # the last rounds up to bfloat16's infinity
    got = kernels.bf16_matmul(x, kernels.bf16_tiles(weight, "amx"), 16, isa="amx")
    assert torch.isnan(got[0]).all()
    assert torch.isinf(got[1:]).all()
    assert torch.equal(torch.sign(got[1]), torch.sign(weight[:, 7])) and torch.equal(torch.sign(got[2]),
                                                                                    torch.sign(weight[:, 0]))


def test_the_amx_kernel_is_refused_where_it_cannot_run():
    kernels = cpu_kernels()
    if kernels.amx:
        pytest.skip("AMX runs here")
    weight = _bf16_weight(16, 32, seed=4)
    with pytest.raises(RuntimeError, match="AMX"):
        kernels.bf16_matmul(torch.zeros(1, 32), kernels.bf16_tiles(weight, "amx"), 16, isa="amx")


def test_leading_dimensions_and_no_rows():
    weight = _bf16_weight(24, 16, seed=3)
    kernels = cpu_kernels()
    tiles = kernels.bf16_tiles(weight)
    x = torch.randn(2, 3, 16)
    assert torch.allclose(kernels.bf16_matmul(x, tiles, 24), x @ weight.t(), atol=1e-5)
    assert kernels.bf16_matmul(torch.zeros(0, 16), tiles, 24).shape == (0, 24)
    strided = torch.randn(16, 5).t()  # [5, 16], not contiguous
    assert torch.allclose(kernels.bf16_matmul(strided, tiles, 24), strided @ weight.t(), atol=1e-5)


def test_bf16_exact():
    assert bf16_exact(_bf16_weight(4, 4, seed=0))
    assert not bf16_exact(torch.tensor([1.0 + 2.0 ** -10]))


def test_builds_into_the_cache_folder(tmp_path, monkeypatch):
    """The build cache the C++ kernels load through (shared/native_build.py), on a one-function library: a fresh
    $DFLASH_KERNEL_CACHE gets a build keyed by the command and the source; a second call reuses it; a changed
    source builds anew beside it. (Every other test here loads the kernels themselves through it.)"""
    import ctypes
    import shutil

    from shared.native_build import cached_library

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("DFLASH_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "seven.cpp"
    source.write_text('extern "C" int seven() { return 7; }\n')
    command = [compiler, "-shared", "-fPIC", "-O1"]
    built = cached_library("libseven.so", command, [source])
    assert built.parent.parent == tmp_path / "cache" and ctypes.CDLL(str(built)).seven() == 7
    stamp = built.stat().st_mtime_ns
    assert cached_library("libseven.so", command, [source]) == built and built.stat().st_mtime_ns == stamp
    source.write_text('extern "C" int seven() { return 8; }\n')
    rebuilt = cached_library("libseven.so", command, [source])
    assert rebuilt != built and ctypes.CDLL(str(rebuilt)).seven() == 8
    assert sorted(p.name for p in (tmp_path / "cache").glob("*/libseven.so")) == ["libseven.so"] * 2


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_CPU_KERNELS", "off")
    library.cpu_kernels.cache_clear()
    try:
        assert library.cpu_kernels() is None
    finally:
        monkeypatch.delenv("DFLASH_CPU_KERNELS")
        library.cpu_kernels.cache_clear()


def _attention_inputs(batch, heads, kv_heads, queries, keys, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dim, generator=gen)
    cache_k = torch.randn(batch + 1, kv_heads, keys + 9, dim, generator=gen)  # a cache: slots x capacity
    cache_v = torch.randn(batch + 1, kv_heads, keys + 9, dim, generator=gen)
    return q, cache_k[1:, :, :keys], cache_v[1:, :, :keys]  # views with the cache's strides


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (4, 4, 16), (8, 1, 128)])
@pytest.mark.parametrize("queries,keys", [(1, 1), (1, 200), (8, 70), (3, 128)])
def test_attention_equals_torch(heads, kv_heads, dim, queries, keys):
    """Grouped-query attention over a cache view, causal by position and non-causal within a block (the
    drafter's), equal to torch's fused kernel to float32 rounding."""
    from shared.attention import cached_attention, visibility_mask

    q, k, v = _attention_inputs(3, heads, kv_heads, queries, keys, dim, seed=queries * keys + dim)
    positions = torch.arange(keys - queries, keys)[None].expand(3, -1)
    for mask in (visibility_mask(positions, keys),
                 visibility_mask(positions, keys, visible_end=torch.tensor([keys, keys - 1, keys]))):
        got = cpu_kernels().attention(q, k, v, mask, dim ** -0.5)  # [b, queries, heads * dim]
        want = cached_attention(q, k, v, mask, dim ** -0.5)
        assert got.shape == want.shape == (3, queries, heads * dim)
        assert (got - want).abs().max() < 1e-5


def test_attention_rows_depend_only_on_their_own_keys():
    """A query row's output is bit for bit the same alone or in a block, and whatever follows its visible keys
    (more masked keys, holding garbage, even NaN)."""
    from shared.attention import visibility_mask

    kernels = cpu_kernels()
    q, k, v = _attention_inputs(1, 4, 2, 8, 60, 64, seed=5)
    positions = torch.arange(52, 60)[None]
    block = kernels.attention(q, k, v, visibility_mask(positions, 60), 0.125)  # [1, 8, 256]
    longer_k, longer_v = torch.cat([k, torch.full((1, 2, 30, 64), float("nan"))], 2), torch.cat([v, k[:, :, :30]], 2)
    longer = kernels.attention(q, longer_k, longer_v, visibility_mask(positions, 90), 0.125)
    assert torch.equal(block, longer)
    for i in range(8):
        keys = 53 + i
        alone = kernels.attention(q[:, :, i:i + 1], k[:, :, :keys], v[:, :, :keys],
                                  visibility_mask(positions[:, i:i + 1], keys), 0.125)
        assert torch.equal(alone[0, 0], block[0, i]), f"row {i}"


def test_attention_row_without_visible_keys_is_zero_and_odd_head_sizes_fall_back():
    from shared.attention import cached_attention, visibility_mask

    kernels = cpu_kernels()
    q, k, v = _attention_inputs(1, 2, 1, 2, 10, 8, seed=6)
    mask = visibility_mask(torch.tensor([[3, 4]]), 10)
    mask[0, 0, 1] = False  # a padding row
    out = kernels.attention(q, k, v, mask, 0.3)
    assert torch.equal(out[0, 1], torch.zeros(16)) and torch.isfinite(out).all()
    q, k, v = _attention_inputs(1, 2, 1, 2, 10, 12, seed=7)  # head size 12: not a multiple of 8
    mask = visibility_mask(torch.tensor([[3, 4]]), 10)
    assert torch.allclose(kernels.attention(q, k, v, mask, 0.3), cached_attention(q, k, v, mask, 0.3), atol=1e-6)


@pytest.mark.parametrize("shape,k", [((112, 4096), 32), ((7, 4096), 1024), ((3, 100), 7), ((5, 32), 32), ((2, 31), 1),
                                     ((4, 2, 300), 20)])
def test_top_k_equals_torch_topk(shape, k):
    """Distinct values: the same values and ids as torch.topk, best first (rows shorter than k chunks of 32, a
    tail past the last 8, leading dimensions)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(k))
    values, ids = cpu_kernels().top_k(x, k)
    want_values, want_ids = x.topk(k, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)


def test_top_k_puts_equal_values_in_index_order_and_never_keeps_nan():
    x = torch.zeros(3, 500)
    x[0, [7, 400, 3, 250]] = 2.0  # four equal best values, then zeros: ids ascending within each value
    x[1] = torch.arange(500.0) % 10  # many ties at every value
    x[2, 17] = float("nan")
    values, ids = cpu_kernels().top_k(x[:2], 12)
    assert ids[0].tolist() == [3, 7, 250, 400, 0, 1, 2, 4, 5, 6, 8, 9] and values[0, :4].tolist() == [2.0] * 4
    assert ids[1].tolist() == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99, 109, 119]
    assert ids[1].tolist() == sorted(range(500), key=lambda i: (-(i % 10), i))[:12]
    values, ids = cpu_kernels().top_k(x, 12)  # NaN is never kept: the best of the numbers
    assert ids[2].tolist() == list(range(12)) and not torch.isnan(values).any()
    x[2] = float("nan")
    x[2, :5] = 1.0  # fewer than k numbers: the row comes back from torch.topk (NaN first there)
    values, ids = cpu_kernels().top_k(x, 12)
    assert torch.equal(ids, x.topk(12, dim=-1)[1])


@pytest.mark.parametrize("vocab", [1, 3, 257, 4096])
def test_top_p_cut_keeps_what_the_whole_sort_keeps(vocab):
    """top_p.cpp against sampling's whole-sort path: the same kept tokens, probabilities within float32 rounding,
    over peaked and flat rows (a prefix of a few tokens up to the whole row), with and without top-k, top_p 1
    (no cut) and top_p below every probability (the best token alone)."""
    from shared.sampling import _cut_rows_sorted

    generator = torch.Generator().manual_seed(vocab)
    for scale in (0.3, 1.0, 3.0, 10.0, 40.0):
        probs = torch.softmax(torch.randn(12, vocab, generator=generator) * scale, -1)
        top_p = torch.tensor([0.95, 0.5, 0.9, 1.0, 1e-9, 0.99, 0.3, 0.95, 0.8, 1.0, 0.999, 0.6])
        k = torch.tensor([vocab, vocab, 5, vocab, vocab, 2, 1, 40, vocab, 3, vocab, vocab]).clamp(max=vocab)
        got = cpu_kernels().top_p_cut(probs, top_p, k)
        want = _cut_rows_sorted(probs, top_p, k)
        assert torch.equal(got > 0, want > 0), scale
        assert torch.allclose(got, want, atol=1e-6), scale
        assert torch.allclose(got.sum(-1), torch.ones(12), atol=1e-5)


def test_top_p_cut_refuses_a_row_that_is_not_finite_and_sampling_cuts_it_the_other_way():
    from shared.sampling import _cut_rows, _cut_rows_sorted

    probs = torch.softmax(torch.randn(3, 300, generator=torch.Generator().manual_seed(2)), -1)
    top_p, k = torch.full((3,), 0.9), torch.full((3,), 300)
    assert cpu_kernels().top_p_cut(probs, top_p, k) is not None
    probs[1, 17] = float("nan")
    assert cpu_kernels().top_p_cut(probs, top_p, k) is None
    assert torch.equal(_cut_rows(probs, top_p, k).isnan(), _cut_rows_sorted(probs, top_p, k).isnan())


def test_top_p_cut_ranks_equal_probabilities_by_id_and_sampling_takes_it(monkeypatch):
    """Equal probabilities straddling the cut: the lower ids are kept (the whole-sort path breaks such ties in
    numpy's order, which is unspecified); sampling_probs on CPU goes through the kernel, not the whole sort."""
    from shared import sampling
    from shared.sampling import sampling_probs

    def no_sort(*args):
        raise AssertionError("the whole-sort path ran")

    monkeypatch.setattr(sampling, "_cut_rows_sorted", no_sort)
    probs = torch.tensor([[0.1, 0.3, 0.1, 0.3, 0.1, 0.1]])
    got = cpu_kernels().top_p_cut(probs, torch.tensor([0.75]), torch.tensor([6]))
    assert got.tolist() == [[0.125, 0.375, 0.125, 0.375, 0.0, 0.0]]  # 0.3, 0.3, then the 0.1s of ids 0 and 2
    logits = probs.log()
    one = torch.tensor([1.0])
    assert torch.allclose(sampling_probs(logits, one, torch.tensor([0.75]), torch.tensor([0])), got)


@pytest.mark.parametrize("intermediate", [1, 8, 13, 768])
def test_silu_mul_equals_torch_and_computes_each_row_alike(intermediate):
    """silu(gate) * up from a fused gate/up row: within float32 rounding of PyTorch's (its exp is another
    polynomial), the same bits for a row alone or among others, tails past the last eight included."""
    generator = torch.Generator().manual_seed(intermediate)
    gate_up = torch.randn(5, 2 * intermediate, generator=generator) * 6
    got = cpu_kernels().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == (5, intermediate)
    assert torch.allclose(got, want, rtol=4e-7, atol=1e-7)
    for row in range(5):
        assert torch.equal(cpu_kernels().silu_mul(gate_up[row:row + 1])[0], got[row])


def test_silu_mul_keeps_nan_and_saturates_like_silu():
    gate = torch.tensor([float("nan"), float("inf"), 100.0, -100.0, 0.0, -0.0, 1e-30, 2.5])
    act = cpu_kernels().silu_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    assert torch.isnan(act[0])
    assert act[1] == float("inf") and act[2] == 100.0 and abs(float(act[3])) < 1e-35
    assert act[4] == 0 and act[5] == 0 and float(act[6]) == pytest.approx(5e-31, rel=1e-6)
    assert float(act[7]) == pytest.approx(float(torch.nn.functional.silu(torch.tensor(2.5))), rel=1e-6)


def test_attention_over_a_bfloat16_cache_equals_attention_over_its_widened_values():
    """Keys and values read as bfloat16 are widened exactly, then the same float32 arithmetic: the same bits as
    the float32 kernel on the widened cache."""
    from shared.attention import visibility_mask

    kernels = cpu_kernels()
    q, k, v = _attention_inputs(2, 4, 2, 3, 70, 64, seed=8)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    mask = visibility_mask(torch.tensor([[40, 41, 42], [67, 68, 69]]), 70)
    assert torch.equal(kernels.attention(q, k, v, mask, 0.125), kernels.attention(q, k.float(), v.float(), mask, 0.125))


def test_the_cache_write_rounds_to_bfloat16_as_torch_does():
    """q/k norms + rotary + cache write into a bfloat16 cache: PyTorch's float -> bfloat16 rounding of what the
    float32 cache holds (nearest even, NaN kept a NaN), and the same q."""
    kernels = cpu_kernels()
    heads, kv_heads, dim, batch, seq = 4, 2, 16, 2, 3
    generator = torch.Generator().manual_seed(9)
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * dim, generator=generator) * 3
    qkv[1, 2, -1] = float("nan")  # a value of v
    qkv[0, 0, heads * dim + 5] = 1 + 2 ** -8  # a key half way between two bfloat16 values: rounds to even
    angles = torch.randn(batch, seq, dim, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    slots, positions = torch.tensor([2, 0]), torch.tensor([[4, 5, 6], [0, 1, 2]])
    norm = torch.rand(heads + kv_heads, dim, generator=generator) + 0.5
    caches = {}
    for dtype in (torch.float32, torch.bfloat16):
        keys, values = torch.zeros(3, kv_heads, 8, dim, dtype=dtype), torch.zeros(3, kv_heads, 8, dim, dtype=dtype)
        q = kernels.qk_rotary_cache(qkv, heads, kv_heads, dim, norm, 1e-6, cos, sin, keys, values, slots, positions)
        caches[dtype] = (q, keys, values)
    (q32, k32, v32), (q16, k16, v16) = caches[torch.float32], caches[torch.bfloat16]
    assert torch.equal(q32, q16)
    assert torch.equal(k16.view(torch.int16), k32.to(torch.bfloat16).view(torch.int16))
    nan = torch.isnan(v32)  # (PyTorch's NaN bit pattern varies with its code path: any NaN will do)
    assert torch.equal(torch.isnan(v16), nan) and bool(nan[0, 1, 2, -1])
    assert torch.equal(v16[~nan].view(torch.int16), v32[~nan].to(torch.bfloat16).view(torch.int16))
