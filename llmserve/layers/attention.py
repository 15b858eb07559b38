"""Attention over the paged KV cache: the layer stores this step's K/V rows in their cache slots, then each of the
step's attention groups (built once per step by the attention backend, llmserve/attention/) attends its queries.

The cache may hold K and V in FP8 (e4m3fn, scale 1, saturating at +-448), written rounded to nearest.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.backend import AttentionMetadata

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int = 0, logits_soft_cap: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        # > 0: a query reads only the last `sliding_window` keys up to its own position (every backend honours it)
        self.sliding_window = sliding_window
        # > 0: each score s becomes logits_soft_cap * tanh(s / logits_soft_cap) before the softmax (Gemma 2)
        self.logits_soft_cap = logits_soft_cap
        # Bound by the worker's KV tensors (worker/kv_tensors.py): [slots, num_kv_heads, head_dim] each, in blocks of
        # block_size slots.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.block_size = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        if meta.kv_writer is not None:
            meta.kv_writer(self.k_cache, self.v_cache, meta.slot_mapping, k, v)
        else:
            store_kv(self.k_cache, meta.slot_mapping, k)
            store_kv(self.v_cache, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].covers_batch:  # all decode rows, or one prompt
            return meta.groups[0].attend(self, q, k, v)
        out = torch.empty_like(q)
        for group in meta.groups:  # at most two: decode rows and prompt rows
            out.index_copy_(0, group.dst, group.attend(self, q, k, v))
        return out


def store_kv(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no float8 kernel: copy the bytes
        rows = rows.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)  # clamped: not every device's conversion saturates
        cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows)
