"""Our Triton kernels compile for the GPUs we serve on, without one: Triton's compiler targets sm_90 (H100/H200)
and sm_121 (GB10, DGX Spark) from this machine, down to a cubin. What a GPU session would otherwise find first
(a shape or dtype the compiler rejects at the published widths) fails here instead. Their results are tested under
the interpreter (glm_kernels_interpreted.py); only a GPU runs the compiled code."""

import warnings

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cuda_ext.grouped_rows.kernel import _grouped_rows_kernel  # noqa: E402
from cuda_ext.index_scores.kernel import _index_scores_kernel  # noqa: E402
from cuda_ext.latent_attention.kernel import _latent_attention_kernel  # noqa: E402


def signature(kernel, pointers: dict[str, str], floats=(), wide=()) -> dict[str, str]:
    """Every argument of the kernel typed: the named pointers, float or 64-bit scalars, i32 for the rest, and the
    constexpr parameters."""
    constant = {kernel.arg_names[i] for i in kernel.constexprs}
    return {name: "constexpr" if name in constant else
            pointers.get(name) or ("fp32" if name in floats else "i64" if name in wide else "i32")
            for name in kernel.arg_names}


SHARED_BYTES = {90: 232_448, 121: 101_376}  # the most shared memory a block may use (H100/H200; GB10)


def compile_for(kernel, types: dict[str, str], constants: dict, arch: int) -> bytes:
    """The cubin, after checking that the kernel's shared memory fits the architecture (a launch would refuse it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton 3.9's note on its FP-fusion default
        compiled = triton.compile(ASTSource(kernel, types, constexprs=constants), target=GPUTarget("cuda", arch, 32))
    assert compiled.metadata.shared <= SHARED_BYTES[arch], (kernel.__name__, compiled.metadata.shared)
    return compiled.asm["cubin"]


@pytest.mark.parametrize("arch", [90, 121])
def test_the_glm_kernels_compile_at_the_published_widths(arch):
    bf16 = "*bf16"
    fp8 = "*fp8e4nv"
    for x, weights, scaled, act_fp8 in ((bf16, bf16, False, False), (bf16, fp8, True, False), (fp8, fp8, True, True)):
        # bfloat16 weights; FP8 blocks with their scales, W8A16 and W8A8
        grouped = signature(_grouped_rows_kernel, {"x_ptr": x, "x_scale_ptr": "*fp32", "w_ptr": weights,
                                                   "scale_ptr": "*fp32", "out_ptr": bf16, "tile_group_ptr": "*i32",
                                                   "tile_first_ptr": "*i32", "tile_end_ptr": "*i32"},
                            wide=("stride_wg", "stride_sg"))
        assert compile_for(_grouped_rows_kernel, grouped,
                           {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SCALE_N": 128, "SCALE_K": 128,
                            "HAS_SCALES": scaled, "ACT_FP8": act_fp8, "ROUND_BF16": True, "INTERPRETED": False}, arch)
    attention = signature(_latent_attention_kernel, {"q_ptr": bf16, "qr_ptr": bf16, "lat_ptr": bf16, "kr_ptr": bf16,
                                                     "vis_ptr": "*u8", "out_ptr": bf16}, floats=("scale",))
    rope = arch == 90  # GLM-5.2 (rope 64) on H100/H200; GLM-5.3-Flash (NoPE) on the Sparks
    for indexed in (False, True):  # every key masked; the selected keys alone
        kinds = {**attention, "vis_ptr": "*i32"} if indexed else attention
        assert compile_for(_latent_attention_kernel, kinds,
                           {"BLOCK_H": 16, "BLOCK_T": 64, "BLOCK_D": 512, "BLOCK_R": 64, "HAS_ROPE": rope,
                            "INDEXED": indexed, "INTERPRETED": False}, arch)
    scores = signature(_index_scores_kernel, {"q_ptr": bf16, "k_ptr": bf16, "w_ptr": "*fp32", "out_ptr": "*fp32"},
                       floats=("scale",))
    assert compile_for(_index_scores_kernel, scores, {"BLOCK_H": 32, "BLOCK_T": 32, "BLOCK_D": 128,
                                                      "INTERPRETED": False}, arch)
