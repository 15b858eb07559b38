"""The reference backend, on every device: torch's scaled_dot_product_attention.

Whole prompts from position 0 attend causally over the step's own keys (no gather). Every other group gathers each
sequence's keys through its block table, whole blocks at a time (one contiguous copy of block_size x kv_heads x
head_dim per block, instead of one small row per token), into one padded SDPA call per group and layer. The query
heads that share a KV head are folded onto the query axis (GQA without repeating K/V), and the additive mask is
built once per step for all layers. An FP8 cache is converted back to the model's dtype where the blocks are
gathered. A soft-capped layer (Gemma 2) cannot go through SDPA, which takes no function of the scores: it computes
the scores, caps them, and takes their softmax itself, under the same masks.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.attention.backend import AttentionBackend, AttentionGroup, GroupLayout, SeqSpan, pad_group


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         cap: float) -> torch.Tensor:
    """softmax(cap * tanh(scale * q.k / cap) + mask) v, as transformers' Gemma 2 computes it (the products in the
    inputs' dtype, the capping and the softmax in float32). q: [B, Hkv, M, D] (the query heads sharing a KV head on
    the query axis), k, v: [B, Hkv, L, D]; mask: boolean (True: visible) or additive, broadcasting to [B, Hkv, M, L]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


class SdpaGroupBase(AttentionGroup):
    def __init__(self, layout: GroupLayout, backend: AttentionBackend):
        self.token_index = backend.tensor(layout.token_index)
        flat_valid = layout.valid.reshape(-1)
        self.src = backend.tensor(np.flatnonzero(flat_valid))  # the real ones among the B*Q padded queries
        self.dst = backend.tensor(layout.token_index.reshape(-1)[flat_valid])
        self.covers_batch = layout.covers_batch

    def dynamic_dims(self, per_token, per_sequence):
        dims = [(self.src, 0), (self.dst, 0)] if per_token else []
        if per_token:
            dims.append((self.token_index, 0 if self.token_index.shape[1] == 1 else 1))
        return dims


class FreshPromptGroup(SdpaGroupBase):
    """Whole prompts from position 0: causal attention over the step's own keys, GQA in the kernel. Padded queries
    sit after each sequence's real ones, so causality keeps every real query off the padding. A windowed layer's
    queries attend under a banded causal mask (one per window, built once per step)."""

    def __init__(self, layout: GroupLayout, backend: AttentionBackend):
        super().__init__(layout, backend)
        Q = layout.token_index.shape[1]
        pos = np.arange(Q)
        self.window_masks = {w: backend.tensor((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w))
                             for w in backend.sliding_windows}
        if backend.logits_soft_cap:  # soft-capped full layers mask explicitly too
            self.window_masks[0] = backend.tensor(pos[None, :] <= pos[:, None])

    def dynamic_dims(self, per_token, per_sequence):
        dims = super().dynamic_dims(per_token, per_sequence)
        if per_token:
            dims += [(m, d) for m in self.window_masks.values() for d in (0, 1)]
        return dims

    def attend(self, layer, q, k, v):
        B, Q = self.token_index.shape

        def batched(x):  # [T, H, D] -> [B, H, Q, D]
            x = x.reshape(B, Q, *x.shape[1:]) if self.covers_batch else x[self.token_index]
            return x.transpose(1, 2)

        if layer.logits_soft_cap:  # the query heads sharing a KV head on the query axis, as the paged group does
            hkv, groups = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
            qg = batched(q).reshape(B, hkv, groups * Q, layer.head_dim)
            mask = self.window_masks[layer.sliding_window].repeat(groups, 1)
            o = softcapped_attention(qg, batched(k), batched(v), mask, layer.scale, layer.logits_soft_cap)
            o = o.view(B, layer.num_heads, Q, layer.head_dim)
        elif layer.sliding_window:
            o = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), scale=layer.scale, enable_gqa=True,
                                               attn_mask=self.window_masks[layer.sliding_window])
        else:
            o = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=layer.scale,
                                               enable_gqa=True)
        o = o.transpose(1, 2).reshape(B * Q, layer.num_heads, layer.head_dim)
        return o if self.covers_batch else o[self.src]


class PagedSdpaGroup(SdpaGroupBase):
    """Keys gathered block by block through the tables, under a mask built once per step (and one per sliding
    window)."""

    def __init__(self, layout: GroupLayout, backend: AttentionBackend, positions: np.ndarray):
        super().__init__(layout, backend)
        B, Q = layout.token_index.shape
        self.kv_blocks = backend.tensor(layout.tables)
        key_pos = np.arange(layout.tables.shape[1] * backend.block_size)
        # A padded query gets position 0 and sees key 0 only, so no row is all -inf; its output is dropped.
        query_pos = np.where(layout.valid, positions[layout.token_index], 0)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
        groups = backend.num_heads // backend.num_kv_heads

        def additive(visible):  # the query heads sharing a KV head are folded into the query axis: [B, 1, G * Q, L]
            visible = np.broadcast_to(visible[:, None], (B, groups, Q, visible.shape[-1])).reshape(B, 1, -1, visible.shape[-1])
            mask = torch.zeros(visible.shape, dtype=backend.dtype, device=backend.device)
            return mask.masked_fill_(backend.tensor(~visible), float("-inf"))

        self.mask = additive(visible)
        self.masks = {0: self.mask}
        for w in backend.sliding_windows:
            self.masks[w] = additive(visible & (key_pos[None, None, :] > query_pos[:, :, None] - w))

    def dynamic_dims(self, per_token, per_sequence):
        dims = super().dynamic_dims(per_token, per_sequence) + [(self.kv_blocks, 1)]
        dims += [(m, 3) for m in self.masks.values()]
        if per_sequence:
            dims += [(m, 0) for m in self.masks.values()] + [(self.kv_blocks, 0)]
        return dims

    def attend(self, layer, q, k, v):
        B, Q = self.token_index.shape
        L = self.mask.shape[-1]
        hkv, groups, d = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
        # Fold the query heads that share a KV head into the query axis: no K/V repeat needed for GQA.
        qg = (q if self.covers_batch else q[self.token_index]).reshape(B, Q, hkv, groups, d)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(B, hkv, groups * Q, d)
        blocks = self.kv_blocks.reshape(-1)
        bs = layer.block_size
        kg = layer.k_cache.view(-1, bs, hkv, d).index_select(0, blocks).view(B, L, hkv, d).transpose(1, 2).to(q.dtype)
        vg = layer.v_cache.view(-1, bs, hkv, d).index_select(0, blocks).view(B, L, hkv, d).transpose(1, 2).to(q.dtype)
        if layer.logits_soft_cap:
            o = softcapped_attention(qg, kg, vg, self.masks[layer.sliding_window], layer.scale, layer.logits_soft_cap)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=self.masks[layer.sliding_window],
                                               scale=layer.scale)
        o = o.view(B, hkv, groups, Q, d).permute(0, 3, 1, 2, 4).reshape(B * Q, layer.num_heads, d)
        return o if self.covers_batch else o[self.src]


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def build_group(self, spans: list[SeqSpan], positions: np.ndarray, min_blocks: int) -> AttentionGroup:
        layout = pad_group(spans, len(positions), self.block_size, min_blocks)
        return self.sdpa_group(layout, positions)

    def sdpa_group(self, layout: GroupLayout, positions: np.ndarray) -> AttentionGroup:
        return FreshPromptGroup(layout, self) if layout.fresh else PagedSdpaGroup(layout, self, positions)
