"""Admission control: a bounded queue in front of the engine. A slot is taken before any tokenization or template
work, so that a flood is refused at the door (429) instead of piling up; a request leaves the queue at its first
output."""

from __future__ import annotations

from llmserve.metrics import Metrics
from llmserve.server.errors import APIError


class Admission:
    def __init__(self, max_requests: int, max_tokens: int, metrics: Metrics):
        self.max_requests, self.max_tokens, self.metrics = max_requests, max_tokens, metrics
        self.requests = 0
        self.tokens = 0

    def reserve(self) -> Slot:
        if self.requests >= self.max_requests:
            self.metrics.rejected.labels(self.metrics.model_name, "queue_full").inc()
            raise APIError(429, f"the server is at its limit of {self.max_requests} queued requests; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.requests += 1
        return Slot(self)


class Slot:
    """One HTTP request's place in the queue, and the prompt tokens it holds there."""

    def __init__(self, admission: Admission):
        self.admission, self.tokens, self.held = admission, 0, True

    def add_tokens(self, n: int) -> None:
        a = self.admission
        if a.tokens + n > a.max_tokens:
            a.metrics.rejected.labels(a.metrics.model_name, "token_limit").inc()
            self.release()
            raise APIError(429, f"the server is at its limit of {a.max_tokens} queued prompt tokens; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        a.tokens += n
        self.tokens += n

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.requests -= 1
            self.admission.tokens -= self.tokens
