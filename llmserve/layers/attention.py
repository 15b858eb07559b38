"""Attention over the paged KV cache.

The batch is one flat run of tokens from many sequences. Each step's new K/V rows are written to
their cache slots (`slot_mapping`); then every sequence's queries attend to its whole history,
gathered from the cache through its block table, whole blocks at a time (one contiguous copy of
block_size x kv_heads x head_dim per block, instead of one small row per token). Sequences are
attended in groups of similar query length (decode rows: one query each; prefill chunks: many),
each group one padded SDPA call, so there is no Python loop over sequences.

The cache may hold K and V in FP8 (e4m3fn, scale 1, saturating at +-448): written rounded to nearest, read by
the native decode kernel as they lie, and converted back to the model's dtype where SDPA reads gathered blocks.
A fresh prompt attends to its own keys before they are rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] flat token index of each (padded) query
    kv_blocks: torch.Tensor  # [B, N] cache block of each sequence's key blocks (padding points at block 0)
    # [B, 1, G * Q, N * block_size] additive (0 or -inf, the model's dtype), G = query heads per KV head: built once
    # per step and shared by every layer; None for a fresh group
    mask: torch.Tensor | None
    src: torch.Tensor  # indices into the B*Q padded queries that are real
    dst: torch.Tensor  # their flat token indices
    covers_batch: bool = False  # the padded queries are exactly the batch's tokens in order (no gather/scatter)
    fresh: bool = False  # every sequence starts at position 0: its keys are this step's, causal, nothing to gather
    # [B] keys per sequence: set (and mask None) for one-query rows attended by the native kernel in place
    lengths: torch.Tensor | None = None
    # [B, 3] first query's flat index, queries, keys per sequence: set (and mask None) for prompt rows attended by
    # the native prompt kernel, which also reads the blocks where they lie
    spans: torch.Tensor | None = None
    # with spans, for fresh prompts under an FP8 cache: the keys are this step's own K and V rows, unrounded, and
    # kv_blocks holds each key's row (blocks of one key)
    own_keys: bool = False


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    groups: list[AttentionGroup]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Set by the model runner: [num_slots, num_kv_heads, head_dim] each, in blocks of block_size slots.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.block_size = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        self._store(self.k_cache, meta.slot_mapping, k)
        self._store(self.v_cache, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].covers_batch:  # all decode rows, or one prefill chunk
            return self._attend(q, k, v, meta.groups[0])
        out = torch.empty_like(q)
        for group in meta.groups:  # at most two: decode rows and prefill chunks
            out.index_copy_(0, group.dst, self._attend(q, k, v, group))
        return out

    @staticmethod
    def _store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel: copy the bytes
            rows = rows.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)  # clamped: not every device's conversion saturates
            cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
        else:
            cache.index_copy_(0, slots, rows)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        if g.spans is not None:
            keys, values, block_size = ((k.contiguous(), v.contiguous(), 1) if g.own_keys
                                        else (self.k_cache, self.v_cache, self.block_size))
            out = torch.ops.llmserve_kernels.prefill_attention(q, keys, values, g.kv_blocks, g.spans, block_size,
                                                               self.scale)
            return out if g.covers_batch else out[g.dst]
        if g.fresh:
            return self._attend_fresh(q, k, v, g)
        if g.lengths is not None:  # one query per sequence: the native kernel reads the blocks where they lie
            rows = q if g.covers_batch else q[g.token_index.view(-1)]
            return torch.ops.llmserve_kernels.paged_decode_attention(rows, self.k_cache, self.v_cache, g.kv_blocks,
                                                                     g.lengths, self.block_size, self.scale)
        B, Q = g.token_index.shape
        L = g.mask.shape[-1]
        hkv, groups, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # Fold the query heads that share a KV head into the query axis: no K/V repeat needed for GQA.
        qg = (q if g.covers_batch else q[g.token_index]).reshape(B, Q, hkv, groups, d).permute(0, 2, 3, 1, 4).reshape(B, hkv, groups * Q, d)
        blocks = g.kv_blocks.reshape(-1)
        bs = self.block_size
        kg = self.k_cache.view(-1, bs, hkv, d).index_select(0, blocks).view(B, L, hkv, d).transpose(1, 2).to(q.dtype)
        vg = self.v_cache.view(-1, bs, hkv, d).index_select(0, blocks).view(B, L, hkv, d).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale)
        o = o.view(B, hkv, groups, Q, d).permute(0, 3, 1, 2, 4).reshape(B * Q, self.num_heads, d)
        return o if g.covers_batch else o[g.src]

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """Whole prompts from position 0: causal attention over the step's own keys, GQA in the kernel. Padded
        queries sit after each sequence's real ones, so causality keeps every real query off the padding."""
        B, Q = g.token_index.shape

        def batched(x):  # [T, H, D] -> [B, H, Q, D]
            x = x.reshape(B, Q, *x.shape[1:]) if g.covers_batch else x[g.token_index]
            return x.transpose(1, 2)

        o = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=self.scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(B * Q, self.num_heads, self.head_dim)
        return o if g.covers_batch else o[g.src]
