"""A kernel set tried once at pack on small inputs of the model's device and dtype, against PyTorch's kernels: a GPU
whose Triton cannot compile or launch one of them, or computes it wrongly, is a start-up error naming the kernel,
not a failure at the first request's step."""

import torch

from shared.errors import DFlashError


class KernelCheckError(DFlashError):
    pass


def check_kernels(kernels, oracle, device: torch.device | str, dtype: torch.dtype, fp8: bool = True,
                  tolerance: float = 5e-2) -> None:
    """Run every operation of `kernels` and of `oracle` (TorchKernels) on the same small random inputs on device, in
    dtype (the FP8 ones where fp8: a model with FP8 weights); raise KernelCheckError naming the first operation that
    raises or differs by more than `tolerance` (relative to the oracle's largest magnitude: the two sum in
    different orders, bfloat16 included)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, to=dtype):
        return torch.randn(*shape, generator=generator).to(to).to(device)

    counts = torch.tensor([3, 0, 18, 1], device=device)  # an empty group, one past a whole tile
    weights = randn(4, 40, 72)
    blocks = (torch.randn(4, 40, 72, generator=generator) * 2).to(torch.float8_e4m3fn).to(device)
    scales = (torch.rand(4, 2, 2, generator=generator) * 0.01 + 0.001).to(device)
    x = randn(22, 72)
    q, q_rope, latent, key_rope = randn(1, 2, 3, 32), randn(1, 2, 3, 8), randn(1, 70, 32), randn(1, 70, 8)
    visible = torch.rand(1, 2, 70, generator=generator) < 0.5
    visible[..., 0] = True
    visible = (visible & (visible.cumsum(-1) <= 30)).to(device)  # at most 30 keys a row: a selection of width 40
    index_q, index_keys, head_weights = randn(1, 2, 4, 16), randn(1, 40, 16), randn(1, 2, 4, to=torch.float32)
    calls = {
        "grouped": lambda k: k.grouped(x, weights, counts),
        "grouped (FP8 blocks)": lambda k: k.grouped(x, blocks, counts, scales, (32, 64)),
        "fp8_rows": lambda k: k.fp8_rows(x[None, :5], blocks[0], scales[0], (32, 64)),
        "latent_attention": lambda k: k.latent_attention(q, q_rope, latent, key_rope, visible, 0.2),
        "latent_attention (selected keys)": lambda k: k.latent_attention(q, q_rope, latent, key_rope, visible, 0.2,
                                                                         40),
        "index_scores": lambda k: k.index_scores(index_q, index_keys, head_weights, 0.25),
        "rows": lambda k: k.rows(x, weights[0]),
        "rows (float32)": lambda k: k.rows(x.float(), weights[0].float()),
        "norm": lambda k: k.norm(x, weights[0, 0], 1e-6),
        "l2_norm": lambda k: k.l2_norm(x.float()),
    }
    if not fp8:
        del calls["grouped (FP8 blocks)"], calls["fp8_rows"]
    for name, call in calls.items():
        want = call(oracle).float()
        try:
            got = call(kernels).float()
        except Exception as exc:  # a compiler or launch failure of any kind: named, with its cause
            hint = " (Triton's FP8 needs compute capability 8.9 or newer)" if "fp8" in name.lower() else ""
            raise KernelCheckError(f"the GLM {kernels.name} kernel {name!r} failed on {device} ({dtype}): "
                                   f"{type(exc).__name__}: {exc}{hint}") from exc
        if got.shape != want.shape:
            raise KernelCheckError(f"the GLM {kernels.name} kernel {name!r} on {device} gave shape "
                                   f"{tuple(got.shape)}, not {tuple(want.shape)}")
        error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not error <= tolerance:
            raise KernelCheckError(f"the GLM {kernels.name} kernel {name!r} on {device} ({dtype}) differs from "
                                   f"PyTorch's by {error:.3g} (relative; at most {tolerance} expected)")
