"""The GLM families' kernels, as a set chosen once when the model is packed (`use_kernels` gives it to every module
with a `glm_kernels` attribute):
- `grouped(x, weights, counts, scales=None, block=None)`: rows sorted by group, each group's rows times its own weight
  read in place (no copy of a weight per row): the MoE experts' rows grouped by expert, the absorbed MLA's per-head
  products by head. x [rows, K], weights [groups, N, K], counts [groups] -> [rows, N] in x's dtype. With scales
  [groups, ceil(N / block[0]), ceil(K / block[1])], weights are FP8 blocks, each multiplied by its block's scale
  and rounded to x's dtype before the product (W8A16: the weight a checkpoint dequantized at load holds).
- `rows(x, weight)`: a projection x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, each row on its own (the
  families' Linear, the mHC mixing, the router, the lm_head).
- `norm(x, weight, eps)`: RMSNorm over the last dimension (shared.layers.rms_normalize's contract: the RMSNorm
  modules, the mHC's unweighted norm, KDA's output norm); `l2_norm(x, eps)`: x / sqrt(sum x^2 + eps) (KDA's q and k).
- `fp8_rows(x, weight, scale, block)`: a projection whose weight [N, K] is kept as FP8 blocks: x [..., K] ->
  [..., N], each row on its own, the weight as `grouped` takes it.
  A set made with fp8_activations=True multiplies FP8 weights as W8A8 instead: the activations quantized per row
  and group of block[1] columns (dynamic 1 x 128 for the published blocks), FP8 products scaled per K block. Rows
  stay independent (speculative == plain holds); the products differ from the dequantized twin's by the
  activations' rounding. Not the default: the benchmarks measure it (benchmarks/gpu_glm_step.py --fp8 w8a8).
- `latent_attention(q_latent, q_rope, latent, key_rope, visible, scale, width=None)`: MLA's attention in the latent
  space. q_latent [b, s, heads, kv_lora], q_rope [b, s, heads, rope], latent [b, keys, kv_lora], key_rope [b, keys,
  rope], visible [b, s, keys] -> [b, s, heads, kv_lora]. width: a bound on the keys a row sees (the indexer's
  selection), which the Triton kernel reads alone.
- `index_scores(q, keys, head_weights, scale)`: the DSA indexer's scores. q [b, s, heads, dim], keys [b, T, dim],
  head_weights [b, s, heads] -> float32 [b, s, T].

`TorchKernels` (every device; the CPU family, the oracle): one row per batched-matmul entry, group counts read on
the host. `TritonKernels` (CUDA with Triton): cuda_ext/grouped_rows, cuda_ext/latent_attention and
cuda_ext/index_scores, no host synchronisation, no copy per query row; projections on cuda_ext's row GEMM where it
takes them (bfloat16, widths of 16) and on grouped_rows (one group) where not, float32 ones included, so no product
of the step is left to cuBLAS, whose rows may round by the batch; norms on cuda_ext's row norm (a warp a row, its
sum in a fixed order), not PyTorch's reductions, which pick how many threads sum a row by the number of rows. Both
keep a row's result independent of the other rows of the call.
"""

import torch

from cuda_ext.grouped_rows.reference import quantize_rows
from cuda_ext.dispatch import kernel_entry
from cuda_ext.row_gemm import op as row_gemm
from cuda_ext.row_norm.op import DTYPES as ROW_NORM_DTYPES
from cuda_ext.row_norm.op import row_norm
from shared.layers import RMSNorm, rms_normalize
from verify_worker.families.common.backend_choice import gpu_backend_or
from verify_worker.families.common.fp8_blocks import dequantize
from verify_worker.families.common.kda import l2_normalize
from verify_worker.families.common.kernel_check import check_kernels
from verify_worker.families.common.mla import latent_attention
from verify_worker.families.common.row_invariant import linear_rows
from verify_worker.families.common.sparse_indexer import index_scores


