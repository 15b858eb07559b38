"""Paged attention in one Triton kernel, for CUDA GPUs: prompt rows, chunk rows, decode rows and speculative
verification rows of a step, all read in place from the paged cache through the block tables (no gather, no padding
to the longest sequence, one launch per layer).

The grid is (query tiles, KV heads). A query tile is up to `tokens_per_tile` consecutive queries of one sequence,
times the query heads that share the KV head (GQA folded onto the tile's rows, so K/V are read once for the group).
Each program walks its sequence's keys from key 0 in tiles of KEYS_PER_TILE with an online softmax, stopping after
the tile's last query position; keys after a row's own position are masked.

Batch-invariant by construction (the deterministic mode on CUDA relies on it): a row's result depends only on its
query and its sequence's keys. The key tiles start at key 0 and have a fixed size whatever the step holds, there is
no split of the keys across programs, and a key tile that lies wholly after a row's position (walked because a later
row of the same query tile needs it) leaves that row's running max, sum and accumulator bit for bit unchanged
(scale 1, add 0). So a position gives the same bits as a prompt row, a chunk row, a decode row or a verification row.
Gemma 2's score cap (cap * tanh(s / cap)) is applied to each score on its own before the softmax update, so it keeps
that property.

Runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how the test suite checks it against
the SDPA backend on machines without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from llmserve.attention.backend import (AttentionBackend, AttentionGroup, AttentionMetadata, DecodeGraphBuffers,
                                        SeqSpan, block_table_array)

KEYS_PER_TILE = 32  # fixed: the order in which a row's keys are summed must not depend on the step
ROWS_PER_TILE = 32  # query rows (tokens x heads of a GQA group) per program


def triton_available() -> str | None:
    """None when the kernel can run here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    return None


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonPagedGroup(AttentionGroup):
    """Every query row of the step, in one launch per layer. `tensors` are the kernel's per-tile and per-sequence
    inputs (the names below), on the device."""

    def __init__(self, tensors: dict[str, torch.Tensor], tokens_per_tile: int, group_pad: int, covers_batch: bool):
        self.block_tables, self.query_start, self.num_queries, self.num_keys, self.tile_seq, self.tile_first, \
            self.rows = (tensors[n] for n in ("block_tables", "query_start", "num_queries", "num_keys", "tile_seq",
                                              "tile_first", "rows"))
        self.tokens_per_tile, self.group_pad = tokens_per_tile, group_pad
        self.num_tiles = len(self.tile_seq)
        self.covers_batch = covers_batch
        self.dst = self.rows

    def attend(self, layer, q, k, v):
        from llmserve.kernels.triton_attention import paged_attention_kernel

        out = torch.empty_like(q)
        k_cache, v_cache = layer.k_cache, layer.v_cache
        if k_cache.dtype == torch.float8_e4m3fn and os.environ.get("TRITON_INTERPRET") == "1":
            # The interpreter has no FP8 loads: widen first (tests only; on a GPU the kernel converts as it loads).
            k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)
        paged_attention_kernel[(self.num_tiles, layer.num_kv_heads)](
            q, k_cache, v_cache, out, self.tile_seq, self.tile_first,
            self.query_start, self.num_queries, self.num_keys, self.block_tables,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
            self.block_tables.stride(0), layer.scale, layer.sliding_window, layer.logits_soft_cap,
            CAPPED=layer.logits_soft_cap > 0, GROUP=layer.num_heads // layer.num_kv_heads, GROUP_PAD=self.group_pad,
            TOKENS=self.tokens_per_tile,
            HEAD_DIM=layer.head_dim, HEAD_DIM_PAD=_next_power_of_two(max(16, layer.head_dim)),
            BLOCK_SIZE=layer.block_size, KEYS=KEYS_PER_TILE, IEEE=q.dtype == torch.float32,
        )
        return out if self.covers_batch else out[self.rows]


