"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary's rows.

The embedding looks up the ids in its slice, zeroes the others and sums across ranks; the LM head computes its
slice's logits and gathers them in rank order. With one rank both are the plain operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from llmserve.layers.linear import LinearBase


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """This rank's [start, end) of the vocabulary, padded so that every rank holds the same number of rows."""
    per_rank = -(-vocab_size // tp_size())
    return tp_rank() * per_rank, (tp_rank() + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end = vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size), requires_grad=False)
        self.reduce_results = tp_size() > 1  # fixed at build time, as the linear layers

    def load(self, param: str, tensor: torch.Tensor, shard: int = 0) -> None:
        rows = tensor[self.start:self.end]
        self.weight.data.zero_()
        self.weight.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        out = F.embedding((input_ids - self.start) * mine, self.weight)
        return all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))


class ParallelLMHead(LinearBase):
    """Logits for this rank's vocabulary slice, gathered across ranks (padding rows past the vocabulary are cut)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        self.vocab_size = vocab_size
        start, end = vocab_range(vocab_size)
        super().__init__(hidden_size, end - start)
        self.start = start
        self.gather_results = tp_size() > 1

    def rank_slice(self, param, tensor, shard):
        rows = tensor[self.start:self.start + self.weight.shape[0]]
        if rows.shape[0] < self.weight.shape[0]:  # the last rank's padding
            rows = torch.cat([rows, rows.new_zeros(self.weight.shape[0] - rows.shape[0], *rows.shape[1:])])
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, x)
        if not self.gather_results:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]
