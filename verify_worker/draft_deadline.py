"""How long to wait for a draft: a multiple of the drafter's recent latency, with a floor and a cap.

A fixed timeout has to be long enough for the slowest legitimate call (the first calls of a fresh drafter, a
call that catches up on a whole prompt's context) and so is far too long for a drafter that stopped answering
in the middle of a stream: every stream waits it out. Steady calls (each request sends what a few steps
committed: at most STEADY_BLOCKS blocks of rows, which covers the first draft after `--spec-policy adaptive`'s
plain steps) take about the same time, so their deadline follows their measured median. Every call's deadline
is that latency scaled by its context rows over the steady calls' typical rows (never below 1x), which bounds
its cost from above (a call is a fixed block cost plus a cost per context row): a catch-up call (a new prompt's
whole context) may wait longer, up to the cap. A fresh drafter, with nothing measured, gets the cap.
"""

from collections import deque
from statistics import median

STEADY_BLOCKS = 4  # a call whose requests each carry at most this many blocks of context rows is steady


class DraftDeadline:
    def __init__(self, cap_s: float, floor_s: float = 0.25, multiple: float = 8.0, window: int = 32,
                 min_samples: int = 4):
        if cap_s <= 0 or floor_s <= 0:
            raise ValueError(f"draft deadlines must be positive, got cap {cap_s} and floor {floor_s}")
        self.cap_s, self.floor_s, self.multiple, self.min_samples = cap_s, min(floor_s, cap_s), multiple, min_samples
        self.steady: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, context rows) of steady calls

    def timeout(self, rows: int = 0) -> float:
        """Seconds to wait for the reply to a call carrying `rows` context rows."""
        if len(self.steady) < self.min_samples:
            return self.cap_s
        seconds = median(s for s, _ in self.steady)
        seconds *= max(1.0, rows / max(1.0, median(r for _, r in self.steady)))
        return min(self.cap_s, max(self.floor_s, self.multiple * seconds))

    def observe(self, seconds: float, catch_up: bool, rows: int = 1) -> None:
        """A call that was answered: steady calls set the deadline of the next ones."""
        if not catch_up:
            self.steady.append((seconds, rows))

    def reset(self) -> None:
        """A new drafter (or one that came back): its latency is not known yet."""
        self.steady.clear()
