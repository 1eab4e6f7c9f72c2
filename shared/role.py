"""What every role process does at start: logging with its role name, thread settings, the ready line."""

import logging
import os
import sys

READY_PREFIX = "DFLASH_READY"


def default_threads(role: str) -> int:
    """Threads per role when all roles share one host. The verify worker and the drafter run one after the
    other within a step, so each may use most cores; OMP_WAIT_POLICY=PASSIVE (set by dflash-serve) keeps
    idle OpenMP threads from spinning on cores the other process needs."""
    cores = os.cpu_count() or 1
    return max(1, cores if role == "verify" else cores // 2)


def configure_process(role: str, threads: int = 0, log_level: str = "INFO") -> logging.Logger:
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if role != "gateway":
        import torch

        torch.set_num_threads(threads or default_threads(role))
    return logging.getLogger(f"dflash.{role}")


def announce_ready(role: str, detail: str = "") -> None:
    """The line dflash-serve waits for on each child's stdout."""
    print(f"{READY_PREFIX} {role} {detail}".rstrip(), flush=True)
