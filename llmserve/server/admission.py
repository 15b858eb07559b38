"""Admission control: a bounded queue in front of the engine. A slot is taken before any tokenization or template
work, so that a flood is refused at the door (429) instead of piling up; a request leaves the queue at its first
output.

With several API-server processes (--api-server-count) the counts live in shared memory (SharedQueueCounts), so the
limits hold for the server as a whole: which process a connection reaches is the kernel's choice, and a per-process
share would refuse one client while another process had room."""

from __future__ import annotations

import contextlib

from llmserve.metrics import Metrics
from llmserve.server.errors import APIError


class QueueCounts:
    """The queue's counts in one server process, whose event loop is their only writer: no lock needed."""

    def __init__(self):
        self.requests = 0
        self.tokens = 0

    def lock(self):
        return contextlib.nullcontext()


class SharedQueueCounts:
    """The queue's counts shared by the server processes; made by the supervisor before it starts them (spawned
    processes receive it as an argument of their start)."""

    def __init__(self, context):
        self._counts = context.Array("q", 2)  # requests, tokens; the array carries its own lock

    def lock(self):
        return self._counts.get_lock()

    @property
    def requests(self) -> int:
        return self._counts[0]

    @requests.setter
    def requests(self, n: int) -> None:
        self._counts[0] = n

    @property
    def tokens(self) -> int:
        return self._counts[1]

    @tokens.setter
    def tokens(self, n: int) -> None:
        self._counts[1] = n


class Admission:
    def __init__(self, max_requests: int, max_tokens: int, metrics: Metrics,
                 counts: QueueCounts | SharedQueueCounts | None = None):
        self.max_requests, self.max_tokens, self.metrics = max_requests, max_tokens, metrics
        self.counts = counts or QueueCounts()

    def reserve(self) -> Slot:
        counts = self.counts
        with counts.lock():
            full = counts.requests >= self.max_requests
            if not full:
                counts.requests += 1
        if full:
            self.metrics.rejected.labels(self.metrics.model_name, "queue_full").inc()
            raise APIError(429, f"the server is at its limit of {self.max_requests} queued requests; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        return Slot(self)


class Slot:
    """One HTTP request's place in the queue, and the prompt tokens it holds there."""

    def __init__(self, admission: Admission):
        self.admission, self.tokens, self.held = admission, 0, True

    def add_tokens(self, n: int) -> None:
        a = self.admission
        counts = a.counts
        with counts.lock():
            over = counts.tokens + n > a.max_tokens
            if not over:
                counts.tokens += n
        if over:
            a.metrics.rejected.labels(a.metrics.model_name, "token_limit").inc()
            self.release()
            raise APIError(429, f"the server is at its limit of {a.max_tokens} queued prompt tokens; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.tokens += n

    def release(self) -> None:
        if self.held:
            self.held = False
            counts = self.admission.counts
            with counts.lock():
                counts.requests -= 1
                counts.tokens -= self.tokens
