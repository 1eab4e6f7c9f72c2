"""When speculation pays: a step-by-step choice between speculative and plain decoding from measurements.

Both modes are lossless step by step, and the choice depends only on what has already happened, so any schedule
of them keeps the output exact (greedy: the same tokens; sampling: the same distribution). Plain decoding is a
real mode of the same engine (every request drafts 0 tokens), not a fallback.

The model: a speculative step of the batch costs Ts seconds and commits, per request, its acceptance length A
(tokens per speculative step); a plain step costs Tp and commits one token per request; either step costs O
besides (the server loop around it and the engine's bookkeeping: `observe_overhead`). Speculate when the
batch's mean A times (Tp + O) is at least Ts + O. Step times are the median of the last `window` steps of a
mode per batch-size bucket. A is measured per request, a mean of its samples that forgets by the tokens of text
since each (`record_acceptance`), started at the mean of the requests measured so far (running and the last 64
finished), which keeps one step's weight in the figure (`_figure`), so a request decoding plainly drifts back
toward the mean until it is measured again. Until a mode is measured for a batch size, speculation comes first,
unless a smaller batch size measured in both modes already prefers plain decoding (`_decision_times`).

Probes: after `probe_every` plain steps in a row one step drafts, to re-measure A; for a batch of greedy
requests it is a scored probe, a plain step whose drafts are scored later against the tokens the plain steps
commit (the acceptance a verify would give, without the verify). After `refresh_every` speculative steps one
step is plain, to re-measure Tp. A probe that leaves plain decoding preferred doubles the spacing at that batch
size (up to `max_probe_every`, 64: a probe is also when a drafter that stopped answering is noticed); a probe
that makes speculation preferred, or a batch with unmeasured requests that could tip it (their plausible mean:
an upper confidence bound from the recent requests' A), restarts at `probe_every`. Probes cost at most
`probe_budget` of the plain decoding time (`budget_spacing`). A probe measures at most `probe_rows` requests,
those never measured first, then those probed longest ago.

The engine asks once per decode step (`plan`: which rows draft, whether the step is a scored probe) and tells
once what the step did (`record`: its time, each row's commits, a probe's drafts, scored here as plain steps
commit the tokens they guessed). Some requests pin their own rows to speculation (their rows draft whatever
`speculate` says for the others; `speculate` also takes the same two flags for a step of its own):
- a request that asks for drafts itself (num_speculative_tokens > 0): the policy is for requests that leave the
  choice to the server (the gateway's readiness probe and dflash-bench's speculative waves ask);
- a seeded sampled request (unless pin_seeded is off): its draws depend on the schedule, and a schedule chosen
  from measured times differs run to run, so this keeps seeded sampling reproducible. Greedy output does not
  depend on the schedule.
The measurements behind these choices: docs/decisions/0012-the-default-speculation-policy-is-adaptive.md.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from verify_worker.draft_widths import DraftWidths
from verify_worker.spec_step import RowNeed, StepOutcome, StepPlan


def batch_bucket(batch_size: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, ... (the next power of two)."""
    return 1 << max(0, batch_size - 1).bit_length()


def _decayed(old: float | None, new: float, keep: float) -> float:
    return new if old is None else keep * old + (1 - keep) * new


