"""Admission control: a bounded queue in front of the engine. A slot is taken before any tokenization or template
work, so that a flood is refused at the door (429) instead of piling up; a request leaves the queue at its first
output.

With several API-server processes (--api-server-count) the counts live in shared memory (QueueCounts), so the limits
hold for the server as a whole: which process a connection reaches is the kernel's choice, and a per-process share
would refuse one client while another process had room."""

from __future__ import annotations

import contextlib

from llmserve.metrics import Metrics
from llmserve.server.errors import APIError


class QueueCounts:
    """The queue's counts: requests, and the prompt tokens they hold. In one server process, plain numbers that only
    its event loop changes (no lock). With a multiprocessing context: in shared memory under one lock, made by the
    supervisor of several server processes and handed to each at its start."""

    REQUESTS, TOKENS = 0, 1

    def __init__(self, shared_through=None):
        if shared_through is None:
            self._values, self._lock = [0, 0], contextlib.nullcontext()
        else:
            self._values = shared_through.Array("q", 2)
            self._lock = self._values.get_lock()

    def take(self, kind: int, n: int, limit: int) -> bool:
        """Adds n to that count if it stays within the limit; whether it did."""
        with self._lock:
            if self._values[kind] + n > limit:
                return False
            self._values[kind] += n
            return True

    def give_back(self, tokens: int) -> None:
        """A request left the queue with the tokens it held."""
        with self._lock:
            self._values[self.REQUESTS] -= 1
            self._values[self.TOKENS] -= tokens


class Admission:
    def __init__(self, max_requests: int, max_tokens: int, metrics: Metrics, counts: QueueCounts | None = None):
        self.max_requests, self.max_tokens, self.metrics = max_requests, max_tokens, metrics
        self.counts = counts or QueueCounts()

    def reserve(self) -> Slot:
        if not self.counts.take(QueueCounts.REQUESTS, 1, self.max_requests):
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
        if not a.counts.take(QueueCounts.TOKENS, n, a.max_tokens):
            a.metrics.rejected.labels(a.metrics.model_name, "token_limit").inc()
            self.release()
            raise APIError(429, f"the server is at its limit of {a.max_tokens} queued prompt tokens; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.tokens += n

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.counts.give_back(self.tokens)
