"""The verify worker's Prometheus metrics: speculation counts by block position, step phases, queue gauges, the
drafter's availability, the prefix cache's queries, hits and holdings, the KV pool's pages and preemptions, rejected
messages."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared import metric_names as names
from verify_worker.request import StepReport

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class VerifyMetrics:
    def __init__(self, drafter_kind: str):
        r = self.registry = CollectorRegistry()
        self.drafts = Counter(names.SPEC_DRAFTS, "Request verify steps that carried drafts", registry=r)
        self.draft_tokens = Counter(names.SPEC_DRAFT_TOKENS, "Drafted tokens verified", registry=r)
        self.accepted = Counter(names.SPEC_ACCEPTED_TOKENS, "Drafted tokens accepted", registry=r)
        self.accepted_at = Counter(names.SPEC_ACCEPTED_PER_POSITION, "Accepted drafts by block position",
                                   ["position"], registry=r)
        self.drafted_at = Counter(names.SPEC_DRAFTED_PER_POSITION, "Drafts by block position", ["position"],
                                  registry=r)
        self.step = Histogram(names.STEP_SECONDS, "Time per engine step by phase", ["phase"], registry=r,
                              buckets=STEP_BUCKETS)
        self.running = Gauge(names.RUNNING, "Requests holding a cache slot", registry=r)
        self.waiting = Gauge(names.WAITING, "Requests queued for a cache slot", registry=r)
        self.drafter = Gauge(names.DRAFTER_AVAILABLE, "1 when the drafter answers", ["kind"], registry=r)
        self.fallback = Counter(names.FALLBACK_STEPS, "Steps decoded without drafts for want of a drafter",
                                registry=r)
        self.policy_plain = Counter(names.POLICY_PLAIN_STEPS, "Steps the speculation policy decoded plainly",
                                    registry=r)
        self.prefix_queries = Counter(names.PREFIX_QUERY_TOKENS, "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(names.PREFIX_HIT_TOKENS, "Prompt tokens found in the prefix cache (not prefilled)",
                                   registry=r)
        self.prefix_cached = Gauge(names.PREFIX_CACHED_TOKENS, "Tokens kept for reuse (free slots', indexed pages')",
                                   registry=r)
        self.prefix_seen = (0, 0)  # the engine's totals last counted
        self.kv_pages = Gauge(names.KV_PAGES, "Pages of the paged KV cache's pool (0: a slot a request)", registry=r)
        self.kv_pages_used = Gauge(names.KV_PAGES_USED, "KV cache pages running requests hold", registry=r)
        self.preemptions = Counter(names.PREEMPTIONS, "Requests taken out of the batch for want of KV pages "
                                                      "(they wait, then prefill again)", registry=r)
        self.preemptions_seen = 0
        self.bad = Counter(names.BAD_MESSAGES, "Rejected wire messages", ["role"], registry=r)
        self.bad.labels("verify")  # exported at 0 from the start: a dashboard shows 0, not "no data"
        self.kind = drafter_kind
        self.children: dict[tuple, object] = {}  # (metric, label) -> its labelled child, looked up once

    def _child(self, metric, label: str):
        child = self.children.get((metric, label))
        if child is None:
            child = self.children[(metric, label)] = metric.labels(label)
        return child

    def record_prefixes(self, queried: int, hit: int, cached: int) -> None:
        """The engine's prefix-cache totals since start (counted by their growth) and what it holds now."""
        seen_queried, seen_hit = self.prefix_seen
        self.prefix_queries.inc(queried - seen_queried)
        self.prefix_hits.inc(hit - seen_hit)
        self.prefix_seen = (queried, hit)
        self.prefix_cached.set(cached)

    def record_pool(self, pages: int, used: int, preemptions: int) -> None:
        """A paged KV cache's pool and the pages in use now; the engine's preemptions since start."""
        self.kv_pages.set(pages)
        self.kv_pages_used.set(used)
        self.preemptions.inc(preemptions - self.preemptions_seen)
        self.preemptions_seen = preemptions

    def record(self, report: StepReport) -> None:
        """One step's figures (once a step: the labelled children are kept, not looked up again each time)."""
        for phase, seconds in report.seconds.items():
            self._child(self.step, phase).observe(seconds)
        rows_with_drafts = report.drafted_at[0] if report.drafted_at else 0
        self.drafts.inc(rows_with_drafts)
        self.draft_tokens.inc(report.draft_tokens)
        self.accepted.inc(report.accepted_tokens)
        for position, (drafted, accepted) in enumerate(zip(report.drafted_at, report.accepted_at), start=1):
            if drafted:
                self._child(self.drafted_at, str(position)).inc(drafted)
                self._child(self.accepted_at, str(position)).inc(accepted)
        if report.fallback:
            self.fallback.inc()
        if report.policy_plain:
            self.policy_plain.inc()