@dataclass
class AdaptiveSpeculation:
    probe_every: int = 8  # plain steps between speculative probes (at first)
    max_probe_every: int = 64  # the most they grow to while probes keep confirming plain decoding
    refresh_every: int = 64  # speculative steps between plain probes
    window: int = 15  # steps whose median is a mode's step time
    keep_acceptance: float = 0.95  # a request's acceptance samples: the weight kept per token of text since
    prior_steps: float = 4.0  # a new request's acceptance starts as this many steps at the requests' mean
    prior_floor: float = 1.0  # and its figure always weighs that mean as one more step (see `_figure`)
    pin_seeded: bool = True  # a step with a seeded sampled request drafts, whatever the measurements say
    step_samples: dict[tuple[int, bool], deque] = field(default_factory=dict)  # (bucket, speculative) -> seconds
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> tokens per speculative step
    acceptance_weight: dict[str, float] = field(default_factory=dict)  # request id -> the steps its figure holds
    tokens_since: dict[str, int] = field(default_factory=dict)  # request id -> tokens since its last sample
    mean_acceptance: float | None = None  # over every request's speculative steps
    best_acceptance: float = 1.0  # the highest any request has shown (forgotten ones included)
    past_acceptance: dict[str, float] = field(default_factory=dict)  # the last 64 forgotten requests' A, oldest first
    past_spread: tuple[float, float] | None = None  # their (mean, standard deviation), once there are 8
    steps_in_mode: int = 0
    last_mode: bool | None = None
    probe_spacing: dict[int, int] = field(default_factory=dict)  # batch bucket -> plain steps between probes
    probing: list[str] | None = None  # the requests a probe in flight measures (a speculative step against preference)
    measuring: dict[str, int] = field(default_factory=dict)  # request -> step of its probe, acceptance not in yet
    steps: int = 0  # decode steps observed
    measuring_steps: int = 16  # how long a probe's acceptance may take to come in (a scored probe: its drafts)
    probe_rows: int = 4  # the most requests one probe measures (the engine drafts these rows only in a scored one)
    last_probed: dict[str, int] = field(default_factory=dict)  # request -> the step of its last probe
    probe_budget: float | None = 0.05  # the most of the plain decoding time probes may cost (None: no limit)
    max_budget_spacing: int = 1024  # the longest the budget stretches the plain steps between probes
    probe_costs: dict[int, deque] = field(default_factory=dict)  # bucket -> seconds a probe took over a plain step
    overhead_samples: deque = field(default_factory=lambda: deque(maxlen=63))  # seconds a step costs outside decode
    # request -> (a scored probe's drafts, the tokens committed since): scored once they cover the drafts
    shadow_drafts: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    widths: DraftWidths = field(default_factory=DraftWidths)  # the full block's drafts or about half (set_block)

    def set_block(self, block_size: int) -> None:
        """The engine's block size: a speculative step drafts block_size - 1 tokens a row, or the narrower count
        (draft_widths.py) where that commits tokens faster."""
        self.widths.set_full(max(0, block_size - 1))

    def plan(self, rows: list[RowNeed]) -> StepPlan:
        """The step's plan, decided once: the policy chooses for the rows that leave it the choice (not pinned,
        not refusing drafts); a pinned row drafts whatever it says. A probe of greedy requests drafts only the
        rows it measures (`probe_rows`), and is scored, not verified."""
        pinned = [row.asks_drafts or (row.seeded_sampled and self.pin_seeded) for row in rows]
        free = any(not pin and not row.refuses_drafts for row, pin in zip(rows, pinned))
        speculate = self.speculate([row.request_id for row in rows]) if free else any(pinned)
        drafting = [speculate or pin for pin in pinned]
        scored = free and speculate and self.probing is not None and all(
            row.greedy for row, pin in zip(rows, pinned) if not pin)
        if scored:
            measured = set(self.probing)
            drafting = [pin or row.request_id in measured for row, pin in zip(rows, pinned)]
        drafts = None
        if free and speculate and not scored:
            bucket = batch_bucket(len(rows))
            full = self._median_seconds(bucket, True)
            drafts = self.widths.choose(full, self.widths.equivalent_seconds(
                bucket, self._expected_acceptance([row.request_id for row in rows]), self.step_overhead()))
        return StepPlan(speculate=speculate, pinned=pinned, drafting=drafting, scored=scored,
                        policy_plain=free and not speculate, drafts=drafts)

    def record(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """What the step did, taken once: its time and commits (`observe`), finished requests forgotten, and the
        probe drafts now covered by committed tokens scored as the acceptance a verify would have given."""
        ids = outcome.request_ids
        self.observe(ids, plan.speculate, outcome.timed, outcome.seconds, outcome.committed,
                     [count > 0 for count in outcome.counts], drafts=plan.drafts, counts=outcome.counts)
        for request_id, drafts in outcome.probe_drafts.items():
            self.shadow_drafts[request_id] = (drafts, [])
        for request_id, tokens, finished in zip(ids, outcome.new_tokens, outcome.finished):
            if finished:
                self.forget(request_id)  # again: the step's own measurement re-added it
            elif request_id in self.shadow_drafts:
                drafted, seen = self.shadow_drafts[request_id]
                seen.extend(tokens)
                if len(seen) >= len(drafted):
                    del self.shadow_drafts[request_id]
                    accepted = next((i for i, (d, t) in enumerate(zip(drafted, seen)) if d != t), len(drafted))
                    if len(drafted) >= self.widths.full:
                        self.widths.record_full(accepted)
                    self.record_acceptance(request_id, accepted + 1)

    def speculate(self, request_ids: list[str], asked: bool = False, seeded_sampling: bool = False) -> bool:
        """Whether the next decode step of these running requests drafts: always when one asked for drafts, or
        is a seeded sampled request and pin_seeded is set (see the module docstring)."""
        if asked or (seeded_sampling and self.pin_seeded):
            return True
        preferred = self._preferred(request_ids)
        measured = preferred is not None
        if not measured:  # measure speculation first, then plain decoding (probing as below meanwhile)
            preferred = self.step_seconds(len(request_ids), True) is None
        bucket = batch_bucket(len(request_ids))
        if not measured or self._unmeasured_could_pay(request_ids):
            self.probe_spacing[bucket] = self.probe_every  # someone to measure: probe at the first spacing
        if preferred:
            limit = self.refresh_every
        else:
            limit = max(self.probe_spacing.get(bucket, self.probe_every), self.budget_spacing(len(request_ids)))
        if self.last_mode == preferred and self.steps_in_mode >= limit:
            self.probing = None if preferred else self._probe_subset(request_ids)
            self.measuring.update((r, self.steps) for r in self.probing or ())
            self.last_probed.update((r, self.steps) for r in self.probing or ())
            return not preferred  # one step of the other mode, to keep it measured
        return preferred

    def observe_overhead(self, seconds: float) -> None:
        """What a decode step cost its worker outside the engine's decode time (draft, transfer, verify): the
        server loop around the step (events, metrics, messages) and the engine's own bookkeeping. Either mode
        pays it once a step, so it counts for plain decoding, which takes more steps for the same tokens."""
        self.overhead_samples.append(max(0.0, seconds))

    def step_overhead(self) -> float:
        """The median per-step overhead (0 before any was observed)."""
        return statistics.median(self.overhead_samples) if self.overhead_samples else 0.0

    def budget_spacing(self, batch_size: int) -> int:
        """The fewest plain steps between probes at this batch size that keep what probes cost within
        probe_budget of the plain decoding time (0 before a probe and a plain step were measured there)."""
        costs = self.probe_costs.get(batch_bucket(batch_size))
        plain = self.step_seconds(batch_size, False)
        if self.probe_budget is None or not costs or not plain:
            return 0
        plain_step = plain + self.step_overhead()
        return min(math.ceil(statistics.median(costs) / (self.probe_budget * plain_step)), self.max_budget_spacing)

    def step_seconds(self, batch_size: int, speculative: bool) -> float | None:
        """The median step time of a mode at this batch size, None before it was measured. Speculative: that of
        the full block, or where the narrower draft count commits tokens faster, the full-block time that would
        commit them as fast (DraftWidths.equivalent_seconds, at the requests' mean acceptance)."""
        bucket = batch_bucket(batch_size)
        full = self._median_seconds(bucket, speculative)
        if not speculative:
            return full
        if full is not None and self.widths.narrow and self.widths.known() and \
                self.widths.narrow_seconds(bucket) is None:
            return None  # speculation is not measured until its narrow width is: a full block losing is not enough
        acceptance = self._measured_mean() or self.mean_acceptance or 1.0
        equivalent = self.widths.equivalent_seconds(bucket, acceptance, self.step_overhead())
        return full if equivalent is None or full is None else min(full, equivalent)

    def _median_seconds(self, bucket: int, speculative: bool) -> float | None:
        """The median of a mode's measured step times at a bucket (speculative: full-block steps only)."""
        samples = self.step_samples.get((bucket, speculative))
        return statistics.median(samples) if samples else None

    def _preferred(self, request_ids: list[str]) -> bool | None:
        times = self._decision_times(request_ids)
        return None if times is None else self._pays(self._expected_acceptance(request_ids), *times)

    def _expected_acceptance(self, request_ids: list[str]) -> float:
        """The batch's mean acceptance length. A request not measured yet counts at the mean over the requests
        measured so far, each counted once: the running ones and the last 64 that finished. Not the mean over
        steps (mean_acceptance, the fallback before any request is measured): a request that speculates every
        step, one with a high acceptance, weighs in every step, and after a concurrency-1 phase 16 new demo
        streams started speculating, at 5 plain steps a step. Nor over the running ones alone: while requests
        come and go, those measured are a few probed ones (5 of 16 at 16 demo streams, one of them at 8 tokens
        a step), and 11 new requests taken at their mean of 4.8 made whole batches speculate at 14 ms a step
        against 2 ms plain."""
        measured = self._measured_mean()
        default = measured if measured is not None else (self.mean_acceptance or 1.0)
        return sum(self._figure(r, default, measured) for r in request_ids) / len(request_ids)

    def _figure(self, request_id: str, default: float, prior: float | None) -> float:
        """What a request is expected to commit a speculative step: its samples' mean (default when it has
        none), drawn toward the requests' mean (prior) as prior_floor steps' weight against what its samples
        still weigh after the tokens committed since the last one. So what is known of a request fades while it
        decodes plainly, and a low figure from a stretch of hard text does not keep it plain for the rest of
        the request: once its samples weigh little the mean tips it back to speculating, and the next
        speculative step measures it again. (A figure set directly, without sample weights, is taken as is.)"""
        figure, weight = self.acceptance.get(request_id), self.acceptance_weight.get(request_id)
        if figure is None:
            return default
        if weight is None or prior is None or not self.prior_floor:
            return figure
        kept = weight * self.keep_acceptance ** self.tokens_since.get(request_id, 0)
        return (kept * figure + self.prior_floor * prior) / (kept + self.prior_floor)

    def _measured_mean(self) -> float | None:
        """The mean acceptance over the requests measured so far, each once: running and the last 64 finished."""
        measured = [*self.acceptance.values(), *self.past_acceptance.values()]
        return statistics.fmean(measured) if measured else None

    def _decision_times(self, request_ids: list[str]) -> tuple[float, float] | None:
        """(speculative, plain) step seconds to choose by for this batch: its batch size's own once both modes
        are measured there. Before that, those of the largest smaller batch size measured in both modes, where
        speculation loses there for this batch: a speculative step's cost over a plain one's does not shrink as
        the batch grows (its verify multiplies the rows), so plain decoding is inferred and the larger batch is
        not made to speculate just to be measured. Those speculative steps cost 20-40 ms against 4.6 ms plain
        at 48 demo streams, and while requests kept arriving none measured the mode (each caught up on a new
        request's prompt), so a wave of 48 streams speculated its first 25 steps: the default served 0.81x plain
        decoding there. None: no times to choose by (speculation is measured first)."""
        spec, plain = self.step_seconds(len(request_ids), True), self.step_seconds(len(request_ids), False)
        if spec is not None and plain is not None:
            return spec, plain
        bucket = batch_bucket(len(request_ids))
        smaller = [b for b, speculative in self.step_samples if speculative and b < bucket and (b, False) in
                   self.step_samples]
        if not smaller:
            return None
        spec, plain = (statistics.median(self.step_samples[(max(smaller), mode)]) for mode in (True, False))
        return None if self._pays(self._expected_acceptance(request_ids), spec, plain) else (spec, plain)

    def _pays(self, acceptance: float, spec: float, plain: float) -> bool:
        """Whether a speculative step committing `acceptance` tokens a request beats as many plain steps, each
        step paying the per-step overhead besides its decode time."""
        overhead = self.step_overhead()
        return acceptance * (plain + overhead) >= spec + overhead

    def _unmeasured_could_pay(self, request_ids: list[str]) -> bool:
        """Whether the batch has requests whose acceptance was never measured and, were they as good as they
        plausibly are, speculation would pay. At 16 demo streams one new request cannot tip a batch that plain
        decoding wins by far, and re-probing for every arrival (a stream finishes every few steps there) cost
        15-20% of the throughput; alone in its batch a new request can. See `_plausible_acceptance`."""
        unmeasured = [r for r in request_ids if r not in self.acceptance and not self._being_measured(r)]
        if not unmeasured:
            return False
        hope = self._plausible_acceptance(len(unmeasured))
        prior = self._measured_mean()
        optimistic = sum(self._figure(r, hope, prior) for r in request_ids) / len(request_ids)
        return self._pays(optimistic, *self._decision_times(request_ids))

    def _probe_subset(self, request_ids: list[str]) -> list[str]:
        """The requests a probe measures: at most probe_rows, those neither measured nor being measured first,
        then those probed longest ago (in batch order among equals). A scored probe's cost is mostly the drafter taking in each drafted request's context since
        its last draft call (at 16 demo streams and 64 plain steps between probes, 1024 rows: about 20 ms, four
        plain steps); the batch's choice needs its mean acceptance, which a few requests a probe estimate, in
        turn, as well as all of them."""
        def staleness(request_id: str) -> tuple[bool, int]:
            known = request_id in self.acceptance or self._being_measured(request_id)
            return known, self.last_probed.get(request_id, -1)
        return sorted(request_ids, key=staleness)[: self.probe_rows]

    def _being_measured(self, request_id: str) -> bool:
        """Probed in the last measuring_steps steps: a scored probe's acceptance comes in steps later."""
        probed = self.measuring.get(request_id)
        return probed is not None and self.steps - probed <= self.measuring_steps

    def _plausible_acceptance(self, unmeasured: int) -> float:
        """The most that `unmeasured` new requests plausibly commit a step on average: the mean acceptance of the
        last requests that finished plus two standard errors of a mean of that many (an upper confidence bound),
        at most the best seen; the best seen until 8 requests have finished. A single new request may be as
        good as mean + 2 sd; sixteen at once average near the mean, so a wave of 16 new demo streams (mean 3.5
        tokens, sd about 1) no longer reads as if each were the best stream seen (6-7 tokens) and resets the
        probes every wave: the default lost 18% to plain decoding at 16 streams that way."""
        if self.past_spread is None:
            return self.best_acceptance
        mean, sd = self.past_spread
        return min(self.best_acceptance, mean + 2 * sd / unmeasured ** 0.5)

    def observe(self, request_ids: list[str], chosen: bool, timed: bool | None, seconds: float,
                committed: list[int], drafted: list[bool], drafts: int | None = None,
                counts: list[int] | None = None) -> None:
        """One decode step: the rows' requests; the mode this policy chose (the probe schedule follows it, even
        when a drafter fallback made the step plain); which mode the step's time measures (None: neither, for
        mixed rows, prefill in the step, a fallback or resync, or a draft call catching up on context); its
        decode seconds; the tokens each row committed and whether the row drafted (every drafted row measures
        its request's acceptance length, pure step or not). drafts: the cap the plan put on the free rows' drafts
        (None: the full block); counts: the drafts each row verified. A narrow step's time measures the narrow
        width, and its rows' tokens count as a full-width step would likely have committed them; a full-width row
        adds to the survival counts the widths are compared by."""
        self.steps += 1
        self.steps_in_mode = self.steps_in_mode + 1 if self.last_mode == chosen else 1
        self.last_mode = chosen
        counts = counts or [None] * len(request_ids)
        narrow = drafts is not None and all(c is None or c <= drafts for c in counts)
        if timed is not None and seconds > 0 and request_ids:
            if timed and narrow:
                self.widths.record_narrow_seconds(batch_bucket(len(request_ids)), seconds)
            else:
                key = (batch_bucket(len(request_ids)), timed)
                self.step_samples.setdefault(key, deque(maxlen=self.window)).append(seconds)
        for request_id, tokens, drew, count in zip(request_ids, committed, drafted, counts):
            self.tokens_since[request_id] = self.tokens_since.get(request_id, 0) + tokens
            if not drew:
                continue
            if count is not None and count >= self.widths.full:
                self.widths.record_full(tokens - 1)
            if count is not None and drafts is not None and count == drafts:
                self.record_acceptance(request_id, self.widths.uncensored(tokens, count))
            else:
                self.record_acceptance(request_id, tokens)
        if self.probing is not None and chosen and request_ids:  # the probe's verdict sets the next spacing
            bucket = batch_bucket(len(request_ids))
            plain = self.step_seconds(len(request_ids), False)
            if plain is not None and seconds > 0:  # what it cost over the plain step it took the place of
                self.probe_costs.setdefault(bucket, deque(maxlen=self.window)).append(max(0.0, seconds - plain))
            spacing = self.probe_spacing.get(bucket, self.probe_every)
            still_plain = self._preferred(request_ids) is False
            self.probe_spacing[bucket] = min(2 * spacing, self.max_probe_every) if still_plain else self.probe_every
        self.probing = None

    def record_acceptance(self, request_id: str, tokens: int) -> None:
        """One speculative step's tokens for a request, verified or scored later (a greedy probe's drafts against
        the tokens plain steps committed: the engine's shadow drafts).

        A request's figure is the mean of its samples, each step's weighing keep_acceptance per token of text
        committed since (the text's predictability drifts: code turns repetitive), started at prior_steps
        samples of the mean over the requests measured so far. So a probe after many plain steps outweighs
        the old samples, and a request's first steps, which commit least (1, 1, 2 tokens while later ones commit
        8 on the demo pair), do not set its figure alone: taken as the figure from the first sample, they made 12
        of 48 held-out requests decode plainly after at most 6 steps for the rest of the request, though 9 of
        them committed 2.5-4.2 tokens a step speculating every step, where speculation paid from 2.4."""
        self.measuring.pop(request_id, None)
        covered = max(self.tokens_since.pop(request_id, 0), tokens)
        old, weight = self.acceptance.get(request_id), self.acceptance_weight.get(request_id, 0.0)
        if old is None:
            prior = self._measured_mean()
            old, weight = (prior, self.prior_steps) if prior is not None else (0.0, 0.0)
        kept = weight * self.keep_acceptance ** covered
        self.acceptance_weight[request_id] = kept + 1.0
        self.acceptance[request_id] = (kept * old + tokens) / (kept + 1.0)
        self.best_acceptance = max(self.best_acceptance, self.acceptance[request_id])
        self.mean_acceptance = _decayed(self.mean_acceptance, tokens, 0.95)

    def forget(self, request_id: str) -> None:
        self.shadow_drafts.pop(request_id, None)
        self.measuring.pop(request_id, None)
        self.last_probed.pop(request_id, None)
        self.tokens_since.pop(request_id, None)
        self.acceptance_weight.pop(request_id, None)
        accepted = self.acceptance.pop(request_id, None)
        if accepted is not None:  # (a request forgotten twice, once again after its last step: kept once)
            self.past_acceptance.pop(request_id, None)
            self.past_acceptance[request_id] = accepted
            if len(self.past_acceptance) > 64:
                del self.past_acceptance[next(iter(self.past_acceptance))]
            past = list(self.past_acceptance.values())
            self.past_spread = (statistics.fmean(past), statistics.pstdev(past)) if len(past) >= 8 else None

    def preferred_mode(self, request_ids: list[str]) -> str | None:
        """"speculative" or "plain" once both modes were measured for this batch size (for logs and tests)."""
        preferred = self._preferred(request_ids)
        return None if preferred is None else ("speculative" if preferred else "plain")
