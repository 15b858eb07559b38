"""The gateway's response cache (opt-in): an exact match on the normalized request, only for requests whose answer
is fixed (temperature 0, or a seed), per tenant, with a time to live and a bound on entries (least recently used
goes first)."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections import OrderedDict

from llmserve.gateway.config import CacheConfig

# Fields that change how an answer is delivered or accounted, not what it is.
_IGNORED = ("stream", "stream_options", "user", "service_tier", "metadata", "store")


def cacheable(body: dict) -> bool:
    """Only answers that the same request reproduces: greedy, or sampled with a seed, and one choice."""
    if body.get("stream") or (body.get("n") or 1) != 1:
        return False
    return body.get("temperature") == 0 or body.get("seed") is not None


def cache_key(tenant: str, model: str, kind: str, body: dict) -> str:
    normalized = {k: v for k, v in body.items() if k not in _IGNORED}
    text = json.dumps([tenant, model, kind, normalized], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class ResponseCache:
    def __init__(self, config: CacheConfig):
        self.config = config
        self._entries: OrderedDict[str, tuple[float, dict]] = OrderedDict()

    def get(self, key: str) -> dict | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_at, response = entry
        if time.monotonic() - stored_at > self.config.ttl:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return copy.deepcopy(response)

    def put(self, key: str, response: dict) -> None:
        self._entries[key] = (time.monotonic(), copy.deepcopy(response))
        self._entries.move_to_end(key)
        while len(self._entries) > self.config.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
