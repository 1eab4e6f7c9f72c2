"""Finding and checking the processes dflash-serve starts (no third-party imports: benchmarks use it too)."""

import os
import signal
import subprocess
from pathlib import Path


def child_pid(parent_pid: int, role: str, rank: int = 0) -> int:
    """The pid of parent_pid's child whose command line names this role (and rank, for a tensor-parallel
    verify worker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if int((entry / "stat").read_text().split()[3]) != parent_pid:
                continue
        except (OSError, ValueError, IndexError):
            continue
        if b"--role" in argv and argv[argv.index(b"--role") + 1].decode() == role:
            own_rank = int(argv[argv.index(b"--rank") + 1]) if b"--rank" in argv else 0
            if own_rank == rank:
                return int(entry.name)
    raise LookupError(role)


def resident_kb(pid: int) -> int:
    """A process's resident memory (VmRSS), in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(f"no VmRSS for process {pid}")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def stop_process(process: subprocess.Popen, timeout_s: float) -> int | None:
    """SIGTERM (dflash-serve's graceful stop), then SIGKILL if it has not exited within timeout_s; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.returncode