class TritonPagedBackend(AttentionBackend):
    name = "triton"

    def tile_shape(self) -> tuple[int, int]:
        """(queries per tile, padded GQA group): fixed per model, so that a row's tile never depends on the step."""
        group_pad = _next_power_of_two(self.num_heads // self.num_kv_heads)
        return max(1, max(ROWS_PER_TILE, 16) // group_pad), group_pad  # tl.dot needs at least 16 rows

    def build_metadata(self, spans: list[SeqSpan], positions: np.ndarray, slot_mapping: torch.Tensor,
                       min_blocks: int = 1) -> AttentionMetadata:
        tokens_per_tile, group_pad = self.tile_shape()
        offsets, num_queries, num_keys = (np.fromiter((s[i] for s in spans), np.int32, len(spans)) for i in range(3))
        block_tables = block_table_array([s.block_table for s in spans], -(-num_keys // self.block_size), min_blocks,
                                         np.int32)
        # each sequence's queries in tiles of tokens_per_tile: the tile's sequence and its first query
        tiles = -(-num_queries // tokens_per_tile)
        tile_seq = np.repeat(np.arange(len(spans), dtype=np.int32), tiles)
        tile_first = (np.arange(len(tile_seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * tokens_per_tile
        # the step's flat token index of every query, sequence by sequence
        starts = np.cumsum(num_queries) - num_queries
        rows = np.arange(int(num_queries.sum())) + np.repeat(offsets - starts, num_queries)
        covers_batch = len(rows) == len(positions) and bool((offsets == starts).all())
        arrays = {"block_tables": block_tables, "query_start": offsets, "num_queries": num_queries,
                  "num_keys": num_keys, "tile_seq": tile_seq, "tile_first": tile_first.astype(np.int32), "rows": rows}
        tensors = {name: self.tensor(array) for name, array in arrays.items()}
        return AttentionMetadata(slot_mapping=slot_mapping,
                                 groups=[TritonPagedGroup(tensors, tokens_per_tile, group_pad, covers_batch)],
                                 kv_writer=self.kv_writer())

    def kv_writer(self):
        """K and V stored in one launch, where the cache holds the model's dtype (an FP8 cache keeps the clamped
        conversion of layers/attention.py)."""
        from llmserve.kernels import fused_kernels_disabled

        if self.kv_dtype != self.dtype or fused_kernels_disabled():
            return None
        from llmserve.kernels.triton_fused import store_kv

        return store_kv

    def decode_graph_buffers(self, max_batch: int, max_blocks: int, pin: bool) -> "TritonDecodeGraphBuffers":
        return TritonDecodeGraphBuffers(self, max_batch, max_blocks, pin)


class TritonDecodeGraphBuffers(DecodeGraphBuffers):
    """Decode steps' metadata at fixed addresses (CUDA graphs): one query per sequence, so one tile per sequence and
    the tile, query and row indices are 0..size-1 for good; only the key counts and block tables change, written
    into the first rows of fixed tensors. A padding row sees one key (its table's first block, whatever that is:
    reading it is harmless) and its output is dropped."""

    def __init__(self, backend: TritonPagedBackend, max_batch: int, max_blocks: int, pin: bool):
        self.block_size = backend.block_size
        self.tile_shape = backend.tile_shape()
        self.kv_writer = backend.kv_writer()
        self.host_keys = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.keys_np, self.tables_np = self.host_keys.numpy(), self.host_tables.numpy()
        device = backend.device
        self.num_keys = self.host_keys.to(device)
        self.block_tables = self.host_tables.to(device)
        index = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.fixed = {"query_start": index, "tile_seq": index, "rows": index.long(),
                      "num_queries": torch.ones_like(index), "tile_first": torch.zeros_like(index)}

    def write(self, num_keys: np.ndarray, block_tables: list, size: int) -> None:
        n = len(num_keys)
        self.keys_np[:n] = num_keys
        self.keys_np[n:size] = 1
        block_table_array(block_tables, -(-num_keys // self.block_size), out=self.tables_np)
        if self.num_keys.data_ptr() != self.host_keys.data_ptr():
            self.num_keys[:size].copy_(self.host_keys[:size], non_blocking=True)
            self.block_tables[:size].copy_(self.host_tables[:size], non_blocking=True)

    def metadata(self, size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        tensors = {name: t[:size] for name, t in self.fixed.items()}
        tensors.update(num_keys=self.num_keys[:size], block_tables=self.block_tables[:size])
        return AttentionMetadata(slot_mapping=slot_mapping, groups=[TritonPagedGroup(tensors, *self.tile_shape, True)],
                                 kv_writer=self.kv_writer)
