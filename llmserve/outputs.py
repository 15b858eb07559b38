"""Results in vLLM's shape: outputs[i].outputs[0].text / .token_ids / .finish_reason."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported at run time here: the gateway reads this module without it
    import torch


class ListPrefix(Sequence):
    """The first `n` items of a list that only ever grows at its end (a request's output tokens, its logprobs): a
    snapshot taken in O(1). Copying the whole list into every step's output made a long output's per-step cost grow
    with its length (docs/benchmarks.md, "Host time per decode step"). Reads like a list and compares equal to
    one with the same items; pickles as a plain list."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._items[slice(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("list index out of range")
        return self._items[i]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, ListPrefix)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # as a list's

    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "timeout"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    # What is new since the previous output of this request (streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    prefill_compute_seconds: float = 0.0  # this request's share of the steps' wall time (the basis of GPU-time cost)
    decode_compute_seconds: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # raw model logprobs; None for the first token
    # disaggregated serving: where the prompt was prefilled and what its KV handover cost (TransferRecord)
    kv_transfer: object | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result: its embedding, a 1-D float32 tensor on the host."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """What a pooling request (--runner pooling; LLM.encode) gives, once, when its prompt has been computed (vLLM's
    shape). A pooling request that ends otherwise (aborted, timed out) gives a RequestOutput with that finish_reason."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    kv_transfer: object | None = None  # (none: read where outputs of both kinds are)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result: outputs.embedding is the prompt's embedding as a list of floats (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result for one pair (vLLM's shape): outputs.score, the cosine similarity of the two texts'
    embeddings (prompt_token_ids: the second text's), or a cross-encoder's score of the pair (prompt_token_ids: the
    pair's one prompt)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # per class (the head's raw scores with activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """LLM.classify's result: outputs.probs per class (vLLM's shape)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(output.request_id, ClassificationOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)
