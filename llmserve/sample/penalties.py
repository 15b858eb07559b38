"""Repetition, frequency and presence penalties over a persistent per-request token-count table.

Counts of output tokens live in one [rows, vocab] tensor, a row per live request that uses a
penalty; each step adds the new tokens to it instead of rebuilding it from token lists.
"""

from __future__ import annotations

import torch


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
                prompt = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=self.device)
                self.in_prompt[row, prompt[prompt < self.vocab_size]] = True
                if r.output_token_ids:  # resumed after preemption, or re-added
                    out = torch.tensor(r.output_token_ids, dtype=torch.long, device=self.device)
                    self.counts[row].index_put_((out,), torch.ones_like(out, dtype=torch.int32), accumulate=True)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition (CTRL / Hugging Face rule: positive logits divided, negative multiplied; prompt and
    output tokens), then OpenAI's frequency (× count) and presence (once) penalties over output tokens.
    Only the seen tokens change, so the arithmetic runs on those entries alone. Edits `logits` in place."""
    rows, cols = (in_prompt | (counts > 0)).nonzero(as_tuple=True)
    values = logits[rows, cols]
    count = counts[rows, cols].to(logits.dtype)
    rep = repetition[rows]
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - frequency[rows] * count - presence[rows] * (count > 0)
    logits[rows, cols] = values
    return logits
