"""Prompt lookup (n-gram) proposer: find the last n tokens earlier in the sequence and propose what followed.

Strong wherever outputs copy their inputs: code edits, quoting retrieved passages, agent loops that
repeat tool results. The drafts are deterministic guesses (q is one-hot for rejection sampling).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        if k < 1 or len(tokens) < self.n_min + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.n_max, len(arr) - 1), self.n_min - 1, -1):
            pattern = arr[-n:]
            windows = sliding_window_view(arr[:-1], n)  # every earlier n-gram that has a token after it
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def release(self, request_id: str) -> None:
        pass
