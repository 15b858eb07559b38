"""Iteration-level scheduler (continuous batching) with chunked prefill and recompute preemption.

Each step has a token budget. Running requests are served first (a decode needs one token, an
unfinished prefill gets a chunk), then waiting ones are admitted while budget, `max_num_seqs` and
KV blocks allow. There are no separate prefill and decode queues: each request's
`num_computed_tokens` catches up with its `num_tokens`; a request whose scheduled tokens reach the
end samples a token this step. When blocks run out, the lowest-priority (else the newest) running
request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmserve.config import EngineConfig
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.request_queue import make_queue


class ScheduledRequest:
    """A request's share of one step, as decided when it was scheduled (read before the step's output moves the
    request's counters). A plain class: hundreds are made per step."""

    __slots__ = ("request", "num_new_tokens", "is_prefill", "samples")

    def __init__(self, request: Request, num_new_tokens: int):
        self.request = request
        self.num_new_tokens = num_new_tokens
        computed = request.num_computed_tokens
        # Prefill phase: computing prompt (or, after preemption, recomputing history) tokens beyond the last one.
        self.is_prefill = computed < request.num_tokens - 1
        # The last prompt/history token (and any drafts) are computed this step, so tokens are sampled.
        self.samples = computed + num_new_tokens == request.num_tokens_with_spec


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_seqs: int = 0
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (KV pool too small)

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = make_queue(config.scheduling_policy, config.priority_aging_seconds)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.connector = None  # disaggregated serving's KV connector (kv_transfer/connector.py), set by the engine

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)  # its full blocks stay in the prefix cache: recompute may find them again
        victim.num_computed_tokens = 0
        victim.num_cached_blocks = 0
        victim.spec_token_ids, victim.spec_draft_probs = [], None
        victim.pooled_parts = []  # recomputed from the start, so pooled again
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # vLLM's long_prefill_token_threshold: a prompt's chunk per step is at most this (0: the budget), so that a
        # long prompt cannot take a whole step while other prompts wait
        chunk_cap = self.config.long_prefill_token_threshold or budget

        pool_tokens = self.kv.num_blocks * self.kv.block_size

        # 1. Running requests, oldest first.
        for req in list(self.running):
            if req.status is RequestStatus.PREEMPTED or budget <= 0:
                req.spec_token_ids, req.spec_draft_probs = [], None
                continue
            if req.num_placeholders and req.ends_with_placeholders(self.max_model_len):
                continue  # async scheduling: it ends with the tokens in flight
            if req.spec_token_ids:  # drafts only ride along when the whole rest fits this step
                room = budget - (req.num_tokens - req.num_computed_tokens)
                if room < len(req.spec_token_ids):
                    req.spec_token_ids = req.spec_token_ids[: max(room, 0)]
                    req.spec_draft_probs = req.spec_draft_probs[: max(room, 0)] if req.spec_draft_probs is not None else None
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if num_new > chunk_cap and not req.spec_token_ids:  # a prefill chunk (a decode row with drafts is not)
                num_new = chunk_cap
            if req.num_computed_tokens + num_new > pool_tokens:
                # Even the whole pool cannot hold this sequence: end it, as at the context limit.
                self.finish(req, RequestStatus.FINISHED_LENGTH)
                out.finished.append(req)
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self._pick_victim()
                undone = next((s for s in out.scheduled if s.request is victim), None)
                if undone is not None:  # already in this step's batch: give its tokens back
                    out.scheduled.remove(undone)
                    budget += undone.num_new_tokens
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new

        # 2. Waiting requests, unless this step had to preempt (the pool is full). A request whose adapter would be
        # one more than max_loras in the running set waits (others behind it may go), as in vLLM.
        adapters = {r.lora_int_id for r in self.running if r.lora_int_id} if self.config.enable_lora else set()
        skipped: list[Request] = []
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting.peek()
                if req.lora_int_id and req.lora_int_id not in adapters and len(adapters) >= self.config.max_loras:
                    skipped.append(self.waiting.pop())
                    continue
                if self.connector is not None and self.connector.is_waiting(req):  # its KV is on the way
                    skipped.append(self.waiting.pop())
                    continue
                hit = 0
                if req.num_computed_tokens == 0:  # fresh or preempted: start from the longest cached prefix
                    hit = req.num_computed_tokens = self.kv.get_computed_blocks(req)
                # tokens whose KV another instance computed (disaggregated prefill): loaded, not computed
                external = self.connector.get_num_new_matched_tokens(req, hit) if self.connector and hit == \
                    req.num_computed_tokens else 0
                num_new = min(req.num_tokens - req.num_computed_tokens - external, budget, chunk_cap)
                if not self.kv.allocate_slots(req, external + num_new):
                    if hit:  # give the hit blocks back (they stay cached); looked up again next time
                        self.kv.free(req)
                        req.num_computed_tokens = req.num_cached_blocks = 0
                    break
                if self.connector is not None:
                    bs, table = self.kv.block_size, self.kv.block_tables[req.request_id]
                    loaded = table[req.num_computed_tokens // bs: -(-(req.num_computed_tokens + external) // bs)]
                    self.connector.update_state_after_alloc(req, loaded if external else [], external,
                                                            req.num_computed_tokens)
                    req.num_computed_tokens += external
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = hit
                self.waiting.pop()
                req.status = RequestStatus.RUNNING
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                if req.lora_int_id:
                    adapters.add(req.lora_int_id)
        for req in reversed(skipped):  # back in their places, ahead of what arrived after them
            self.waiting.prepend(req)

        for s in out.scheduled:
            if s.is_prefill:
                out.num_prefill_tokens += s.num_new_tokens
                out.num_prefill_seqs += 1
            else:
                out.num_decode_tokens += s.num_new_tokens
        return out

    def launched(self, out: SchedulerOutput) -> None:
        """Async scheduling: the step is on the device, its tokens not yet known. Its requests' counters move now,
        so that the next step can be scheduled at once; each row that samples leaves a placeholder token, which the
        next step reads on the device."""
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            req.num_inflight_tokens += s.num_new_tokens
            if s.samples:
                req.num_placeholders += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           launched: bool = False) -> list[Request]:
        """Advance counters (unless `launched` moved them already), append sampled tokens, finish stopped requests.
        Returns requests with new tokens.

        A speculating request emits its accepted drafts plus one token; the KV of rejected drafts is rolled
        back (its slots are free to be overwritten, and blocks beyond the verified tokens go back to the pool),
        and stops are checked token by token, so nothing after a stop is kept."""
        updated = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # ended while the step computed (async output processing: a stop string)
                continue
            tokens = sampled.get(req.request_id)
            if launched:  # its placeholder becomes the token; the blocks it completed can be cached
                req.num_inflight_tokens -= s.num_new_tokens
                req.num_placeholders -= bool(s.samples)
                self.kv.cache_blocks(req, req.num_computed_tokens - req.num_inflight_tokens)
            else:
                rejected = len(req.spec_token_ids) - (len(tokens) - 1) if tokens and req.spec_token_ids else 0
                req.num_computed_tokens += s.num_new_tokens - rejected
                req.spec_token_ids, req.spec_draft_probs = [], None
                if rejected:
                    self.kv.trim(req, req.num_computed_tokens)
                self.kv.cache_blocks(req)
            req.num_new_output_tokens = 0
            if tokens is None:
                continue
            for token in tokens:
                req.append_output_token(token)
                req.num_new_output_tokens += 1
                if req.check_stop(self.max_model_len):
                    self.finish(req, req.status)
                    break
            updated.append(req)
        return updated

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        if self.connector is not None and self.connector.request_finished(req, self.kv.block_tables.get(req.request_id, [])):
            return  # its blocks are held until the connector has sent them (engine: get_finished)
        self.kv.free(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
