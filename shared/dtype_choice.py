"""Which torch dtype a worker computes in, from the --dtype flag, the checkpoint's dtype and the device."""

import torch

from shared.checkpoint_io import DTYPES
from shared.errors import ConfigError


def as_served(name: str, checkpoint_dtype: str, float32_kernels: bool) -> str:
    """--dtype as the loaders take it: bfloat16 for a bfloat16 checkpoint where the C++ CPU kernels run is auto's
    choice there (the checkpoint's bfloat16 weights as they are, float32 sums or AMX's bfloat16 products, a bfloat16
    KV cache), the maths bfloat16 asks for or finer; PyTorch's own bfloat16 ops are several times slower on a CPU
    (docs/serving.md, --dtype). Any other flag is taken as given."""
    return "auto" if name == "bfloat16" and checkpoint_dtype == "bfloat16" and float32_kernels else name


def resolve_dtype(name: str, checkpoint_dtype: str, device: str, float32_kernels: bool = False) -> torch.dtype:
    """'auto' = the checkpoint's dtype on an accelerator. On CPU: float32 where the model runs float32 through
    the C++ CPU kernels (float32_kernels: shared.packed_linear.float32_kernels_run; they multiply the bfloat16
    weights as they are, float32 sums, and beat oneDNN's native bfloat16 at serving batch sizes: on an AVX-512
    BF16 CPU the demo target's one-token forward took 1.0 against 4.8 ms, a 9-token block 3.1 against 5.5 ms;
    with AMX a bfloat16 checkpoint's products are bfloat16 ones there, the "amx" layout of
    shared.packed_linear.kernel_layout); else bfloat16 for a bfloat16 checkpoint when the CPU multiplies
    bfloat16 natively (AVX512-BF16 or AMX: an 8-token verify block then costs about as much as one token), else
    float32 (float16 and emulated bfloat16 are slow there). --dtype bfloat16 is auto where as_served says so."""
    name = as_served(name, checkpoint_dtype, float32_kernels)
    if name == "auto":
        on_cpu = str(device).startswith("cpu")
        native = checkpoint_dtype == "bfloat16" and native_cpu_bfloat16() and not float32_kernels
        name = checkpoint_dtype if not on_cpu or native else "float32"
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


def kv_cache_dtype(name: str, checkpoint_dtype: str, compute_dtype: torch.dtype, float32_kernels: bool) -> torch.dtype:
    """The KV cache's element type: the compute dtype, except that --dtype auto keeps a bfloat16 checkpoint's
    keys and values in bfloat16 where the model computes float32 through the C++ CPU kernels (they widen each
    value as they read it). The cache is what a step at 16 streams mostly reads (attention over every context):
    bfloat16 halves it. Every mode of the engine reads the same rounded values, so speculative output still
    equals plain output exactly; --dtype float32 keeps a float32 cache."""
    name = as_served(name, checkpoint_dtype, float32_kernels)
    if name == "auto" and checkpoint_dtype == "bfloat16" and compute_dtype == torch.float32 and float32_kernels:
        return torch.bfloat16
    return compute_dtype
