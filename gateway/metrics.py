"""The gateway's Prometheus metrics, in a registry of its own."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared import metric_names as names

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(names.REQUESTS, "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Generated tokens", registry=r)
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN, "Time to first token", registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram(names.INTER_TOKEN_LATENCY, "Time between token events, per token", registry=r,
                             buckets=TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(names.E2E_LATENCY, "Request latency, admission to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.verify_up = Gauge(names.VERIFY_WORKER_UP, "1 while the verify worker sends heartbeats", registry=r)
        self.bad = Counter(names.BAD_MESSAGES, "Rejected wire messages", ["role"], registry=r)
        self.bad.labels("gateway")  # exported at 0 from the start: a dashboard shows 0, not "no data"
