"""Loading a target checkpoint folder with the family its config.json names (verify_worker/families/)."""

from pathlib import Path

from shared.config_json import read_config
from shared.errors import ConfigError
from shared.host_memory import release_freed_memory
from verify_worker.families.interface import TargetFamily
from verify_worker.families.registry import family_for
from verify_worker.parallel.group import TensorParallel


def batch_invariant_refusal(device: str) -> str | None:
    """Why --batch-invariant is refused on this device (a CLI's message), or None."""
    if str(device).startswith("cuda"):
        return None
    return (f"--batch-invariant is for a CUDA device (--device cuda), not {device!r}: on CPU the default path, the "
            f"C++ kernels, is row-invariant already")


def load_target(folder: str | Path, device: str = "cpu", dtype: str = "auto",
                tp: TensorParallel = TensorParallel(), pack: bool = True, kernel_threads: int = 1,
                batch_invariant: bool = False) -> TargetFamily:
    """Load an HF checkpoint strictly (a missing, unexpected or mis-shaped tensor is a CheckpointError; an
    unknown architecture or a shape TP N cannot split a ConfigError). pack: lay the weights out for inference
    (False keeps the checkpoint's modules and names, for training and tests). kernel_threads: the threads a
    packed family's C++ CPU layer stack shares (families without one ignore it; the same bits whatever the
    count). batch_invariant: every row of a step computed independently of the others on an accelerator too
    (--batch-invariant: a family that offers it, tensor parallelism 1)."""
    config = read_config(folder)
    family = family_for(config)
    if batch_invariant and not family.batch_invariant:
        raise ConfigError(f"--batch-invariant is not offered for {family.name} targets yet (Qwen3/Llama only)")
    if batch_invariant and tp.parallel:
        raise ConfigError("--batch-invariant needs tensor parallelism 1: an all-reduce's summation order depends on "
                          "the size of the message, so a row's sums would depend on the batch")
    extra = {"batch_invariant": True} if batch_invariant else {}
    target = family.load(folder, config, device, dtype, tp, pack, **extra)
    share = getattr(target, "share_kernel_threads", None)  # an optional family hook (the dense C++ stack)
    if pack and kernel_threads > 1 and share is not None:
        share(kernel_threads)
    if str(device).startswith("cpu"):
        release_freed_memory()  # the load's transient copies: back to the host
    return target
