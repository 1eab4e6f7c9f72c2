"""Inference-time packing of linear layers: several projections of one input fused into one GEMM (q/k/v,
gate/up), each weight stored in the layout its device multiplies fastest.

Checkpoints load into the unpacked modules (their names are the loading table); a loaded model then packs
itself. Layouts, measured on 2 CPU cores (AMD EPYC, float32, one thread):
- "bf16": a weight that came from a bfloat16 checkpoint stays bfloat16 and goes through the C++ kernel of
  shared.cpu_kernels (float32 sums): the 33 projections of the demo target took 1.8-2.0 ms against 3.1-3.5 ms
  for MKL on float32 weights (one row; 8 rows: 3.9 against 7.1 ms; 128 rows: 27.9 against 30.2 ms), and its
  rows are computed independently (row invariance);
- "amx": the same bfloat16 weights multiplied on AMX tiles, with the activations rounded to bfloat16 first (a
  bfloat16 model's matmul, float32 sums: bf16_gemm_amx.cpp); where the C++ kernels run on an AMX CPU and the
  caller asks for bfloat16 products (`kernel_layout`). The demo target's 9-token verify block took 1.52 against
  1.90 ms in "bf16" (2 kernel threads), 16 one-token rows 2.18 against 2.72 ms, one token the same;
- "transposed": [in, out] float32, x @ W (MKL's F.linear took 217 us for a one-token row of the demo's
  [1536, 256] gate/up weight, stored transposed 51 us);
- "fused": the [out, in] layout and F.linear, on CUDA (cuBLAS reads either layout alike; not run yet);
- "rows": the [out, in] layout multiplied by a function the owner passes (`multiply`) whose result for a row never
  depends on the other rows of the call: a target packed for --batch-invariant, on a GPU the row GEMM of cuda_ext.
benchmarks/bench_forward.py measures the whole forward in each layout.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from shared.cpu_kernels.arguments import TILE, bf16_exact
from shared.cpu_kernels.library import cpu_kernels
from shared.dtype_choice import as_served

KERNEL_LAYOUTS = ("bf16", "amx")  # the layouts the C++ kernels multiply (bfloat16 weight tiles)
ROWS_LAYOUT = "rows"  # multiplied by the owner's row-invariant function (--batch-invariant)


def packing_layout(weight: torch.Tensor) -> str | None:
    """How to pack weights like this one:
    - "bf16" for float32 on CPU where the C++ kernels run (shared.cpu_kernels): each weight kept as the bfloat16
      it came from (when it round-trips exactly; otherwise "transposed") and multiplied by a row-invariant
      float32 kernel reading half the bytes;
    - "transposed" ([in, out], x @ W) for float32 on CPU otherwise;
    - "fused" (the [out, in] layout, F.linear) on accelerators;
    - None (leave the layers as loaded) for reduced precision on CPU, whose oneDNN GEMMs give the row
      invariance bfloat16 verification relies on (see batch_invariant_attention) in the layout it was checked in.
    """
    return layout_for(weight.device, weight.dtype)


def layout_for(device, dtype: torch.dtype) -> str | None:
    """packing_layout's choice for weights of `dtype` on `device` (a name or torch.device)."""
    if torch.device(device).type != "cpu":
        return "fused"
    if dtype != torch.float32:
        return None
    return "bf16" if float32_kernels_run(device) else "transposed"


