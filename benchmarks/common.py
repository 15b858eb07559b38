"""What the benchmark scripts share: a call's median time, and writing a result file."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median wall time of `repeats` calls of fn, after `warmup` untimed ones (caches, lazy builds, allocator)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_json(path: str | None, data: Any, indent: int = 1) -> None:
    """Writes data to path as JSON, creating its folder; nothing when no path was asked for."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
