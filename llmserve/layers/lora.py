"""The low-rank term of LoRA adapters, for a batch that mixes adapters (S-LoRA / Punica's segmented matmul, in torch).

Each adapted linear layer holds a fixed set of slots (--max-loras): slot s has A_s^T [in, R] and (scale * B_s)^T
[R, out], where R = shards x --max-lora-rank (q, k and v side by side for the fused QKV layer, each shard's B writing
only its own output columns; a smaller rank is padded with zeros). The model runner orders a step's rows by adapter,
base rows first, so each adapter's tokens are one contiguous segment of the flat batch. The base matmul runs once for
the whole batch; then the layer adds (x A^T) B^T for the adapted rows, in one of two ways the step chose
(LoRAStepState.plan):

- batched: the segments padded to the longest and stacked, [segments, longest, in], and two batched matmuls against the
  segments' slots. A constant number of ops whatever the number of adapters: decode steps, where each adapter has a
  few rows.
- per segment: two matmuls per adapter on its rows. Prompt steps, where segments differ in length and padding them
  to the longest would multiply the work.

Rows without an adapter cost nothing. Tensor parallelism: a column-parallel layer keeps A whole and its slice of B's
outputs; a row-parallel layer its slice of A's inputs and all of B, and adds its partial term before the all-reduce,
which sums the ranks' parts of x A^T.
"""

from __future__ import annotations

import torch

# batched when padding the segments to the longest adds at most this fraction of the adapted rows
MAX_PADDING = 0.5


class LoRAStepState:
    """Shared by every adapted layer: how this step's adapted rows are laid out. Set by LoRAManager.prepare_step."""

    def __init__(self):
        self.segments: list[tuple[int, int, int]] = []  # (slot, first row, end row); empty: no adapter this step
        self.batched = False
        self.first_row = 0  # adapted rows are [first_row, end of batch)
        self.longest = 0
        self.slots: torch.Tensor | slice | None = None  # the segments' slots: a range as a slice, else an index
        self.gather: torch.Tensor | None = None  # rows of the padded stack (None: segments equally long, a view)
        self.kept: torch.Tensor | None = None  # positions of the padded stack that are real rows
        self.dst: torch.Tensor | None = None  # and the rows they belong to

    def plan(self, segments: list[tuple[int, int, int]], device: torch.device) -> None:
        self.segments = segments
        self.batched = False
        if len(segments) < 2:
            return
        lengths = [end - start for _, start, end in segments]
        longest, rows = max(lengths), sum(lengths)
        if longest * len(segments) > rows * (1 + MAX_PADDING):
            return
        self.batched, self.first_row, self.longest = True, segments[0][1], longest
        slots = [slot for slot, _, _ in segments]
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self.slots = slice(slots[0], slots[-1] + 1) if contiguous else torch.tensor(slots, device=device)
        if all(n == longest for n in lengths):
            self.gather = self.kept = self.dst = None
            return
        gather, kept, dst = [], [], []
        for i, (_, start, end) in enumerate(segments):
            n = end - start
            gather += list(range(start, end)) + [start] * (longest - n)  # padding repeats a real row, then is dropped
            kept += range(i * longest, i * longest + n)
            dst += range(start, end)
        self.gather, self.kept, self.dst = (torch.tensor(v, device=device) for v in (gather, kept, dst))


class LoRALayerWeights:
    def __init__(self, state: LoRAStepState, num_slots: int, rank_space: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device):
        self.state = state
        self.a_t = torch.zeros(num_slots, in_features, rank_space, dtype=dtype, device=device)
        self.b_t = torch.zeros(num_slots, rank_space, out_features, dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        s = self.state
        if s.batched:
            n = len(s.segments)
            a, b = (self.a_t[s.slots], self.b_t[s.slots]) if isinstance(s.slots, slice) else \
                (self.a_t.index_select(0, s.slots), self.b_t.index_select(0, s.slots))
            if s.gather is None:
                stacked = x[s.first_row:].view(n, s.longest, -1)
                out[s.first_row:].add_(torch.bmm(torch.bmm(stacked, a), b).view(n * s.longest, -1))
            else:
                stacked = x.index_select(0, s.gather).view(n, s.longest, -1)
                delta = torch.bmm(torch.bmm(stacked, a), b).view(n * s.longest, -1)
                out.index_add_(0, s.dst, delta.index_select(0, s.kept))
            return out
        for slot, start, end in s.segments:
            xa = torch.mm(x[start:end], self.a_t[slot])
            out[start:end].addmm_(xa, self.b_t[slot])
        return out

    def clear(self, slot: int) -> None:
        self.a_t[slot].zero_()
        self.b_t[slot].zero_()
