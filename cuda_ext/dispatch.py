"""Which implementation of a kernel runs, chosen per call by the tensors' device and $DFLASH_KERNELS:

- auto (default): CUDA tensors go to the CUDA build (the reference if it is not built: no nvcc, a failed build),
  except where the reference is the faster GPU path (kernel folders say which: `cuda_default`); CPU tensors to the
  reference, except where a kernel's host build is the faster CPU path (`cpu_default`).
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


def _build_for(device: torch.device):
    if device.type == "cuda":
        return cuda_library(device.index if device.index is not None else torch.cuda.current_device())
    return host_library() if device.type == "cpu" else None


def built_entry(kernel: str, device: torch.device):
    """The C entry point of `kernel` in the build for `device` (CUDA or host), whatever the mode; None if unbuilt."""
    build = _build_for(device)
    return None if build is None else build[kernel]


def kernel_entry(kernel: str, device: torch.device, cpu_default: bool = False, cuda_default: bool = True):
    """The C entry point that should run `kernel` for tensors on `device`, or None for the reference."""
    mode = kernel_mode()
    if mode == "reference":
        return None
    if device.type == "cpu" and not (mode == "host" or cpu_default):
        return None
    if device.type == "cuda" and not cuda_default:
        return None
    return built_entry(kernel, device)


def call_kernel(kernel: str, device: torch.device, *arguments) -> None:
    """Run `kernel`'s build for `device` on C arguments (pointers and sizes); on CUDA with that device current
    and on its current stream (so a CUDA graph being captured records the launch). Raises on a refused call."""
    entry = built_entry(kernel, device)
    if entry is None:
        raise RuntimeError(f"dflash::{kernel}: no kernel build for {device}")
    if device.type != "cuda":
        status = entry(*arguments)
    else:
        with torch.cuda.device(device):
            status = entry(*arguments, torch.cuda.current_stream(device).cuda_stream)
    if status == -1:
        raise ValueError(f"dflash::{kernel}: arguments the kernel does not take")
    if status == -2:
        raise IndexError(f"dflash::{kernel}: a token id outside the vocabulary")
    if status != 0:
        raise RuntimeError(f"dflash::{kernel}: the CUDA launch failed ({_build_for(device).error_name(status)})")
