"""What every role process does at start: logging with its role name, thread settings, the ready line."""

import logging
import os
import sys
from collections.abc import Callable

READY_PREFIX = "DFLASH_READY"
MEMORY_PREFIX = "DFLASH_MEMORY"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def default_threads(role: str) -> int:
    """Threads per role when all roles share one host: half the cores for the verify worker, a quarter for the
    drafter, the rest for the gateway and clients. Measured on 2 cores with the demo pair (dflash-bench, block
    8, concurrency 1): 1 verify thread served 301 tok/s plain and 237 speculative, 2 threads 225 and 138, since
    multi-threaded ops stall whenever another process holds a core. OMP_WAIT_POLICY=PASSIVE (set by
    dflash-serve) keeps idle OpenMP threads from spinning."""
    cores = os.cpu_count() or 1
    return max(1, cores // 2 if role == "verify" else cores // 4)


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


def announce_memory(role: str, asked: int, given: int) -> None:
    """The memory a role's plan asks for and the share it was given, in bytes, on its stdout (dflash-serve names
    them if the role then dies before it is ready)."""
    print(f"{MEMORY_PREFIX} {role} asked={asked} given={given}", flush=True)


def parse_memory_line(line: str) -> tuple[int, int] | None:
    """(asked, given) from an announce_memory line, else None."""
    if not line.startswith(MEMORY_PREFIX + " "):
        return None
    fields = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
    try:
        return int(fields["asked"]), int(fields["given"])
    except (KeyError, ValueError):
        return None


def run_worker(role: str, command: str, build: Callable, ready_detail: Callable) -> int:
    """Build a worker server (a user error exits 2 with one line), announce readiness, serve until Ctrl-C."""
    import zmq

    from shared.errors import DFlashError

    try:
        server = build()
    except (DFlashError, zmq.ZMQError, OSError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    announce_ready(role, ready_detail(server))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    except DFlashError as exc:  # e.g. a tensor-parallel rank died: say so in one line and exit non-zero
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1
    return 0
