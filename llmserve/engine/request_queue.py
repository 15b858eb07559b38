"""Waiting queues: first-come-first-served, or by (priority, arrival) where a lower value runs first."""

from __future__ import annotations

import time
from collections import deque

from llmserve.engine.request import Request


class FCFSQueue:
    def __init__(self):
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        """A preempted request goes back to the front: it was admitted before anything still waiting."""
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        if r in self._q:
            self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Lower (priority, arrival) first. Waiting ages a request: every `aging_seconds` waited counts as
    one priority level, so low-priority work cannot starve. Keys change with time, so the queue is a
    list scanned on peek: it holds waiting requests only, which admission control keeps short."""

    def __init__(self, aging_seconds: float = 30.0):
        self._items: list[Request] = []
        self.aging_seconds = aging_seconds

    def _key(self, r: Request, now: float):
        age = (now - r.arrival_time) / self.aging_seconds if self.aging_seconds > 0 else 0.0
        return (r.priority - age, r.arrival_time)

    def add(self, r: Request) -> None:
        self._items.append(r)

    prepend = add  # its (priority, arrival) already puts a preempted request ahead of equals

    def peek(self) -> Request:
        now = time.monotonic()
        return min(self._items, key=lambda r: self._key(r, now))

    def pop(self) -> Request:
        r = self.peek()
        self._items.remove(r)
        return r

    def remove(self, r: Request) -> None:
        if r in self._items:
            self._items.remove(r)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        now = time.monotonic()
        return iter(sorted(self._items, key=lambda r: self._key(r, now)))


def make_queue(policy: str, aging_seconds: float = 30.0):
    return PriorityQueue(aging_seconds) if policy == "priority" else FCFSQueue()
