"""The step boundary: plain data between the engine (scheduler, KV manager, requests) and the executor.

A StepInput says everything a worker needs to run one step: which requests are new to it (their prompt and
sampling parameters, sent once), which tokens each scheduled request computes, where their K/V go (its block-table
row), which rows sample, and the drafts to verify. A StepOutput carries back what was sampled. Nothing here refers
to a live Request or KVCacheManager, so the same objects can be pickled to worker processes (one per
tensor-parallel rank) without the engine changing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.lora.request import LoRARequest
from llmserve.sampling_params import SamplingParams


# Async scheduling: the token a row computes was sampled by the previous step and is still on the device; the worker
# reads it there (a row's token_ids end with it, at most one, in a one-token decode row).
PLACEHOLDER_TOKEN = -1


@dataclass
class NewRequestData:
    """Sent the first step a request reaches the executor; the worker keeps it until the request is finished."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: set[int]
    output_token_ids: list[int] = field(default_factory=list)  # non-empty when resumed with output already made
    lora_request: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)


@dataclass
class ScheduledRow:
    """One request's share of a step: `token_ids` computed from position `start` on (drafts last), K/V written
    through `block_table` (the whole row: position p lives in block block_table[p // block_size])."""

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    samples: bool  # the last real token (and any drafts) is computed this step: sample after it
    num_output_tokens: int = 0  # for min_tokens
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify (the last len() of token_ids)
    spec_draft_probs: torch.Tensor | None = None  # [K, vocab] the drafts' distributions; None: deterministic drafts
    # prompt_logprobs: the prompt positions [first, last) whose logits score prompt token p + 1
    prompt_logprob_range: tuple[int, int] | None = None
    # structured output: the tokens allowed next, packed int32 words (bit j of word w: token 32 * w + j); None: all
    grammar_bitmask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepInput:
    rows: list[ScheduledRow]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # their per-request state can go (before new ones)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write before the forward
    # disaggregated decode: blocks to fill with KV that the prefill instance computed, before the forward
    kv_loads: list = field(default_factory=list)  # kv_transfer.connector.KVLoad


@dataclass
class SampledRow:
    """What one sampling request emits: accepted drafts, then one token of the target's own."""

    token_ids: list[int]
    logprobs: list  # per emitted token: {token: logprob, ...} or None
    sampled_logprobs: list
    num_accepted: int = 0


@dataclass
class ForwardPass:
    """One forward the step ran: a step may run as several parts, each on a compiled graph or eager."""

    num_tokens: int
    compiled: bool


@dataclass
class StepOutput:
    sampled: dict[str, SampledRow] = field(default_factory=dict)
    forward_passes: list[ForwardPass] = field(default_factory=list)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # entries to append, in order
    # --runner pooling: per request, the hidden-state rows this step adds to what it pools (layers/pooler.py)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
