"""cuda_ext's row RMSNorm (the target's norms under --batch-invariant): the host build against rms_normalize, each
row's bits independent of the rows beside it (PyTorch's own reduction picks its threads by the row count on a
GPU: 512 for one row of 4096, 32 from 16 rows up); on a GPU, the CUDA build equal to the host build."""

import pytest
import torch

from cuda_ext import build
from cuda_ext.row_norm import op, reference

needs_host = pytest.mark.skipif(build.host_library() is None, reason="no C++ compiler here")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or build.cuda_library() is None,
                               reason="no GPU, or the CUDA build is off (benchmarks/gpu_session.sh runs these)")


def _rows(dtype, rows=17, dim=4096, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=generator) * 3).to(dtype).to(device)
    weight = (1 + torch.randn(dim, generator=generator) / 10).to(dtype).to(device)
    return x, weight


@needs_host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_build_is_rms_normalize(dtype):
    x, weight = _rows(dtype, dim=192)
    got, want = op.row_norm(x, weight, 1e-6), reference.row_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.float() - want.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 0.02)
    heads = (1 + torch.randn(4, 64) / 10).to(dtype)  # a [heads, dim] weight: each head row with its own
    per_head = x.view(17, 3, 64)[:, :1].expand(17, 4, 64).contiguous()
    got, want = op.row_norm(per_head, heads, 1e-6), reference.row_norm(per_head, heads, 1e-6)
    assert (got.float() - want.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 0.02)
    with pytest.raises(ValueError, match="a weight of"):
        op.row_norm(per_head[:, :3], heads, 1e-6)


@needs_host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_depend_on_that_row_alone(dtype):
    x, weight = _rows(dtype)
    together = op.row_norm(x, weight, 1e-6)
    for rows in (1, 2, 4, 8, 16):
        assert torch.equal(op.row_norm(x[:rows], weight, 1e-6), together[:rows]), rows
    assert torch.equal(op.row_norm(x[5:6], weight, 1e-6)[0], together[5])


@needs_host
def test_the_custom_op_has_a_consistent_fake_implementation():
    x, weight = _rows(torch.bfloat16, rows=3, dim=64)
    torch.library.opcheck(op.row_norm_kernel, (x, weight[None], 1e-6), test_utils=("test_schema", "test_faketensor"))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_cuda_build_is_the_host_build_and_rows_stand_alone(dtype):
    x, weight = _rows(dtype)
    host = op.row_norm(x, weight, 1e-6)
    cuda = op.row_norm(x.cuda(), weight.cuda(), 1e-6)
    assert torch.equal(cuda.cpu(), host)
    for rows in (1, 2, 4, 8, 16, 17):
        assert torch.equal(op.row_norm(x[:rows].cuda(), weight.cuda(), 1e-6), cuda[:rows]), rows


@needs_host
def test_the_row_norm_takes_the_glm_kernels_l2_norm():
    """TritonKernels.l2_norm on a GPU (KDA's q and k): x / sqrt(sum x^2 + eps) as the row norm with the weight
    1 / sqrt(dim) and eps / dim, against kda.l2_normalize (the CPU family's)."""
    from verify_worker.families.common.kda import l2_normalize

    x, _ = _rows(torch.float32, dim=128)
    dim = x.shape[-1]
    got = op.row_norm(x, x.new_full((dim,), dim**-0.5), 1e-6 / dim)
    assert (got - l2_normalize(x, 1e-6)).abs().max().item() <= 1e-6