def packed_size(out_features: int, in_features: int, layout: str | None, dtype: torch.dtype,
                bf16_exact: bool) -> tuple[torch.dtype, int]:
    """The dtype and bytes PackedLinear stores for a weight [out, in] of `dtype` in `layout` (bf16_exact: its
    values round-trip through bfloat16, as a bfloat16 checkpoint's do): the kernels' bfloat16 tiles of 16 rows,
    else the weight's own size."""
    if layout in KERNEL_LAYOUTS and bf16_exact:
        return torch.bfloat16, -(-out_features // TILE) * TILE * in_features * torch.bfloat16.itemsize
    return dtype, out_features * in_features * dtype.itemsize


def kernel_layout(dtype: str, checkpoint_dtype: str, device) -> str:
    """The layout a loader packs a model in: "amx" (bfloat16 products) for --dtype auto and a bfloat16 checkpoint
    where the C++ kernels run on a CPU with AMX, else "auto" (packing_layout's choice: float32 products where
    the kernels run). A bfloat16 checkpoint asks for bfloat16 maths; the float32 kernels compute more precisely
    than it asks, AMX as it asks and faster. --dtype float32 keeps float32 products; --dtype bfloat16 is auto here
    (shared.dtype_choice.as_served)."""
    dtype = as_served(dtype, checkpoint_dtype, float32_kernels_run(device))
    if dtype != "auto" or checkpoint_dtype != "bfloat16" or not float32_kernels_run(device):
        return "auto"
    return "amx" if cpu_kernels().amx else "auto"


def float32_kernels_run(device) -> bool:
    """Whether a float32 model on this device packs its bfloat16-exact weights for the C++ kernels ("bf16"
    above): a CPU where they build, whatever PyTorch's thread count. A kernel runs on its caller's thread; the
    target's layer stack, the lm_heads and the drafter's projections share a worker pool of their own
    (--kernel-threads, every usable core by default). Until 2026-12-03 they also asked for PyTorch on one thread
    (from before the pool, when a kernel was one thread against MKL's several): a worker on 4 cores or more, whose
    default is half the cores, and dflash-generate, PyTorch's default, silently took the per-op PyTorch path
    (dflash-generate on the demo pair: 81 tok/s plain where the server decodes about 480)."""
    return str(device).startswith("cpu") and cpu_kernels() is not None


class PackedLinear(nn.Module):
    """The outputs of one or more nn.Linear layers of the same input, side by side in one GEMM (no autograd).

    reduce: applied to the product before the bias (a row-parallel layer's all-reduce: the bias is added once).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        """weight [out, in] as nn.Linear holds it; layout as packing_layout names it, or "rows" with `multiply`
        (x [..., in], weight [out, in] -> [..., out])."""
        super().__init__()
        if (layout == ROWS_LAYOUT) != (multiply is not None):
            raise ValueError("the rows layout, and only it, takes a multiply function")
        self.multiply = multiply
        on_kernels = layout in KERNEL_LAYOUTS
        if layout == "amx" and (cpu_kernels() is None or not cpu_kernels().amx):
            raise ValueError("the amx layout needs the C++ CPU kernels on a CPU with AMX (kernel_layout checks)")
        self.kernels = cpu_kernels() if on_kernels and bf16_exact(weight) else None
        self.layout = layout if self.kernels is not None or not on_kernels else "transposed"
        self.transposed = self.layout == "transposed"
        self.isa = "amx" if self.layout == "amx" else None  # bf16_matmul's kernel: None for the float32 ones
        self.out_features = weight.shape[0]
        if self.kernels is not None:
            stored = self.kernels.bf16_tiles(weight, self.layout)  # [tiles, in, 16] bfloat16
        else:
            stored = weight.t().contiguous() if self.transposed else weight.contiguous()
        self.register_buffer("weight", stored)
        self.register_buffer("bias", bias)
        self.reduce = reduce
        self.pool = None  # a CpuKernels.worker_pool whose threads share the product (the owner sets it)

    @classmethod
    def of(cls, *linears: nn.Linear, layout: str, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
           multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> "PackedLinear":
        weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum of outs, in]
        biases = [linear.bias for linear in linears]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("cannot pack linear layers with and without a bias together")
        bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        return cls(weight, bias, layout, reduce, multiply)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.reduce is None and self.layout == "fused":
            return F.linear(x, self.weight, self.bias)
        if self.multiply is not None:
            out = self.multiply(x, self.weight)
        elif self.kernels is not None:
            out = self.kernels.bf16_matmul(x, self.weight, self.out_features, self.isa, self.pool)
        elif self.transposed:
            out = torch.matmul(x, self.weight)
        else:
            out = F.linear(x, self.weight)
        if self.reduce is not None:
            out = self.reduce(out)
        return out if self.bias is None else out + self.bias


def common_layout(modules) -> str | None:
    """The layout every PackedLinear among `modules` is stored in, or None where they differ (a one-call forward
    of the C++ kernels multiplies one way: "bf16" or "amx")."""
    layouts = {module.layout for module in modules if isinstance(module, PackedLinear)}
    return layouts.pop() if len(layouts) == 1 else None


def packed_head(weight: torch.Tensor, layout: str | None = "auto") -> "torch.Tensor | PackedLinear":
    """An lm_head weight [vocab, hidden] packed for inference like the layers (shared.layers.project_rows takes
    either) in `layout` ("auto": packing_layout's), or the weight itself where the layout is None."""
    layout = packing_layout(weight) if layout == "auto" else layout
    return weight if layout is None else PackedLinear(weight.detach(), None, layout)
