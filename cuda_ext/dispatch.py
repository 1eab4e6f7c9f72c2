"""Which implementation of a kernel runs, chosen per call by the tensors' device and $DFLASH_KERNELS:

- auto (default): CUDA tensors go to the CUDA build (the reference if it is not built: no nvcc, a failed build);
  CPU tensors to the reference, except where a kernel's host build is the faster CPU path (kernel folders say
  which: `cpu_default`).
- host: CPU tensors go to the host build wherever it exists (how the tests run the kernel code in the servers).
- reference: the PyTorch references everywhere.
"""

import os

import torch

from cuda_ext.build import cuda_library, host_library

MODES = ("auto", "host", "reference")


def kernel_mode() -> str:
    mode = os.environ.get("DFLASH_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"DFLASH_KERNELS must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def built_entry(kernel: str, device: torch.device):
    """The C entry point of `kernel` in the build for `device` (CUDA or host), whatever the mode; None if unbuilt."""
    functions = cuda_library() if device.type == "cuda" else host_library() if device.type == "cpu" else None
    return None if functions is None else functions[kernel]


def kernel_entry(kernel: str, device: torch.device, cpu_default: bool = False):
    """The C entry point that should run `kernel` for tensors on `device`, or None for the reference."""
    mode = kernel_mode()
    if mode == "reference":
        return None
    if device.type == "cpu" and not (mode == "host" or cpu_default):
        return None
    return built_entry(kernel, device)


def stream_argument(device: torch.device) -> list:
    """The trailing cudaStream_t of a CUDA entry point (the current stream, so graph capture records it)."""
    return [torch.cuda.current_stream(device).cuda_stream] if device.type == "cuda" else []


def check_status(kernel: str, status: int) -> None:
    if status == -1:
        raise ValueError(f"{kernel}: arguments the kernel does not take")
    if status == -2:
        raise IndexError(f"{kernel}: a token id outside the vocabulary")
    if status != 0:
        raise RuntimeError(f"{kernel}: the CUDA launch failed (status {status})")
