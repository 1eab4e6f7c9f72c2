"""Which backend a packed GLM model runs on its device."""

import torch


def gpu_backend_or(device: torch.device | str, gpu_backend, torch_backend):
    """gpu_backend() on a CUDA device where its library (Triton, fla-core: the optional gpu extra) imports, else
    torch_backend()."""
    if torch.device(device).type == "cuda":
        try:
            return gpu_backend()
        except ImportError:
            pass
    return torch_backend()
