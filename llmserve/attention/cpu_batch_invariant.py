"""The deterministic mode's attention on CPU: every query row, whatever kind of row it is, computed the same way.

In the default backends a position's output depends on how it is computed: a whole prompt goes through SDPA's
causal kernel, a chunk or a prefix-cache hit through a masked SDPA over gathered blocks, a decode row through the
native decode kernel, and that kernel splits a sequence's keys into as many ranges as there are idle threads. Each
sums in its own order, so the same token's logits differ in the last bits between a lone request, a batch, a
chunked prompt, a cache hit and a speculative verification.

Here every query row of the step (prompt, chunk, decode or verification row) is one query of the native decode
kernel, over its own sequence's blocks up to its own position, with a fixed split size (SPLIT_KEYS keys a range,
however many rows the call has). The layer writes the step's K/V into the cache before attending, so every row reads
the same cached keys (with an FP8 cache, rounded the same way). A row's result is then a function of its query and
its keys only.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.attention.backend import (AttentionBackend, AttentionGroup, AttentionMetadata, SeqSpan,
                                        block_table_array)

SPLIT_KEYS = 256  # keys per range: ranges of one sequence run on different threads, merged in a fixed order


class RowwisePagedGroup(AttentionGroup):
    """The step's query rows, each attending over its own sequence's blocks up to its own position."""

    def __init__(self, tables: np.ndarray, lengths: np.ndarray, rows: np.ndarray, covers_batch: bool,
                 backend: AttentionBackend):
        self.kv_blocks = backend.tensor(tables)
        self.lengths = backend.tensor(lengths)
        self.rows = backend.tensor(rows)
        self.dst = self.rows
        self.covers_batch = covers_batch

    def attend(self, layer, q, k, v):
        rows = q if self.covers_batch else q[self.rows]
        return torch.ops.llmserve_kernels.paged_decode_attention(rows, layer.k_cache, layer.v_cache, self.kv_blocks,
                                                                 self.lengths, layer.block_size, layer.scale, 1.0, 1.0,
                                                                 SPLIT_KEYS, layer.sliding_window,
                                                                 layer.logits_soft_cap)


class BatchInvariantBackend(AttentionBackend):
    name = "batch-invariant"

    def build_metadata(self, spans: list[SeqSpan], positions: np.ndarray, slot_mapping: torch.Tensor,
                       min_blocks: int = 1) -> AttentionMetadata:
        num_rows = sum(s.num_queries for s in spans)
        if num_rows == len(spans):  # one query per sequence (decode steps): a row is its span
            lengths = np.fromiter((s.num_keys for s in spans), np.int64, num_rows)
            rows = np.fromiter((s.offset for s in spans), np.int64, num_rows)
            tables = block_table_array([s.block_table for s in spans], -(-lengths // self.block_size), min_blocks)
            covers_batch = num_rows == len(positions) and bool((rows == np.arange(num_rows)).all())
            return AttentionMetadata(slot_mapping=slot_mapping,
                                     groups=[RowwisePagedGroup(tables, lengths, rows, covers_batch, self)])
        width = max(min_blocks, max(-(-s.num_keys // self.block_size) for s in spans))
        tables = np.zeros((num_rows, width), dtype=np.int64)
        lengths = np.empty(num_rows, dtype=np.int64)
        rows = np.empty(num_rows, dtype=np.int64)
        at = 0
        for offset, n, num_keys, table in spans:
            used = -(-num_keys // self.block_size)
            tables[at:at + n, :used] = np.asarray(table[:used], dtype=np.int64)
            lengths[at:at + n] = np.arange(num_keys - n + 1, num_keys + 1)  # each query sees the keys up to itself
            rows[at:at + n] = np.arange(offset, offset + n)
            at += n
        covers_batch = num_rows == len(positions) and bool((rows == np.arange(num_rows)).all())
        return AttentionMetadata(slot_mapping=slot_mapping,
                                 groups=[RowwisePagedGroup(tables, lengths, rows, covers_batch, self)])
