"""How long to wait for a draft: a multiple of what the call should take, with a floor and a cap.

A fixed timeout has to be long enough for the slowest legitimate call (the first calls of a fresh drafter, a
call that catches up on a whole prompt's context) and so is far too long for a drafter that stopped answering
in the middle of a stream: every stream waits it out. So the deadline follows the drafter's measured latency:

- Steady calls (each request sends what a few steps committed: at most STEADY_BLOCKS blocks of rows) take about
  the same time: their median `base` at their median rows `base_rows` is the usual call.
- A call costs a fixed block cost plus a cost per context row (the drafter projects each row into its cache).
  Two figures estimate a row's cost. The drafter's own clock: every reply says how long the call spent writing
  its context rows into the cache (`ingest_seconds`); each call's ingest seconds per row is at least what a row
  costs (it includes the fixed part of the ingest), so the smallest of the recent calls' figures bounds it
  closest. And the calls that carry many more rows than the steady ones (a new prompt's context, the draft
  after a run of plain steps): the median of (seconds - base) / (rows - base_rows) over the last of them, which
  also counts whatever else such a call carries beyond a steady one (more requests' blocks). The smaller one is
  used. On the demo pair (float32, one thread) the drafter's figure is about 50 us a row from one-request calls
  and 14 us from 16-request ones, against 4 us a row on a 1024-row call; where neither is known, a row is
  assumed to cost base / base_rows (the whole call scaled by its rows, about 3 ms there), an upper bound.
- A call's deadline is `multiple` x (base + per-row cost x its rows above base_rows), at least the floor, at
  most the cap. Where the cost of a row is only the bound base / base_rows, the multiple applies to base alone:
  that bound overstates a row's cost hundreds of times already. Multiplied again, or without the drafter's
  ingest figure, it put every large call of a drafter restarted shortly before (steady one-request calls
  measured, no large one) at seconds: a drafter hung in such a probe (64 plain steps of 16 streams: 1024 rows)
  stalled every stream for about 3 s. A fresh drafter gets the cap until `min_samples` calls of either kind
  have been answered (a drafter restarted while 16 streams decode plainly may see only large calls and rare
  probes for a while).

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
        self.ingested: deque[tuple[float, int]] = deque(maxlen=window)  # (drafter's ingest seconds, rows > 0)

    def timeout(self, rows: int = 0) -> float:
        """Seconds to wait for the reply to a call carrying `rows` context rows."""
        if len(self.steady) + len(self.large) < self.min_samples:
            return self.cap_s
        usual = self.steady or self.large  # only large calls so far (a fresh drafter meeting new prompts): theirs
        base, base_rows = median(s for s, _ in usual), max(1.0, median(r for _, r in usual))
        extra = max(0.0, rows - base_rows)
        row = self._row_seconds(base, base_rows)
        if row is not None:
            seconds = self.multiple * (base + row * extra)
        else:  # the upper bound base / base_rows is its own margin: no multiple on the rows
            seconds = self.multiple * base + base / base_rows * extra
        return min(self.cap_s, max(self.floor_s, seconds))

    def row_seconds(self, base: float, base_rows: float) -> float:
        """What one more context row costs: the smaller of the large calls' measure (never below 0) and the
        drafter's ingest seconds per row, else the upper bound base / base_rows."""
        row = self._row_seconds(base, base_rows)
        return base / base_rows if row is None else row

    def _row_seconds(self, base: float, base_rows: float) -> float | None:
        """The smaller of the two estimates of a row's cost, None while neither is known. The large calls'
        measure counts against a steady call's base whatever else they carry more (the blocks of more requests:
        the drill's first calls after a restart measured 0.7 ms a row on the tiny test pair, whose drafter said
        14 us), so the drafter's own figure caps it."""
        marginal = [(s - base) / (r - base_rows) for s, r in self.large if r >= 2 * base_rows] if self.steady else []
        estimates = [max(0.0, median(marginal))] if marginal else []
        if self.ingested:
            estimates.append(min(seconds / rows for seconds, rows in self.ingested))
        return min(estimates) if estimates else None

    def observe(self, seconds: float, catch_up: bool, rows: int = 1, ingest_seconds: float | None = None) -> None:
        """A call that was answered: steady calls set the usual latency, the others the cost of a row;
        ingest_seconds (the drafter's time writing the call's rows into its cache, None if it did not say) is the
        drafter's own figure for the cost of a row."""
        (self.large if catch_up else self.steady).append((seconds, rows))
        if ingest_seconds is not None and rows > 0:
            self.ingested.append((max(0.0, ingest_seconds), rows))

    def reset(self) -> None:
        """A new drafter (or one that came back): its latency is not known yet."""
        self.steady.clear()
        self.large.clear()
        self.ingested.clear()
