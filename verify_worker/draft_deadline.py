"""How long to wait for a draft: a multiple of what the call should take, with a floor and a cap.

A fixed timeout has to be long enough for the slowest legitimate call (the first calls of a fresh drafter, a
call that catches up on a whole prompt's context) and so is far too long for a drafter that stopped answering
in the middle of a stream: every stream waits it out. So the deadline follows the drafter's measured latency:

- Steady calls (each request sends what a few steps committed: at most STEADY_BLOCKS blocks of rows) take about
  the same time: their median `base` at their median rows `base_rows` is the usual call.
- A call costs a fixed block cost plus a cost per context row (the drafter projects each row into its cache).
  The cost per row is measured on the calls that carry many more rows than the steady ones (a new prompt's
  context, the draft after a run of plain steps): the median of (seconds - base) / (rows - base_rows) over the
  last of them. Until one is measured, the drafter's own clock bounds it: every reply says how long the call
  spent writing its context rows into the cache (`ingest_seconds`), and their sum over the recent calls divided
  by their rows is at least what a row costs (each call's figure includes the fixed part of its ingest). On the
  demo pair (float32, one thread) that bound is about 50 us a row from one-request calls and 14 us from
  16-request ones, against 4 us a row measured on a 1024-row call and about 3 ms for base / base_rows (the
  whole call scaled by its rows, the bound used when neither is known).
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
        measured = self._marginal(base, base_rows) if self.steady else []
        if measured:
            seconds = self.multiple * (base + max(0.0, median(measured)) * extra)
        elif self.ingested:  # the drafter's own ingest time per row: a bound, but a close one
            seconds = self.multiple * (base + self._ingest_per_row() * extra)
        else:  # the upper bound base / base_rows is its own margin: no multiple on the rows
            seconds = self.multiple * base + base / base_rows * extra
        return min(self.cap_s, max(self.floor_s, seconds))

    def row_seconds(self, base: float, base_rows: float) -> float:
        """The measured cost of one more context row (never below 0), else the drafter's ingest seconds per row,
        else the upper bound base / base_rows."""
        marginal = self._marginal(base, base_rows)
        if marginal:
            return max(0.0, median(marginal))
        return self._ingest_per_row() if self.ingested else base / base_rows

    def _ingest_per_row(self) -> float:
        return sum(s for s, _ in self.ingested) / sum(r for _, r in self.ingested)

    def _marginal(self, base: float, base_rows: float) -> list[float]:
        return [(s - base) / (r - base_rows) for s, r in self.large if r >= 2 * base_rows]

    def observe(self, seconds: float, catch_up: bool, rows: int = 1, ingest_seconds: float | None = None) -> None:
        """A call that was answered: steady calls set the usual latency, the others the cost of a row;
        ingest_seconds (the drafter's time writing the call's rows into its cache, None if it did not say) bounds
        the cost of a row until a large call measures it."""
        (self.large if catch_up else self.steady).append((seconds, rows))
        if ingest_seconds is not None and rows > 0:
            self.ingested.append((max(0.0, ingest_seconds), rows))

    def reset(self) -> None:
        """A new drafter (or one that came back): its latency is not known yet."""
        self.steady.clear()
        self.large.clear()
        self.ingested.clear()
