"""How many drafts a speculative step asks of the rows that leave the choice to the server: the block's full count,
or about half of it where a verify block of that many rows costs much less for the tokens it loses.

On GPUs a verify block of 8 rows costs about what one row does, and the full block wins. On CPUs without matrix
units the products of a wide block are compute-bound: each row adds its multiply-adds, so 8 rows cost several
one-row steps while 4 still cost little more than one (docs/benchmarks.md, the twin). What the narrower block
loses is the drafts it no longer verifies: from the survival counts of full-width steps (how often at least i
drafts were accepted), a request expected to commit A tokens at the full width commits about
1 + (A - 1) * S(d) / S(full) at d drafts, S(d) the summed survival of the first d positions.

Plain data and pure maths; AdaptiveSpeculation owns one and keeps both widths measured.
"""

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DraftWidths:
    full: int = 0  # drafts of a full block (block size - 1); 0 until the engine sets its block size
    window: int = 15  # narrow steps whose median is the narrow width's step time
    keep: float = 0.995  # the survival counts' weight kept per full-width row counted (they forget slowly)
    refresh_every: int = 32  # steps at the preferred width between steps at the other (both stay measured)
    survival: list[float] = field(default_factory=list)  # [full + 1]: rows that accepted at least i drafts
    narrow_samples: dict[int, deque] = field(default_factory=dict)  # batch bucket -> narrow steps' seconds
    run: int = 0  # speculative steps in a row at the preferred width

    def set_full(self, full: int) -> None:
        """The full block's drafts. A change of a width already set forgets what was measured at the old one."""
        if full == self.full:
            return
        if self.full:
            self.narrow_samples, self.run = {}, 0
        self.full, self.survival = full, [0.0] * (full + 1)

    @property
    def narrow(self) -> int:
        """The narrower draft count: half the full one, rounded down (7 -> 3, 15 -> 7); 0 where there is none."""
        return self.full // 2 if self.full >= 2 else 0

    def record_full(self, accepted: int) -> None:
        """A full-width row that accepted `accepted` of its drafts (nothing before the full width is set)."""
        if not self.full:
            return
        self.survival = [count * self.keep for count in self.survival]
        for i in range(min(accepted, self.full) + 1):
            self.survival[i] += 1.0

    def known(self) -> bool:
        """Whether full-width rows were counted (the survival ratios below mean something)."""
        return bool(self.survival) and self.survival[0] > 0

    def acceptance_at(self, full_acceptance: float, drafts: int) -> float:
        """The tokens a step of `drafts` drafts commits for a request that commits full_acceptance at the full
        width."""
        reach = sum(self.survival[1:])
        if drafts >= self.full or not reach:
            return full_acceptance
        return 1.0 + (full_acceptance - 1.0) * sum(self.survival[1:drafts + 1]) / reach

    def uncensored(self, tokens: int, drafts: int) -> float:
        """A row of `drafts` drafts that committed `tokens`, as a full-width step would likely have: the same where
        a draft was rejected, else plus the drafts past `drafts` expected to be accepted after all of them were."""
        if tokens <= drafts or drafts >= self.full or not self.known() or self.survival[drafts] <= 0:
            return float(tokens)
        return tokens + sum(self.survival[drafts + 1:]) / self.survival[drafts]

    def record_narrow_seconds(self, bucket: int, seconds: float) -> None:
        self.narrow_samples.setdefault(bucket, deque(maxlen=self.window)).append(seconds)

    def narrow_seconds(self, bucket: int) -> float | None:
        samples = self.narrow_samples.get(bucket)
        return statistics.median(samples) if samples else None

    def equivalent_seconds(self, bucket: int, acceptance: float, overhead: float) -> float | None:
        """What a full-width step would have to cost to commit tokens as fast as a narrow step does for requests
        of full-width acceptance `acceptance` (each step paying `overhead` besides): None before the narrow width
        was measured at this batch size or a full-width row was counted."""
        narrow = self.narrow_seconds(bucket)
        if narrow is None or not self.narrow or not self.known():
            return None
        rate = self.acceptance_at(acceptance, self.narrow) / (narrow + overhead)
        return acceptance / rate - overhead

    def choose(self, full_seconds: float | None, equivalent: float | None) -> int | None:
        """The drafts cap of the next speculative step (None: the full block): the full width until it is measured,
        then the narrow one once to measure it, then the faster, with one step of the other every
        refresh_every."""
        if not self.narrow or full_seconds is None or not self.known():
            return None
        prefer_narrow = equivalent is None or equivalent < full_seconds
        self.run += 1
        if equivalent is not None and self.run > self.refresh_every:
            self.run = 0
            prefer_narrow = not prefer_narrow
        return self.narrow if prefer_narrow else None
