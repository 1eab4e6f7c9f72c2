"""How long to wait for a draft: a multiple of what the call should take, with a floor and a cap.

A fixed timeout has to be long enough for the slowest legitimate call (the first calls of a fresh drafter, a
call that catches up on a whole prompt's context) and so is far too long for a drafter that stopped answering
in the middle of a stream: every stream waits it out. So the deadline follows the drafter's measured latency:

- Steady calls (each request sends what a few steps committed: at most STEADY_BLOCKS blocks of rows) take about
  the same time: their median `base` at their median rows `base_rows` is the usual call.
- A call costs a fixed block cost plus a cost per context row (the drafter projects each row into its cache).
  The cost per row is measured on the calls that carry many more rows than the steady ones (a new prompt's
  context, the draft after a run of plain steps): the median of (seconds - base) / (rows - base_rows) over the
  last of them. Until one is measured, a row is assumed to cost base / base_rows (the whole call scaled by its
  rows), an upper bound, since the block cost is part of base.
- A call's deadline is `multiple` x (base + per-row cost x its rows above base_rows), at least the floor, at
  most the cap. Where the cost of a row is only the upper bound, the multiple applies to base alone: the bound
  overstates a row's cost several times already, and multiplied again it put every large call of a drafter
  restarted shortly before (steady calls measured, no large one) at the cap, so a drafter hung in such a
  probe (64 plain steps of 16 streams: 1024 rows) stalled every stream for the 5 s cap. A fresh drafter gets
  the cap until `min_samples` calls of either kind have been answered (a drafter restarted while 16 streams
  decode plainly may see only large calls and rare probes for a while).

Scaling the whole call by its rows (the old rule) gave the draft after 64 plain steps of 16 requests (1024 rows,
against 4 rows in a steady one-request call) a deadline of seconds, which a hung drafter then cost every stream.
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
        self.large: deque[tuple[float, int]] = deque(maxlen=window)  # the same, of the other (catch-up) calls

    def timeout(self, rows: int = 0) -> float:
        """Seconds to wait for the reply to a call carrying `rows` context rows."""
        if len(self.steady) + len(self.large) < self.min_samples:
            return self.cap_s
        usual = self.steady or self.large  # only large calls so far (a fresh drafter meeting new prompts): theirs
        base, base_rows = median(s for s, _ in usual), max(1.0, median(r for _, r in usual))
        extra = max(0.0, rows - base_rows)
        measured = self._marginal(base, base_rows) if self.steady else []
        if measured:
            seconds = self.multiple * (base + max(0.0, median(measured)) * extra)
        else:  # the upper bound base / base_rows is its own margin: no multiple on the rows
            seconds = self.multiple * base + base / base_rows * extra
        return min(self.cap_s, max(self.floor_s, seconds))

    def row_seconds(self, base: float, base_rows: float) -> float:
        """The measured cost of one more context row (never below 0), or the upper bound base / base_rows."""
        marginal = self._marginal(base, base_rows)
        return max(0.0, median(marginal)) if marginal else base / base_rows

    def _marginal(self, base: float, base_rows: float) -> list[float]:
        return [(s - base) / (r - base_rows) for s, r in self.large if r >= 2 * base_rows]

    def observe(self, seconds: float, catch_up: bool, rows: int = 1) -> None:
        """A call that was answered: steady calls set the usual latency, the others the cost of a row."""
        (self.large if catch_up else self.steady).append((seconds, rows))

    def reset(self) -> None:
        """A new drafter (or one that came back): its latency is not known yet."""
        self.steady.clear()
        self.large.clear()
