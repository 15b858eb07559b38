"""Which backend a request tries first, and which next: per-backend health (cooldowns and a circuit breaker) and the
three ways of choosing inside a group (round-robin, least outstanding requests, prefix affinity)."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field

from llmserve.gateway.config import BackendConfig, GatewayConfig

VIRTUAL_NODES = 64  # ring points per backend: enough to spread keys evenly over a handful of replicas


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


@dataclass
class BackendState:
    """One backend's health. A 429 cools it down for its Retry-After; `failures_to_trip` failures in a row (connection
    errors, 5xx, timeouts) trip it for `cooldown` seconds, after which the prober must see it answer before it is
    used again."""

    name: str
    config: BackendConfig
    outstanding: int = 0
    failures: int = 0
    tripped: bool = False
    cooldown_until: float = 0.0
    probing: bool = field(default=False, repr=False)

    def available(self, now: float | None = None) -> bool:
        return not self.tripped and (now if now is not None else time.monotonic()) >= self.cooldown_until

    def cool_down(self, seconds: float) -> None:
        self.cooldown_until = max(self.cooldown_until, time.monotonic() + seconds)

    def record_failure(self, failures_to_trip: int, cooldown: float) -> bool:
        """Counts a failure; returns whether this one tripped the breaker."""
        self.failures += 1
        if not self.tripped and self.failures >= failures_to_trip:
            self.tripped = True
            self.cool_down(cooldown)
            return True
        return False

    def record_success(self) -> None:
        self.failures = 0
        self.tripped = False


def prompt_affinity_key(body: dict, chars: int) -> str:
    """The start of the prompt as text: what a backend's prefix cache would match on. System prompts and earlier agent
    turns come first, so requests that share them share this key."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}:{content or ''}\n")
            if sum(len(p) for p in parts) >= chars:
                break
        text = "".join(parts)
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else str(prompt)
    return text[:chars]


class Router:
    def __init__(self, config: GatewayConfig, states: dict[str, BackendState]):
        self.config, self.states = config, states
        self._counters: dict[tuple[str, ...], itertools.count] = {}
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def order(self, route: str, group: tuple[str, ...], affinity_key: str) -> list[str]:
        """The group's available backends in the order to try them."""
        now = time.monotonic()
        live = [b for b in group if self.states[b].available(now)]
        if len(live) <= 1:
            return live
        if route == "round-robin":
            start = next(self._counters.setdefault(group, itertools.count())) % len(live)
            return live[start:] + live[:start]
        if route == "least-outstanding":
            start = next(self._counters.setdefault(group, itertools.count())) % len(live)
            rotated = live[start:] + live[:start]  # ties go round
            return sorted(rotated, key=lambda b: self.states[b].outstanding)
        return self._affinity_order(group, live, affinity_key)

    def _ring(self, group: tuple[str, ...]) -> tuple[list[int], list[str]]:
        if group not in self._rings:
            points = sorted((_hash(f"{b}#{i}"), b) for b in group for i in range(VIRTUAL_NODES))
            self._rings[group] = ([p for p, _ in points], [b for _, b in points])
        return self._rings[group]

    def _affinity_order(self, group: tuple[str, ...], live: list[str], key: str) -> list[str]:
        """Consistent hashing with bounded loads: walk the ring from the key's point; the first backend with fewer than
        ceil(c x mean) outstanding requests takes it, so a hot prefix spills over instead of piling up on one replica.
        A backend leaving or joining moves only its own share of keys."""
        points, owners = self._ring(group)
        start = bisect.bisect(points, _hash(key))
        walk: list[str] = []
        for i in range(len(owners)):
            b = owners[(start + i) % len(owners)]
            if b in live and b not in walk:
                walk.append(b)
                if len(walk) == len(live):
                    break
        total = sum(self.states[b].outstanding for b in live)
        capacity = math.ceil(self.config.affinity_load_factor * (total + 1) / len(live))
        under = [b for b in walk if self.states[b].outstanding < capacity]
        return under + [b for b in walk if b not in under]
