"""Packed projections (shared.packed_linear) compute what the checkpoint's separate layers compute."""

import pytest
import torch
from torch import nn

from conftest import write_hf_checkpoint
from shared.packed_linear import PackedLinear, packing_layout
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
    assert packing_layout(torch.zeros(1)) == "transposed"
    assert packing_layout(torch.zeros(1, dtype=torch.bfloat16)) is None  # oneDNN's checked layout stays


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
