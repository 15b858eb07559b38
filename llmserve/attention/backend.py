"""The attention-backend interface.

A step is one flat run of tokens from many sequences. The model runner describes each sequence as a SeqSpan (where
its queries sit in the flat run, how many, how many keys it sees, its block-table row); a backend turns the spans
into AttentionMetadata once per step, shared by every layer. The metadata holds groups, each an object that attends
its own queries (`group.attend(layer, q, k, v)`), so a layer never branches on the backend.

Hooks for compiled graphs: `group.dynamic_dims` names the tensors whose sizes vary between steps (torch.compile marks
them dynamic); a backend whose decode metadata can live at fixed addresses returns DecodeGraphBuffers from
`decode_graph_buffers`, which CUDA graphs capture once and refill every step (graphs/cuda_graphs.py).
Adding a backend is one file with a subclass and a line in the platform that picks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch


class SeqSpan(NamedTuple):
    offset: int  # index of the sequence's first query in the step's flat tokens
    num_queries: int
    num_keys: int  # keys the last query sees (its position + 1)
    block_table: np.ndarray | list[int]


@dataclass
class GroupLayout:
    """A group of sequences padded to [B, Q] queries and [B, N] key blocks (numpy, before any backend's tensors)."""

    token_index: np.ndarray  # [B, Q] flat token index of each (padded) query
    valid: np.ndarray  # [B, Q] real queries
    tables: np.ndarray  # [B, N] key blocks (padding points at block 0)
    ends: np.ndarray  # [B] keys per sequence
    covers_batch: bool  # the padded queries are exactly the step's tokens in order (no gather/scatter)
    fresh: bool  # every sequence starts at position 0: its keys are this step's own, causal, nothing to gather


def block_table_array(tables: list, used: np.ndarray, min_blocks: int = 1, dtype=np.int64,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Rows of block tables, each cut to its `used` blocks, as one [len(tables), width] array padded with block 0
    (written into the first rows of `out` where given)."""
    if out is None:
        out = np.zeros((len(tables), max(min_blocks, int(used.max()))), dtype=dtype)
    for i, (n, table) in enumerate(zip(used.tolist(), tables)):
        out[i, :n] = table[:n]
    return out


def pad_group(spans: list[SeqSpan], num_tokens: int, block_size: int, min_blocks: int = 1) -> GroupLayout:
    B = len(spans)
    Q = max(s.num_queries for s in spans)
    L = max(s.num_keys for s in spans)
    token_index = np.zeros((B, Q), dtype=np.int64)
    valid = np.zeros((B, Q), dtype=bool)
    ends = np.empty(B, dtype=np.int64)
    tables = np.zeros((B, max(-(-L // block_size), min_blocks)), dtype=np.int64)
    for i, (offset, n, end, table) in enumerate(spans):
        token_index[i, :n] = np.arange(offset, offset + n)
        valid[i, :n] = True
        ends[i] = end
        row = table[: tables.shape[1]]
        tables[i, : len(row)] = row
    covers_batch = bool(valid.all()) and spans[0].offset == 0 and sum(s.num_queries for s in spans) == num_tokens
    fresh = all(s.num_queries == s.num_keys for s in spans)
    return GroupLayout(token_index, valid, tables, ends, covers_batch, fresh)


class AttentionGroup:
    """Sequences attended together. `dst` holds their queries' flat indices (used when the step has other groups)."""

    covers_batch: bool
    dst: torch.Tensor

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dynamic_dims(self, per_token: bool, per_sequence: bool) -> list[tuple[torch.Tensor, int]]:
        """Capture hook for compiled graphs: the tensors (and dims) that vary with the number of tokens (per_token)
        and of sequences (per_sequence) between steps of the kind being traced."""
        return []


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    groups: list[AttentionGroup]
    # kv_writer(k_cache, v_cache, slot_mapping, k, v): a backend's own way to store the step's K/V (one fused launch);
    # None: layers/attention.py's store_kv for each
    kv_writer: Callable | None = None


class DecodeGraphBuffers:
    """A decode step's attention metadata (one query per sequence) in tensors of fixed size and address, so that a
    captured CUDA graph reads each step's values: `write` puts a step's sequences in the first rows (the rest of the
    bucket's `size` rows are padding that attends harmlessly), `metadata` gives the bucket's views to capture."""

    def write(self, num_keys: np.ndarray, block_tables: list, size: int) -> None:
        raise NotImplementedError

    def metadata(self, size: int, slot_mapping: torch.Tensor) -> "AttentionMetadata":
        raise NotImplementedError


class AttentionBackend:
    """Builds a step's attention metadata. One instance per model runner."""

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device, sliding_windows: tuple[int, ...] = (),
                 logits_soft_cap: float = 0.0):
        """sliding_windows: the model's distinct windows (ModelConfig.sliding_windows()). A layer's own window is
        `layer.sliding_window`, read as it attends; backends that mask build one mask per window here, per step.
        logits_soft_cap: the model's attention soft-capping (Gemma 2), > 0 where its layers cap their scores
        (`layer.logits_soft_cap`); backends whose fast kernels cannot cap prepare another route for such layers."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.kv_dtype, self.device = block_size, dtype, kv_dtype, device
        self.sliding_windows = tuple(sliding_windows)
        self.logits_soft_cap = logits_soft_cap

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's K (or V) tensor: slots in blocks of block_size, then KV heads and head_dim."""
        return (num_blocks * self.block_size, self.num_kv_heads, self.head_dim)

    def build_metadata(self, spans: list[SeqSpan], positions: np.ndarray, slot_mapping: torch.Tensor,
                       min_blocks: int = 1) -> AttentionMetadata:
        """Decode rows (one query each) and prompt rows form separate groups: each pads to its own query length."""
        decode = [s for s in spans if s.num_queries == 1]
        prompt = [s for s in spans if s.num_queries > 1]
        groups = [self.build_group(g, positions, min_blocks) for g in (decode, prompt) if g]
        return AttentionMetadata(slot_mapping=slot_mapping, groups=groups)

    def build_group(self, spans: list[SeqSpan], positions: np.ndarray, min_blocks: int) -> AttentionGroup:
        raise NotImplementedError

    def decode_graph_buffers(self, max_batch: int, max_blocks: int, pin: bool) -> DecodeGraphBuffers | None:
        """Fixed-address decode metadata for up to max_batch sequences of up to max_blocks blocks (host staging in
        page-locked memory where `pin`), or None where this backend's metadata cannot be captured (its shapes
        follow the longest sequence)."""
        return None

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        # not waiting for the device's queue (a synchronizing copy would stall async scheduling's next step)
        return torch.from_numpy(array).to(self.device, non_blocking=True)
