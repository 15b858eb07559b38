"""llmserve's C++ attention kernels for CPUs (llmserve/kernels/), read from the paged cache where the blocks lie.

- Decode rows (one query per sequence): `paged_decode_attention` walks each sequence's blocks in place, in the
  cache's dtype (FP8 blocks are converted as they are read).
- Prompt rows, in bf16 on CPUs with AVX512-BF16 but not AMX: `prefill_attention` packs each sequence's keys and values
  from their blocks once per layer and multiplies them with vdpbf16ps. Under an FP8 cache it serves only whole prompts
  from position 0, over the step's own keys before they are rounded (blocks of one key). On an AMX CPU torch's flash
  attention multiplies with AMX tiles, so prompts stay on SDPA there.
Everything else falls back to the SDPA groups this backend inherits, as do prompt rows in a sliding-window or
soft-capped layer (the decode kernel reads a window and caps scores itself).
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve import kernels
from llmserve.attention.backend import AttentionGroup, SeqSpan, pad_group
from llmserve.attention.sdpa import SdpaBackend, SdpaGroupBase


class NativeDecodeGroup(SdpaGroupBase):
    def __init__(self, layout, backend):
        super().__init__(layout, backend)
        self.kv_blocks = backend.tensor(layout.tables)
        self.lengths = backend.tensor(layout.ends)

    def dynamic_dims(self, per_token, per_sequence):
        dims = super().dynamic_dims(per_token, per_sequence) + [(self.kv_blocks, 1)]
        if per_sequence:
            dims += [(self.kv_blocks, 0), (self.lengths, 0)]
        return dims

    def attend(self, layer, q, k, v):
        rows = q if self.covers_batch else q[self.token_index.view(-1)]
        # positional arguments: keyword ones cost the dispatcher a schema match per call, 30 times a step
        return torch.ops.llmserve_kernels.paged_decode_attention(rows, layer.k_cache, layer.v_cache, self.kv_blocks,
                                                                 self.lengths, layer.block_size, layer.scale, 1.0, 1.0,
                                                                 0, layer.sliding_window, layer.logits_soft_cap)


class NativePromptGroup(SdpaGroupBase):
    def __init__(self, layout, backend, spans: list[SeqSpan], own_keys: bool, sdpa: AttentionGroup | None):
        """sdpa: the SDPA group that serves the model's sliding-window and soft-capped layers (the prompt kernel
        reads every key up to a query's position, uncapped), or None for a model without them."""
        super().__init__(layout, backend)
        self.sdpa = sdpa
        self.spans = torch.tensor([[s.offset, s.num_queries, s.num_keys] for s in spans], dtype=torch.long,
                                  device=backend.device)
        # With own_keys (fresh prompts under an FP8 cache) the keys are this step's own K and V rows, unrounded, and
        # the kernel's "blocks" are single keys: each key's row in the step.
        self.own_keys = own_keys
        tables = layout.tables
        if own_keys:
            tables = np.zeros(layout.token_index.shape, dtype=np.int64)
            for i, s in enumerate(spans):
                tables[i, : s.num_queries] = np.arange(s.offset, s.offset + s.num_queries)
        self.kv_blocks = backend.tensor(tables)

    def dynamic_dims(self, per_token, per_sequence):
        return super().dynamic_dims(per_token, per_sequence) + [(self.kv_blocks, 1)]

    def attend(self, layer, q, k, v):
        if layer.sliding_window or layer.logits_soft_cap:
            return self.sdpa.attend(layer, q, k, v)
        keys, values, block_size = ((k.contiguous(), v.contiguous(), 1) if self.own_keys
                                    else (layer.k_cache, layer.v_cache, layer.block_size))
        out = torch.ops.llmserve_kernels.prefill_attention(q, keys, values, self.kv_blocks, self.spans, block_size,
                                                           layer.scale)
        return out if self.covers_batch else out[self.dst]


class CpuNativeBackend(SdpaBackend):
    name = "native"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        # The prompt kernel reads keys from a bf16 cache; under an FP8 cache only fresh prompts' own keys.
        self.prompt_kernel = (self.dtype == torch.bfloat16 and kernels.lowbit_linear_isa() != "amx"
                              and kernels.prefill_attention_available(self.head_dim))
        self.prompt_kernel_reads_cache = self.prompt_kernel and self.kv_dtype == torch.bfloat16

    @staticmethod
    def supports(num_heads: int, head_dim: int) -> str | None:
        """None if the kernels serve this shape, else why not."""
        if num_heads > kernels.MAX_QUERY_HEADS or head_dim > kernels.MAX_HEAD_DIM:
            return f"the native attention kernel takes at most {kernels.MAX_QUERY_HEADS} query heads and head_dim " \
                   f"{kernels.MAX_HEAD_DIM}"
        return None

    def build_group(self, spans: list[SeqSpan], positions: np.ndarray, min_blocks: int) -> AttentionGroup:
        layout = pad_group(spans, len(positions), self.block_size, min_blocks)
        if not layout.fresh and layout.token_index.shape[1] == 1:
            return NativeDecodeGroup(layout, self)
        own_keys = layout.fresh and self.prompt_kernel and not self.prompt_kernel_reads_cache
        if self.prompt_kernel_reads_cache or own_keys:
            sdpa = self.sdpa_group(layout, positions) if self.sliding_windows or self.logits_soft_cap else None
            return NativePromptGroup(layout, self, spans, own_keys, sdpa)
        return self.sdpa_group(layout, positions)
