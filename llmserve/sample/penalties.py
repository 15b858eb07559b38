"""Repetition, frequency and presence penalties over a persistent per-request token-count table.

Counts of output tokens live in one [rows, vocab] tensor, a row per live request that uses a
penalty; each step adds the new tokens to it instead of rebuilding it from token lists.
"""

from __future__ import annotations

import torch

from llmserve.sample.device_copy import on_device


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 16):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(capacity - 1, -1, -1))

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    def rows_for(self, requests) -> torch.Tensor:
        rows = []
        for r in requests:
            row = self.rows.get(r.request_id)
            if row is None:
                if not self.free_rows:
                    self._grow()
                row = self.free_rows.pop()
                self.rows[r.request_id] = row
                self.counts[row].zero_()
                self.in_prompt[row].zero_()
                prompt = [t for t in r.prompt_token_ids if t < self.vocab_size]
                self.in_prompt[row, on_device(prompt, self.device, torch.long)] = True
                if r.output_token_ids:  # resumed after preemption, or re-added
                    out = on_device(r.output_token_ids, self.device, torch.long)
                    self.counts[row].index_put_((out,), torch.ones_like(out, dtype=torch.int32), accumulate=True)
            rows.append(row)
        return on_device(rows, self.device, torch.long)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                    dense: bool | None = None) -> torch.Tensor:
    """Repetition (CTRL / Hugging Face rule: positive logits divided, negative multiplied; prompt and
    output tokens), then OpenAI's frequency (× count) and presence (once) penalties over output tokens.
    Only the seen tokens change. On a CPU the arithmetic runs on those entries alone; elsewhere over every entry,
    kept where seen: finding the seen entries (nonzero) would read their number back from the device, waiting for
    the step in flight. The same operations on each entry either way (dense: None, by the device). Edits `logits` in
    place."""
    seen = in_prompt | (counts > 0)
    if dense is None:
        dense = logits.device.type != "cpu"
    if dense:
        count = counts.to(logits.dtype)
        rep = repetition.unsqueeze(1)
        values = torch.where(logits > 0, logits / rep, logits * rep)
        values = values - frequency.unsqueeze(1) * count - presence.unsqueeze(1) * (count > 0)
        logits.copy_(torch.where(seen, values, logits))
        return logits
    rows, cols = seen.nonzero(as_tuple=True)
    values = logits[rows, cols]
    count = counts[rows, cols].to(logits.dtype)
    rep = repetition[rows]
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - frequency[rows] * count - presence[rows] * (count > 0)
    logits[rows, cols] = values
    return logits
