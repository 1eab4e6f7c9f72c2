"""FP8 block weights kept FP8 in a model: modules name the parameters that can stay FP8 (`fp8_weights`); keep_fp8
turns one into its FP8 form (the weight float8_e4m3fn, its float32 block scales beside it as `<name>_scale_inv`,
the checkpoint's own name for a projection's scales); dequantized_weight is the torch side of the product (the
weight as a checkpoint dequantized at load holds it, bit for bit)."""

import torch
from torch import nn

from verify_worker.families.common.fp8_blocks import dequantize, scale_grid

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


def keep_fp8(module: nn.Module, name: str, block: tuple[int, int]) -> None:
    """module.<name> [..., N, K] becomes an FP8 parameter and module.<name>_scale_inv a float32 one
    [..., ceil(N / rows), ceil(K / cols)], on the weight's device (shapes only: the loader fills them)."""
    weight = getattr(module, name)
    grid = (*weight.shape[:-2], *scale_grid(tuple(weight.shape[-2:]), block))
    setattr(module, name, nn.Parameter(torch.empty(weight.shape, dtype=FP8, device=weight.device), requires_grad=False))
    setattr(module, name + SCALE_SUFFIX,
            nn.Parameter(torch.empty(grid, dtype=torch.float32, device=weight.device), requires_grad=False))
    module.fp8_block = block


def fp8_capable(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """State-dict name -> (module, attribute) of every parameter its module can keep FP8."""
    out = {}
    for prefix, module in model.named_modules():
        for attribute in getattr(module, "fp8_weights", ()):
            out[f"{prefix}.{attribute}" if prefix else attribute] = (module, attribute)
    return out


def dequantized_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] FP8 times its blocks' scales [ceil(N / rows), ceil(K / cols)], rounded once to dtype."""
    return dequantize(weight, scale, block).to(dtype)


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
