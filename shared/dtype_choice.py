"""Which torch dtype a worker computes in, from the --dtype flag, the checkpoint's dtype and the device."""

import torch

from shared.checkpoint_io import DTYPES
from shared.errors import ConfigError


def resolve_dtype(name: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """'auto' = the checkpoint's dtype on an accelerator; on CPU, bfloat16 for a bfloat16 checkpoint when the CPU
    multiplies bfloat16 natively (AVX512-BF16 or AMX: an 8-token verify block then costs about as much as one
    token), else float32 (float16 and emulated bfloat16 are slow there)."""
    if name == "auto":
        on_cpu = str(device).startswith("cpu")
        name = checkpoint_dtype if not on_cpu or (checkpoint_dtype == "bfloat16" and native_cpu_bfloat16()) \
            else "float32"
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported (choose from {', '.join(DTYPES)} or auto)")
    return DTYPES[name]


def native_cpu_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). oneDNN's own bf16 check also
    accepts plain AVX512, where bfloat16 is emulated (slow, and its row invariance is not checked)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False
