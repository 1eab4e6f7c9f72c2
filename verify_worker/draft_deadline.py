"""How long to wait for a draft: a multiple of the drafter's recent latency, with a floor and a cap.

A fixed timeout has to be long enough for the slowest legitimate call (the first calls of a fresh drafter, a
call that catches up on a whole prompt's context) and so is far too long for a drafter that stopped answering
in the middle of a stream: every stream waits it out. Steady calls (each request sends only what one step
committed) take about the same time, so their deadline follows their measured median; calls without a
measured peer (a fresh drafter, a catch-up call) get the cap.
"""

from collections import deque
from statistics import median


class DraftDeadline:
    def __init__(self, cap_s: float, floor_s: float = 0.25, multiple: float = 8.0, window: int = 32,
                 min_samples: int = 4):
        if cap_s <= 0 or floor_s <= 0:
            raise ValueError(f"draft deadlines must be positive, got cap {cap_s} and floor {floor_s}")
        self.cap_s, self.floor_s, self.multiple, self.min_samples = cap_s, min(floor_s, cap_s), multiple, min_samples
        self.steady: deque[float] = deque(maxlen=window)  # seconds of recent steady calls

    def timeout(self, catch_up: bool) -> float:
        """Seconds to wait for the reply to a call (catch_up: it carries more context than a step commits)."""
        if catch_up or len(self.steady) < self.min_samples:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.multiple * median(self.steady)))

    def observe(self, seconds: float, catch_up: bool) -> None:
        """A call that was answered: steady calls set the deadline of the next ones."""
        if not catch_up:
            self.steady.append(seconds)

    def reset(self) -> None:
        """A new drafter (or one that came back): its latency is not known yet."""
        self.steady.clear()
