"""FP8 block-quantized weights (`quant_method: fp8`, `weight_block_size`): F8_E4M3 `weight` [out, in] and a float32
`weight_scale_inv` [ceil(out / rows), ceil(in / cols)] that, despite its name, multiplies each block."""

import torch

from shared.errors import CheckpointError


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """float32 [out, in] = weight * its block's scale; a partial last block (576 = 4 * 128 + 64 rows) uses the
    scale of its grid cell, as vLLM does (transformers refuses such shapes)."""
    if weight.dim() != 2 or tuple(scale.shape) != scale_grid(tuple(weight.shape), block):
        raise CheckpointError(f"{name}: scale grid {list(scale.shape)} does not fit a {list(weight.shape)} weight in "
                              f"blocks of {list(block)} (expected {list(scale_grid(tuple(weight.shape), block))})")
    rows, cols = weight.shape
    expanded = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * expanded
