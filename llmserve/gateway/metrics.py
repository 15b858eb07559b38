"""The gateway's Prometheus metrics, per backend: requests and their outcome, failures by reason, fallbacks taken,
latency, cooldowns and whether each backend is in use; cost per backend and per API key; cache hits."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "llmserve_gateway:"
        self.requests = Counter(p + "requests", "Requests a backend answered, by outcome (ok or error).",
                                ["model", "backend", "outcome"], registry=r)
        self.failures = Counter(p + "backend_failures", "Backend attempts that failed, by reason.", ["backend", "reason"], registry=r)
        self.fallbacks = Counter(p + "fallbacks", "Times a request went on to another backend, by the reason.",
                                 ["model", "from_backend", "reason"], registry=r)
        self.first_token = Histogram(p + "first_token_seconds", "Time to the first token (streams) or the whole answer.",
                                     ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram(p + "request_seconds", "Time a backend took for a whole request.", ["backend"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.cooldowns = Counter(p + "cooldowns", "Times a backend was taken out of use (429 or tripped breaker).",
                                 ["backend", "reason"], registry=r)
        self.up = Gauge(p + "backend_up", "1 when the backend is in use, 0 while it cools down.", ["backend"], registry=r)
        self.outstanding = Gauge(p + "backend_outstanding", "Requests in flight at the backend.", ["backend"], registry=r)
        self.cost = Counter(p + "cost_usd", "Cost of answered requests in USD.", ["backend", "api_key"], registry=r)
        self.cache = Counter(p + "cache", "Response cache look-ups, by result.", ["result"], registry=r)
        self.client_errors = Counter(p + "rejected", "Requests the gateway refused itself, by status.", ["status"], registry=r)
