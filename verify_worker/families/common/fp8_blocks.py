"""FP8 block-quantized weights (`quant_method: fp8`, `weight_block_size`): F8_E4M3 `weight` [out, in] and a float32
`weight_scale_inv` [ceil(out / rows), ceil(in / cols)] that, despite its name, multiplies each block."""

import torch

from shared.errors import CheckpointError


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight",
               offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float32 [out, in] = weight * its block's scale. weight may be a slice of the stored tensor starting at
    `offset` (row, column), with scale the rows and columns of the grid that cover it. A partial last block
    (576 = 4 * 128 + 64 rows) uses the scale of its grid cell, as vLLM does (transformers refuses such shapes)."""
    rows, cols = weight.shape
    r0, c0 = offset[0] % block[0], offset[1] % block[1]
    covering = (-(-(r0 + rows) // block[0]), -(-(c0 + cols) // block[1]))
    if weight.dim() != 2 or tuple(scale.shape) != covering:
        raise CheckpointError(f"{name}: scale grid {list(scale.shape)} does not fit a {list(weight.shape)} weight in "
                              f"blocks of {list(block)} (expected {list(covering)})")
    expanded = scale.float().repeat_interleave(block[0], 0)[r0: r0 + rows].repeat_interleave(block[1], 1)
    return weight.float() * expanded[:, c0: c0 + cols]
