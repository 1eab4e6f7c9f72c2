"""Packed projections (shared.packed_linear) compute what the checkpoint's separate layers compute."""

import pytest
import torch
from conftest import write_hf_checkpoint
from torch import nn

from shared.cpu_kernels.library import cpu_kernels
from shared.packed_linear import PackedLinear, float32_kernels_run, packing_layout
from verify_worker.target_loader import load_target


def _linears(bias: bool, seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(24, out, bias=bias) for out in (16, 8, 8)]


@pytest.mark.parametrize("layout", ["transposed", "fused"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_outputs_are_the_layers_side_by_side(layout, bias):
    linears = _linears(bias)
    packed = PackedLinear.of(*linears, layout=layout)
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        expected = torch.cat([linear(x) for linear in linears], -1)  # [3, 5, 32]
        got = packed(x)
    assert got.shape == (3, 5, 32) and packed.out_features == 32
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("layout", ["transposed", "fused"])
def test_reduce_comes_before_the_bias(layout):
    """A row-parallel layer sums the ranks' partial products, then adds its bias once."""
    linear = _linears(True)[0]
    packed = PackedLinear.of(linear, layout=layout, reduce=lambda t: 2 * t)
    x = torch.randn(4, 24)
    with torch.no_grad():
        expected = 2 * (x @ linear.weight.t()) + linear.bias
        assert torch.allclose(packed(x), expected, atol=1e-5)


def test_layers_with_and_without_bias_do_not_pack_together():
    with pytest.raises(ValueError, match="bias"):
        PackedLinear.of(nn.Linear(4, 4), nn.Linear(4, 4, bias=False), layout="fused")


def test_layout_per_device_and_dtype():
    kernels = cpu_kernels() is not None  # whatever PyTorch's thread count
    assert packing_layout(torch.zeros(1)) == ("bf16" if kernels else "transposed")
    assert packing_layout(torch.zeros(1, dtype=torch.bfloat16)) is None  # oneDNN's checked layout stays


@pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")
def test_the_kernels_run_whatever_pytorchs_thread_count(tmp_path):
    """The C++ kernels bring their own thread pool: a worker on 4 cores or more (PyTorch on half of them) and
    dflash-generate with PyTorch's default threads take them too."""
    write_hf_checkpoint(tmp_path, "qwen3", seed=3, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert float32_kernels_run("cpu") and packing_layout(torch.zeros(1)) == "bf16"
            assert load_target(tmp_path).whole_layers is not None  # --dtype auto
    finally:
        torch.set_num_threads(before)


def test_the_amx_layout_is_refused_where_amx_does_not_run():
    kernels = cpu_kernels()
    if kernels is not None and kernels.amx:
        pytest.skip("AMX runs here")
    with pytest.raises(ValueError, match="AMX"):
        PackedLinear(torch.zeros(16, 32), None, "amx")


def test_packed_target_equals_the_unpacked_one(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", seed=3, attention_bias=True)
    packed, unpacked = load_target(tmp_path, dtype="float32"), load_target(tmp_path, dtype="float32", pack=False)
    assert packed.model.layers[0].self_attn.qkv_proj is not None
    assert unpacked.model.layers[0].self_attn.qkv_proj is None
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None].expand(2, -1)
    logits = []
    with torch.inference_mode():
        for target in (packed, unpacked):
            out = target(ids, positions, target.new_cache(2, 32), torch.arange(2), (0, 1))
            logits.append((target.logits(out.hidden), out.taps))
    assert torch.allclose(logits[0][0], logits[1][0], atol=1e-5)
    assert torch.allclose(logits[0][1], logits[1][1], atol=1e-5)


def test_bfloat16_on_cpu_stays_as_loaded(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", seed=3)
    target = load_target(tmp_path, dtype="bfloat16")
    assert target.model.layers[0].self_attn.qkv_proj is None and target.model.layers[0].mlp.gate_up_proj is None


needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels do not build here")


@needs_kernels
def test_bf16_layout_only_for_weights_that_round_trip():
    """A weight that is not exactly bfloat16 keeps float32 ([in, out], PyTorch's GEMM): packing never rounds."""
    exact, inexact = _linears(False)[0], _linears(False, seed=1)[0]
    with torch.no_grad():
        exact.weight.copy_(exact.weight.to(torch.bfloat16).float())
    assert PackedLinear.of(exact, layout="bf16").layout == "bf16"
    assert PackedLinear.of(inexact, layout="bf16").layout == "transposed"


@needs_kernels
@pytest.mark.parametrize("family,dtype", [("qwen3", None), ("qwen3", torch.bfloat16), ("llama", torch.bfloat16)])
def test_packed_target_bf16_layout_equals_transposed(tmp_path, family, dtype):
    """The demo's case: a bfloat16 checkpoint run in float32. The kernel layout (bfloat16 weights, float32
    sums; the fused layer ops and attention of shared.cpu_kernels) computes the same function as PyTorch, to
    rounding, with and without q/k norms; a float32 checkpoint whose weights do not round-trip keeps PyTorch's
    GEMM (and still the fused ops)."""
    write_hf_checkpoint(tmp_path, family, seed=4, attention_bias=True, dtype=dtype)
    kernel = load_target(tmp_path, dtype="float32", pack=False).pack("bf16")
    reference = load_target(tmp_path, dtype="float32", pack=False).pack("transposed")
    layouts = {kernel.model.layers[0].self_attn.qkv_proj.layout, kernel.head.layout}
    assert layouts == ({"bf16"} if dtype is torch.bfloat16 else {"transposed"})
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None].expand(2, -1)
    assert kernel.kernels is not None and reference.kernels is None
    with torch.inference_mode():
        outputs = [target(ids, positions, target.new_cache(2, 32), torch.arange(2), (0, 1)) for target in (kernel, reference)]
        (got, got_taps), (want, want_taps) = ((target.logits(out.hidden), out.taps)
                                              for target, out in zip((kernel, reference), outputs))
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(got_taps, want_taps, atol=1e-4)


@needs_kernels
def test_dtype_bfloat16_on_a_bfloat16_checkpoint_runs_the_kernels_as_auto(tmp_path):
    """The flag vLLM users pass by habit: on a CPU where the C++ kernels run, a bfloat16 checkpoint's --dtype
    bfloat16 loads as --dtype auto (the kernels over the bfloat16 weights, a bfloat16 KV cache), the same function
    bit for bit, not PyTorch's bfloat16 ops; a float32 checkpoint's --dtype bfloat16 is taken as given."""
    from shared.dtype_choice import as_served

    assert as_served("bfloat16", "bfloat16", True) == "auto"
    assert as_served("bfloat16", "float32", True) == as_served("bfloat16", "bfloat16", False) == "bfloat16"
    assert as_served("float32", "bfloat16", True) == "float32"
    write_hf_checkpoint(tmp_path, "qwen3", seed=4, dtype=torch.bfloat16)
    asked, auto = load_target(tmp_path, dtype="bfloat16"), load_target(tmp_path, dtype="auto")
    assert asked.kernels is not None and asked.embed_weight.dtype == auto.embed_weight.dtype == torch.float32
    assert asked.kv_dtype == auto.kv_dtype == torch.bfloat16
    assert asked.model.layers[0].self_attn.qkv_proj.layout == auto.model.layers[0].self_attn.qkv_proj.layout
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7)[None]
    with torch.inference_mode():
        got, want = (t.logits(t(ids, positions, t.new_cache(1, 16), torch.arange(1), ()).hidden) for t in (asked, auto))
    assert torch.equal(got, want)


@needs_kernels
def test_a_cache_write_outside_the_cache_is_refused(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", seed=4, dtype=torch.bfloat16)
    target = load_target(tmp_path, dtype="float32", pack=False).pack("bf16")
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache"):
        target(torch.tensor([[1, 2]]), torch.tensor([[7, 8]]), target.new_cache(1, 8), torch.tensor([0]))
