"""Waiting queues: first-come-first-served, or by (priority, arrival) where a lower value runs first."""

from __future__ import annotations

import heapq
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
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0

    def add(self, r: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (r.priority, r.arrival_time, self._counter, r))

    prepend = add  # priority order already puts a preempted (older) request ahead of equals

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap))


def make_queue(policy: str):
    return PriorityQueue() if policy == "priority" else FCFSQueue()
