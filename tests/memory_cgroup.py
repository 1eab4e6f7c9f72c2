"""A memory cgroup of its own for a test's process tree (cgroup v1's memory hierarchy, else a v2 one delegated to
this process), where this host lets the test make one; None where not (not root, no writable hierarchy)."""

import os
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class MemoryCgroup:
    def __init__(self, folder: Path, limit_file: str):
        self.folder, self.limit_file = folder, limit_file

    @classmethod
    def make(cls, limit_bytes: int) -> "MemoryCgroup | None":
        name = f"dflash-test-{uuid.uuid4().hex[:8]}"
        own_v2 = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.startswith("0::")), None)
        candidates = [(ROOT / "memory" / name, "memory.limit_in_bytes")]
        if own_v2 is not None:
            candidates.append((ROOT / own_v2.strip("/") / name, "memory.max"))
        for folder, limit_file in candidates:
            try:
                folder.mkdir()
            except OSError:
                continue
            try:
                (folder / limit_file).write_text(str(limit_bytes))
                return cls(folder, limit_file)
            except OSError:
                folder.rmdir()
        return None

    def enter(self) -> None:
        """Moves the calling process in (a Popen preexec_fn: the child and all it starts)."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.folder.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
