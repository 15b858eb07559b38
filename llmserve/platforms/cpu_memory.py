"""Allocator settings that suit an inference loop on CPU (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit: larger blocks are fresh mmaps whatever the setting


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Each step allocates and frees the same multi-MB tensors (logits, activations). glibc serves
    those with fresh mmaps by default, so every step page-faults them in again; raising the mmap and
    trim thresholds lets the heap reuse them. Measured in docs/benchmarks.md (sampler overhead)."""
    global _done
    if _done:
        return
    _done = True
    libc = _libc()
    try:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except AttributeError:  # not glibc (macOS, musl): nothing to tune
        logger.debug("mallopt unavailable; keeping the allocator's defaults")


def release_freed_memory() -> None:
    """With the thresholds above, memory freed after loading (the float32 weights, the bf16 ones that low-bit
    blocks replace) would stay resident for good; hand it back to the OS once, when loading is done."""
    try:
        _libc().malloc_trim(0)
    except AttributeError:  # not glibc
        pass