class TorchKernels:
    name = "torch"

    def __init__(self, fp8_activations: bool = False):
        self.fp8_activations = fp8_activations  # W8A8 for FP8 weights (see fp8_rows)

    rows = staticmethod(linear_rows)
    norm = staticmethod(rms_normalize)
    l2_norm = staticmethod(l2_normalize)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None,
                block: tuple[int, int] | None = None) -> torch.Tensor:
        out = x.new_empty(x.shape[0], weights.shape[1])  # [rows, N]
        start = 0
        for group, count in enumerate(counts.tolist()):
            if count:
                rows = x[start:start + count]
                out[start:start + count] = linear_rows(rows, weights[group]) if scales is None else \
                    self.fp8_rows(rows, weights[group], scales[group], block)
                start += count
        return out

    def fp8_rows(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        """x [..., K] times an FP8 block weight [N, K]. W8A16: the weight as a checkpoint dequantized at load holds
        it. W8A8: x quantized per row and group of block[1] columns first (quantize_rows), both sides dequantized
        to float32 and multiplied there: the Triton kernel's product up to its order of the sums."""
        if not self.fp8_activations:
            return linear_rows(x, dequantize(weight, scale, block).to(x.dtype))
        rows = x.reshape(-1, x.shape[-1])  # [n, K]
        q, row_scales = quantize_rows(rows, block[1])  # fp8 [n, K], float32 [n, ceil(K / block[1])]
        activations = dequantize(q, row_scales, (1, block[1]))  # float32 [n, K]
        out = linear_rows(activations, dequantize(weight, scale, block))  # float32 [n, N]
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    def latent_attention(self, q_latent, q_rope, latent, key_rope, visible, scale, width=None) -> torch.Tensor:
        if width is not None and visible.shape[-1] > width:  # the bound the Triton kernel relies on, checked alike
            torch._assert_async(visible.sum(-1).max() <= width, "a row selects more keys than the selection's width")
        return latent_attention(q_latent, q_rope, latent, key_rope, visible, scale)  # every key, masked

    index_scores = staticmethod(index_scores)


class TritonKernels:
    name = "triton"

    def __init__(self, fp8_activations: bool = False):  # Triton: the optional gpu extra
        self.fp8_activations = fp8_activations  # W8A8 for FP8 weights (grouped_rows' fp8_activations)
        from cuda_ext.grouped_rows.kernel import grouped_rows
        from cuda_ext.index_scores.kernel import index_scores as index_scores_kernel
        from cuda_ext.latent_attention.kernel import latent_attention as latent_attention_kernel

        self._grouped, self._attend, self._index_scores = grouped_rows, latent_attention_kernel, index_scores_kernel

    def grouped(self, x, weights, counts, scales=None, block=None) -> torch.Tensor:
        return self._grouped(x, weights, counts, scales=scales, scale_block=block,
                             fp8_activations=self.fp8_activations and scales is not None)

    def rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The row GEMM where it takes the product, else grouped_rows with one group (on CUDA); linear_rows on other
        devices (Triton's interpreter: the CPU's row-invariant product stands in for what the GPU runs)."""
        if x.device.type != "cuda":
            return linear_rows(x, weight)
        if row_gemm.usable(x, weight):
            return row_gemm.row_gemm(x, weight)
        return self._one_group(x, weight)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """cuda_ext's row norm on CUDA where it is built and the weight has x's dtype, else PyTorch's (rms_normalize,
        which also takes a weight of another dtype and promotes)."""
        if row_norm_built(x) and weight.dtype == x.dtype:
            return row_norm(x, weight, eps)
        return rms_normalize(x, weight, eps)

    def l2_norm(self, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """x / sqrt(sum x^2 + eps) as the row norm computes it: x / sqrt(mean x^2 + eps / dim) / sqrt(dim)."""
        if not row_norm_built(x):
            return l2_normalize(x, eps)
        dim = x.shape[-1]
        return row_norm(x, x.new_full((dim,), dim**-0.5), eps / dim)

    def fp8_rows(self, x, weight, scale, block) -> torch.Tensor:
        return self._one_group(x, weight, scales=scale[None], scale_block=block, fp8_activations=self.fp8_activations)

    def _one_group(self, x: torch.Tensor, weight: torch.Tensor, **options) -> torch.Tensor:
        """x [..., K] @ weight [N, K]^T -> [..., N] through grouped_rows, every row in one group."""
        rows = x.reshape(-1, x.shape[-1])  # [n, K]
        counts = torch.full((1,), rows.shape[0], dtype=torch.int64, device=x.device)
        return self._grouped(rows, weight[None], counts, **options).view(*x.shape[:-1], weight.shape[0])

    def latent_attention(self, q_latent, q_rope, latent, key_rope, visible, scale, width=None) -> torch.Tensor:
        batch, seq, heads, _ = q_latent.shape
        out = self._attend(q_latent.reshape(batch * seq, heads, -1), q_rope.reshape(batch * seq, heads, -1),
                           latent, key_rope, visible, scale, width)  # [b * s, heads, kv_lora]
        return out.view(batch, seq, heads, -1)

    def index_scores(self, q, keys, head_weights, scale) -> torch.Tensor:
        batch, seq, heads, dim = q.shape
        scores = self._index_scores(q.reshape(batch * seq, heads, dim), keys, head_weights.reshape(batch * seq, heads),
                                    scale)  # [b * s, T]
        return scores.view(batch, seq, -1)


def row_norm_built(x: torch.Tensor) -> bool:
    """Whether cuda_ext's row norm takes x: a CUDA tensor of float32 or bfloat16, the kernel built for its device."""
    return x.device.type == "cuda" and x.dtype in ROW_NORM_DTYPES and kernel_entry("row_norm", x.device) is not None


def kernels_for(device: torch.device | str, dtype: torch.dtype, fp8: bool):
    """"triton" on CUDA where Triton is installed, tried first on small inputs in dtype, its FP8 products too where
    fp8 (the model keeps FP8 weights): a failing kernel is a start-up error naming it (kernel_check.py); else
    "torch"."""
    kernels = gpu_backend_or(device, TritonKernels, TorchKernels)
    if kernels.name != TorchKernels.name:
        check_kernels(kernels, TorchKernels(), device, dtype, fp8)
    return kernels


def keeps_fp8(model: torch.nn.Module) -> bool:
    return any(name.endswith("_scale_inv") for name, _ in model.named_parameters())


def use_kernels(model: torch.nn.Module, kernels) -> None:
    """Every module of model with a `glm_kernels` attribute runs on `kernels`, and every RMSNorm normalizes
    through its norm."""
    for module in model.modules():
        if hasattr(module, "glm_kernels"):
            module.glm_kernels = kernels
        if isinstance(module, RMSNorm):
            module.normalize = kernels.norm
