"""Pooling: a prompt's last-layer hidden states → one embedding (--runner pooling).

It runs in two halves on either side of the step boundary, so that a prompt computed in several chunks (chunked
prefill, preemption) pools exactly what one whole pass would. The worker picks, from each step's hidden states, the
rows its pooling type needs (`select`); the engine keeps them with the request and, once the prompt is computed,
reduces them (`finish`). Keeping rows rather than running sums is what makes a chunked prompt's mean the same bits as
an unchunked one's (the sum over one tensor, in one order), as vLLM keeps chunks' hidden states.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmserve.config import PoolerConfig
from llmserve.pooling_params import PoolingParams


class PoolingRow(NamedTuple):
    """One request's share of a step's flat hidden states: rows [offset, offset + num_tokens), the prompt's positions
    from `start`; `completes`: the prompt's last token is among them."""

    request_id: str
    offset: int
    num_tokens: int
    start: int
    completes: bool


class Pooler:
    """num_labels, problem_type: a sequence classifier's (0: an embedding model). Its head reads one token's state
    (LAST or CLS), so the worker applies it to the row it picks (`head`), and `finish` turns the scores into
    probabilities."""

    def __init__(self, config: PoolerConfig, num_labels: int = 0, problem_type: str | None = None):
        self.config = config
        self.num_labels = num_labels
        self.problem_type = problem_type

    def select(self, hidden: torch.Tensor, rows: list[PoolingRow], head=None) -> dict[str, torch.Tensor]:
        """Worker side: per request, the hidden states this step adds to what it pools ([k, hidden], float32 copies on
        the host: they outlive the step's buffers and cross to the engine's process); through `head` first (a
        classifier's: [k, num_labels])."""
        kind = self.config.pooling_type
        out = {}
        for rid, offset, n, start, completes in rows:
            if kind == "LAST":
                first, last = (offset + n - 1, offset + n) if completes else (0, 0)
            elif kind == "CLS":
                first, last = (offset, offset + 1) if start == 0 else (0, 0)
            else:  # MEAN: every token
                first, last = offset, offset + n
            if last > first:
                picked = hidden[first:last] if head is None else head(hidden[first:last])
                out[rid] = picked.to("cpu", torch.float32, copy=True)
        return out

    def finish(self, parts: list[torch.Tensor], params: PoolingParams) -> torch.Tensor:
        """Engine side: the rows `select` gave over all of a prompt's steps → its embedding (1-D float32): pooled,
        cut to `dimensions`, then normalized (vLLM's order: a Matryoshka prefix is scaled to unit length itself)."""
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        pooled = rows.mean(dim=0) if self.config.pooling_type == "MEAN" else rows[-1]
        if self.num_labels:
            return self.classify(pooled, params)
        if params.dimensions is not None:
            pooled = pooled[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled.clone()

    def classify(self, scores: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A classifier's scores as transformers' loss for its problem_type reads them: softmax over the classes;
        sigmoid for one class (a reward model) or multi-label; as they are for regression, or activation=False."""
        if params.activation is False or self.problem_type == "regression":
            return scores.clone()
        if self.num_labels == 1 or self.problem_type == "multi_label_classification":
            return torch.sigmoid(scores)
        return torch.softmax(scores, dim=-1)
