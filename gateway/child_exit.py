"""How dflash-serve names a child that died before it was ready: its exit status or signal, an OOM kill, its peak
memory beside what its memory plan asked, and its last log lines."""

import signal
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ChildExit:
    role: str
    status: int | None  # its exit status; negative: the signal that ended it; None: still running
    oom_killed: bool | None  # the OOM killer's count rose while it ran (None: this host does not say)
    peak_rss: int | None  # bytes resident at its peak (the kernel's count)
    memory: tuple[int, int] | None  # (asked, given) bytes, as its memory plan announced them
    log_tail: tuple[str, ...]


def how_it_ended(status: int | None, oom_killed: bool | None) -> str:
    if status is None:
        return "is still running"
    if status >= 0:
        return f"exited with status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    if -status != signal.SIGKILL:
        return f"was killed by {name}"
    if oom_killed:
        return f"was killed by {name} from the kernel's OOM killer (out of memory: the OOM-kill count rose)"
    if oom_killed is None:
        return f"was killed by {name} (the kernel's OOM killer sends it when memory runs out)"
    return f"was killed by {name} (not by the OOM killer: its count did not rise)"


def describe_exit(ended: ChildExit, before: str = "before it was ready") -> str:
    """One message, its log lines indented below it."""
    parts = [f"the {ended.role} role {how_it_ended(ended.status, ended.oom_killed)} {before}"]
    if ended.peak_rss:
        parts.append(f"it had reached {ended.peak_rss / GIB:.2f} GiB resident")
    if ended.memory is not None:
        asked, given = ended.memory
        parts.append(f"its memory plan asked for {asked / GIB:.2f} GiB of the {given / GIB:.2f} GiB it was given")
    message = "; ".join(parts)
    if ended.log_tail:
        message += "\nits last log lines:\n" + "\n".join(f"    {line}" for line in ended.log_tail)
    return message
