"""The memory this host still offers a process, and whether the kernel's OOM killer has struck: from /proc and
this process's memory cgroup (v1 or v2), read-only; Linux only (elsewhere: unknown).

Available is the kernel's MemAvailable, or, where a cgroup this process belongs to (or one above it) sets a lower
limit, that limit less the cgroup's working set (its usage less the inactive page cache the kernel reclaims before
it kills anything), whichever is least.
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class HostMemory:
    available: int  # bytes
    source: str  # what the figure is, as a log line names it


@dataclass(frozen=True)
class CgroupMemory:
    path: Path  # the cgroup's folder
    limit: int
    working_set: int

    @property
    def available(self) -> int:
        return max(0, self.limit - self.working_set)


def meminfo_field(text: str, field: str) -> int | None:
    """A /proc/meminfo field in bytes ("MemAvailable:  24279072 kB")."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            value, *unit = rest.split()
            return int(value) * (1024 if unit == ["kB"] else 1)
    return None


def stat_field(text: str, field: str) -> int | None:
    """A "name value" line of memory.stat, memory.events or /proc/vmstat."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == field:
            return int(parts[1])
    return None


def cgroup_folders(proc_cgroup: str, root: Path) -> list[Path]:
    """This process's memory cgroup folders, leaf first, then each one above it up to the mount: cgroup v1's memory
    hierarchy where one is mounted, else the v2 one. A leaf path the mount does not show (a cgroup namespace shows
    the process's own cgroup as the mount's root) leaves the folders that exist."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    if v1 is not None and (root / "memory").is_dir():
        base, path = root / "memory", v1
    elif v2 is not None:
        base, path = root, v2
    else:
        return []
    parts = [part for part in path.strip("/").split("/") if part]
    folders = [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if folder.is_dir()]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_memory(folder: Path) -> CgroupMemory | None:
    """The folder's limit and working set, where it sets a limit (v2 memory.max, v1 memory.limit_in_bytes)."""
    v2 = (folder / "memory.max").exists()
    limit_text = _read(folder / ("memory.max" if v2 else "memory.limit_in_bytes"))
    usage_text = _read(folder / ("memory.current" if v2 else "memory.usage_in_bytes"))
    if limit_text is None or usage_text is None or limit_text.strip() == "max" or int(limit_text) >= UNLIMITED:
        return None
    inactive = stat_field(_read(folder / "memory.stat") or "", "inactive_file" if v2 else "total_inactive_file")
    usage = int(usage_text)
    return CgroupMemory(folder, int(limit_text), max(0, usage - (inactive or 0)))


def read_host_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory | None:
    """What a new process here may take (None where /proc/meminfo cannot be read: not Linux)."""
    meminfo = _read(proc / "meminfo")
    available = meminfo_field(meminfo, "MemAvailable") if meminfo else None
    if available is None:
        return None
    best = HostMemory(available, "the host's MemAvailable")
    for folder in cgroup_folders(_read(proc / "self" / "cgroup") or "", cgroup_root):
        group = cgroup_memory(folder)
        if group is not None and group.available < best.available:
            best = HostMemory(group.available, f"the memory cgroup {folder}: its limit {group.limit / 2**30:.1f} GiB "
                                               f"less {group.working_set / 2**30:.1f} GiB in use")
    return best


def oom_kill_count(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """How many processes the OOM killer has ended: in this process's memory cgroup (v2 memory.events, v1
    memory.oom_control), else on the host (/proc/vmstat); None where neither says."""
    for folder in cgroup_folders(_read(proc / "self" / "cgroup") or "", cgroup_root)[:1]:
        for name in ("memory.events", "memory.oom_control"):
            count = stat_field(_read(folder / name) or "", "oom_kill")
            if count is not None:
                return count
    return stat_field(_read(proc / "vmstat") or "", "oom_kill")


def release_freed_memory() -> None:
    """Hand the C allocator's freed pages back to the kernel (glibc's malloc_trim; nothing elsewhere): after a
    load, whose transient copies leave the heap larger than what it holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
