"""Results in vLLM's shape: outputs[i].outputs[0].text / .token_ids / .finish_reason."""

from __future__ import annotations

from dataclasses import dataclass, field


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
