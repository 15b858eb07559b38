"""Request state as plain integer counters, so that scheduling reads as arithmetic."""

from __future__ import annotations

import enum
import time

from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"

    finished: bool  # set on each member below: a plain attribute, read for every row of every step


for _status in RequestStatus:
    _status.finished = _status.name.startswith("FINISHED")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: list[int],
                 priority: int = 0, arrival_time: float | None = None, prompt: str | None = None,
                 cache_salt: str | None = None, lora_request=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose K/V are in the cache. Catches up with num_tokens: prefill, chunked prefill,
        # recompute after preemption and decode are all this one counter moving.
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Prefix cache: the salt and adapter enter every block hash; the chain of full-block hashes is
        # computed once; num_cached_tokens is what the first scheduling found cached (for usage).
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # LoRARequest or None (the base model)
        self.block_hashes: list = []
        self.num_cached_blocks = 0  # leading blocks of this request's table already in the prefix cache
        self.num_cached_tokens: int | None = None
        # Speculative decoding: drafts waiting to be verified next step (never part of all_token_ids until
        # accepted), the distributions they were drawn from (None: deterministic guesses), and a running
        # estimate of how often this request's drafts survive, which sets how many it gets.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs = None
        self.spec_acceptance = 0.7
        # Structured output: where the request is in its grammar (structured/manager.py GrammarMatcher), or None.
        self.grammar = None
        self.num_new_output_tokens = 0  # appended by the last step (more than one after accepted drafts)
        # Async scheduling: tokens sampled by steps in flight, not yet on the host (counted in num_tokens: the next
        # step computes them, reading them on the device), and this request's tokens in those steps (their KV may
        # still be being written: not for the prefix cache yet).
        self.num_placeholders = 0
        self.num_inflight_tokens = 0
        # disaggregated serving: what an order from a decode instance asked of this prefill (transfer id, skipped
        # tokens), and how this request's prompt KV was handed over (kv_transfer/connector.py TransferRecord)
        self.kv_transfer_params: dict | None = None
        self.kv_transfer = None
        # Wall time of the steps this request ran in, split by the share of tokens it had in each.
        self.prefill_compute_seconds = 0.0
        self.decode_compute_seconds = 0.0
        # --runner pooling: what the request asks of its embedding (PoolingParams; None: it samples tokens), and the
        # hidden-state rows computed for it so far (layers/pooler.py), reduced once its prompt has been computed
        self.pooling_params = None
        self.pooled_parts: list = []
        self.stop_reason: int | str | None = None
        # the last token is EOS or one of stop_token_ids: as in vLLM, its text is not part of the output unless
        # include_stop_str_in_output (with skip_special_tokens=False, "</s>" would otherwise end every answer)
        self.ended_by_stop_token = False
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        # First prompt token has no logprob (None); filled by the model runner as the prompt is computed.
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if params.prompt_logprobs is not None else None
        self.parent_id = request_id  # the user's request id (differs from request_id for n > 1)
        self.index = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + self.num_placeholders + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def ends_with_placeholders(self, max_model_len: int) -> bool:
        """Async scheduling: the tokens in flight reach max_tokens or the context end, so the request ends when they
        arrive (scheduling it again would compute a token to drop)."""
        return bool(self.num_placeholders) and (
            len(self.output_token_ids) + self.num_placeholders >= self.params.max_tokens
            or len(self.all_token_ids) + self.num_placeholders >= max_model_len)

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stopping (EOS, stop ids, max_tokens, context end); stop strings are the detokenizer's."""
        last = self.output_token_ids[-1]
        num_output = len(self.output_token_ids)
        p = self.params
        if num_output >= p.min_tokens:
            if last in self.eos_token_ids:
                self.status, self.ended_by_stop_token = RequestStatus.FINISHED_STOPPED, True
                return True
            if last in p.stop_token_ids:
                self.status, self.stop_reason, self.ended_by_stop_token = RequestStatus.FINISHED_STOPPED, last, True
                return True
        if self.grammar is not None and self.grammar.is_finished:  # the grammar took its end (EOS even under ignore_eos)
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if num_output >= p.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
