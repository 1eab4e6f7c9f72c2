"""Loading a target checkpoint folder with the family its config.json names (verify_worker/families/)."""

from pathlib import Path

from shared.config_json import read_config
from verify_worker.families.interface import TargetFamily
from verify_worker.families.registry import family_for
from verify_worker.parallel.group import TensorParallel


def load_target(folder: str | Path, device: str = "cpu", dtype: str = "auto",
                tp: TensorParallel = TensorParallel(), pack: bool = True, kernel_threads: int = 1) -> TargetFamily:
    """Load an HF checkpoint strictly (a missing, unexpected or mis-shaped tensor is a CheckpointError; an
    unknown architecture or a shape TP N cannot split a ConfigError). pack: lay the weights out for inference
    (False keeps the checkpoint's modules and names, for training and tests). kernel_threads: the threads a
    packed family's C++ CPU layer stack shares (families without one ignore it; the same bits whatever the
    count)."""
    config = read_config(folder)
    target = family_for(config).load(folder, config, device, dtype, tp, pack)
    share = getattr(target, "share_kernel_threads", None)  # an optional family hook (the dense C++ stack)
    if pack and kernel_threads > 1 and share is not None:
        share(kernel_threads)
    return target
