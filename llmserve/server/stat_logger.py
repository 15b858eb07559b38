"""vLLM's periodic stats line in the server's log: every interval with activity, the prompt and generation throughput
since the last line, the requests running and waiting, the KV cache in use and the prefix-cache hit rate.

    llmserve: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 6 reqs,
    Waiting: 0 reqs, KV cache usage: 4.2%, Prefix cache hit rate: 37.5%

It runs in the engine loop's thread (where the engine is), so it counts every request, whichever server process sent
it. `--disable-log-stats` turns it off; LLMSERVE_LOG_STATS_INTERVAL sets the interval (seconds, default 10, as
vLLM's VLLM_LOG_STATS_INTERVAL)."""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("llmserve.stats")

DEFAULT_INTERVAL = 10.0


def log_interval() -> float:
    text = os.environ.get("LLMSERVE_LOG_STATS_INTERVAL")
    try:
        interval = float(text) if text else DEFAULT_INTERVAL
    except ValueError:
        interval = DEFAULT_INTERVAL
    return interval if interval > 0 else DEFAULT_INTERVAL


class StatLogger:
    def __init__(self, interval: float | None = None):
        self.interval = interval or log_interval()
        self._last_time = time.monotonic()
        self._last = (0, 0, 0, 0)  # prompt tokens computed, tokens generated, prefix queries, prefix hits
        self._was_busy = False

    def maybe_log(self, engine) -> None:
        """Between two steps: a line if an interval has passed and the engine worked in it (or in the one before,
        so that the line after a burst shows it ending); an idle engine stays quiet."""
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        stats = engine.stats()
        counts = (engine.num_prompt_tokens_computed, engine.num_generation_tokens, stats.prefix_cache.queries,
                  sum(stats.prefix_cache.hits.values()))
        prompt, generated, queries, hits = (now_ - then for now_, then in zip(counts, self._last))
        busy = bool(prompt or generated or stats.num_running or stats.num_waiting)
        if busy or self._was_busy:
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                        "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        prompt / elapsed, generated / elapsed, stats.num_running, stats.num_waiting,
                        100 * stats.kv_usage, 100 * hits / queries if queries else 0.0)
        self._last_time, self._last, self._was_busy = now, counts, busy
