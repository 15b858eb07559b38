"""Process-level settings that suit an inference loop on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory() -> None:
    """Each step allocates and frees the same multi-MB tensors (logits, activations). glibc serves
    those with fresh mmaps by default, so every step page-faults them in again; raising the mmap and
    trim thresholds lets the heap reuse them. Measured in docs/benchmarks.md (sampler overhead)."""
    global _done
    if _done:
        return
    _done = True
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum on 64-bit
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        logger.debug("mallopt unavailable; keeping the allocator's defaults")
