"""The low-rank term of LoRA adapters, for a batch that mixes adapters (S-LoRA / Punica's segmented matmul, in torch).

Each adapted linear layer holds a fixed set of slots (--max-loras): slot s has A_s^T [in, R] and (scale * B_s)^T
[R, out], where R = shards x --max-lora-rank (q, k and v side by side for the fused QKV layer, each shard's B writing
only its own output columns; a smaller rank is padded with zeros). The model runner orders a step's rows by adapter,
so each adapter's tokens are one contiguous segment of the flat batch, prompt chunks and decode rows alike; per
segment the layer adds (x A^T) B^T to the base output: two matmuls per adapter in the step, whatever the number of
requests, and none for rows without an adapter. The base matmul runs once for the whole batch.

Tensor parallelism: a column-parallel layer keeps A whole and its slice of B's outputs; a row-parallel layer its slice
of A's inputs and all of B, and adds its partial term before the all-reduce, which sums the ranks' parts of x A^T.
"""

from __future__ import annotations

import torch


class LoRAStepState:
    """Shared by every adapted layer: this step's segments (slot, first row, end row); empty means no adapter."""

    def __init__(self):
        self.segments: list[tuple[int, int, int]] = []


class LoRALayerWeights:
    def __init__(self, state: LoRAStepState, num_slots: int, rank_space: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device):
        self.state = state
        self.a_t = torch.zeros(num_slots, in_features, rank_space, dtype=dtype, device=device)
        self.b_t = torch.zeros(num_slots, rank_space, out_features, dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for slot, start, end in self.state.segments:
            xa = torch.mm(x[start:end], self.a_t[slot])
            out[start:end].addmm_(xa, self.b_t[slot])
        return out

    def clear(self, slot: int) -> None:
        self.a_t[slot].zero_()
        self.b_t[slot].zero_()
