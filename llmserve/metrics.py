"""Prometheus metrics with vLLM's names (prefix `llmserve:`), labelled by model_name.

With several API-server processes (--api-server-count) each process records what it served into files under
PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode, set before any of them imports it), and /metrics, in
whichever process answers, adds them up. The engine's gauges and the counters read from its snapshots are recorded by
one process only (records_engine_stats), so that they are not counted once per process.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily

from llmserve.outputs import PoolingRequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, L = self.registry, ["model_name"]

        def hist(name, doc):
            return Histogram(f"llmserve:{name}", doc, L, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        def gauge(name, doc, labels=L):
            # set by one process: with several, the collector reports the value set last (else one sample per pid)
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.")
        self.running = gauge("llmserve:num_requests_running", "Requests in the running batch.").labels(model_name)
        self.waiting = gauge("llmserve:num_requests_waiting", "Requests waiting to be scheduled.").labels(model_name)
        self.lora_info = LoRARequestsInfo()
        r.register(self.lora_info)
        self.deterministic = gauge("llmserve:deterministic_mode", "1 when the engine runs batch-invariant (a request's "
                                   "tokens and logprobs do not depend on its batch), else 0.").labels(model_name)
        self.kv_usage = gauge("llmserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).").labels(model_name)
        self.prompt_tokens = Counter("llmserve:prompt_tokens", "Prompt tokens of finished requests.", L, registry=r).labels(model_name)
        self.generation_tokens = Counter("llmserve:generation_tokens", "Generated tokens.", L, registry=r).labels(model_name)
        self.success = Counter("llmserve:request_success", "Finished requests by finish reason.", L + ["finished_reason"], registry=r)
        self.rejected = Counter("llmserve:request_rejected", "Requests refused by admission control.", L + ["reason"], registry=r)
        self.preemptions = Counter("llmserve:num_preemptions", "Preemptions.", L, registry=r).labels(model_name)
        self.cached_prompt_tokens = Counter("llmserve:prompt_tokens_cached", "Prompt tokens served from the prefix cache.", L,
                                            registry=r).labels(model_name)
        self.cost = Counter("llmserve:cost_usd", "Cost of finished requests in USD, by part (input, cached_input, output).",
                            L + ["kind"], registry=r)
        self.pricer = None  # set by the server when it prices requests
        self.prefix_queries = Counter("llmserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", L,
                                      registry=r).labels(model_name)
        self.prefix_hits = Counter("llmserve:prefix_cache_hits", "Prompt tokens found in the prefix cache, by tier "
                                   "(device = the KV pool, host, disk).", L + ["tier"], registry=r)
        self.offload_bytes = gauge("llmserve:kv_offload_bytes", "Bytes of prefix blocks held in each spill tier.", L + ["tier"])
        self._prefix_seen = {"queries": 0, "device": 0, "host": 0, "disk": 0}
        self.spec_drafts = Counter("llmserve:spec_decode_num_drafts", "Verification rounds with drafts.", L, registry=r).labels(model_name)
        self.spec_draft_tokens = Counter("llmserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", L, registry=r).labels(model_name)
        self.spec_accepted = Counter("llmserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", L, registry=r).labels(model_name)
        self.spec_accepted_per_pos = Counter("llmserve:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                             L + ["position"], registry=r)
        self._spec_seen = None
        # disaggregated serving (kv_transfer/connector.py): where prompts were prefilled, what handing KV over cost
        self.kv_transfer_bytes = Counter("llmserve:kv_transfer_bytes", "Bytes of KV sent (prefill instance) or "
                                         "received (decode instance) over the KV link.", L, registry=r).labels(model_name)
        self.kv_transfer_seconds = Counter("llmserve:kv_transfer_seconds", "Seconds spent moving KV over the link.",
                                           L, registry=r).labels(model_name)
        self.kv_transfer_routes = Counter("llmserve:disagg_prefill_requests", "Requests by where their prompt was "
                                          "prefilled: remote (the prefill instance) or bypass (here: fewer uncached "
                                          "tokens than max_local_prefill_length).", L + ["route"], registry=r)
        self.kv_transfer_fallbacks = Counter("llmserve:kv_transfer_fallbacks", "Remote prefills recomputed here "
                                             "instead, by reason.", L + ["reason"], registry=r)
        self.request_kv_transfer = hist("request_kv_transfer_seconds", "Seconds to receive a request's prompt KV.")
        self._kv_seen: dict = {}
        self._last_token: dict[tuple[str, int], float] = {}
        self._preemptions_seen = 0

    def exposition(self) -> bytes:
        """The text /metrics answers: this process's registry, or with several server processes all of theirs."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            registry.register(self.lora_info)  # every process knows the engine's adapters: this one's view
            return generate_latest(registry)
        return generate_latest(self.registry)

    def record_outputs(self, outputs) -> None:
        """One engine step's outputs. The token counter moves once per step: each move takes its lock, and a loaded
        server has hundreds of outputs per step."""
        now = time.monotonic()
        tokens = 0
        last_token = self._last_token
        for out in outputs:
            if isinstance(out, PoolingRequestOutput):  # an embedding: no tokens, one output when it is done
                self.record_finished(out)
                continue
            for c in out.outputs:
                n = len(c.delta_token_ids)
                if not n:
                    continue
                tokens += n
                key = (out.request_id, c.index)
                last = last_token.get(key)
                if last is None:
                    if c.index == 0:
                        self.ttft.observe(now - out.metrics.arrival_time)
                else:
                    self.itl.observe(now - last)
                last_token[key] = now
            if out.finished:
                self.record_finished(out)
        if tokens:
            self.generation_tokens.inc(tokens)

    def record_finished(self, out) -> None:
        m = out.metrics
        now = time.monotonic()
        self.e2e.observe(now - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                self.decode_time.observe((m.last_token_time or m.first_token_time) - m.first_token_time)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cached_prompt_tokens.inc(out.num_cached_tokens)
        if out.kv_transfer is not None and out.kv_transfer.bytes:
            self.request_kv_transfer.observe(out.kv_transfer.seconds)
        if self.pricer is not None:
            cost = self.pricer.cost([out])
            for kind, value in (("input", cost.input), ("cached_input", cost.cached_input), ("output", cost.output)):
                self.cost.labels(self.model_name, kind).inc(value)
        if isinstance(out, PoolingRequestOutput):  # it ends when its prompt has been computed: a stop
            self.success.labels(self.model_name, "stop").inc()
            return
        for c in out.outputs:
            self.success.labels(self.model_name, c.finish_reason or "abort").inc()
            self._last_token.pop((out.request_id, c.index), None)

    def update_gauges(self, stats) -> None:
        """From the engine's snapshot (LLMEngine.stats()): gauges set, counters moved by what changed since the last."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.lora_info.update(stats)
        total = stats.num_preemptions
        if total > self._preemptions_seen:
            self.preemptions.inc(total - self._preemptions_seen)
            self._preemptions_seen = total
        prefix, seen = stats.prefix_cache, self._prefix_seen
        if prefix.queries > seen["queries"]:
            self.prefix_queries.inc(prefix.queries - seen["queries"])
            seen["queries"] = prefix.queries
        for tier, value in prefix.hits.items():
            if value > seen[tier]:
                self.prefix_hits.labels(self.model_name, tier).inc(value - seen[tier])
                seen[tier] = value
        spec = stats.spec_decode
        if spec is not None:
            last = self._spec_seen or (0, 0, 0, [0] * len(spec.accepted_per_position))
            self.spec_drafts.inc(spec.num_drafts - last[0])
            self.spec_draft_tokens.inc(spec.num_draft_tokens - last[1])
            self.spec_accepted.inc(spec.num_accepted_tokens - last[2])
            for pos, (now, before) in enumerate(zip(spec.accepted_per_position, last[3])):
                if now > before:
                    self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(now - before)
            self._spec_seen = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_position))
        if stats.kv_transfer is not None:
            self._update_kv_transfer(stats.kv_transfer)
        for tier, value in stats.offload_bytes.items():
            self.offload_bytes.labels(self.model_name, tier).set(value)

    def _update_kv_transfer(self, stats) -> None:
        now = {"bytes": stats.bytes, "seconds": stats.seconds, "remote": stats.remote_prefills,
               "bypass": stats.bypasses, **{f"fallback:{k}": v for k, v in stats.fallbacks.items()}}
        for key, value in now.items():
            delta = value - self._kv_seen.get(key, 0)
            if delta <= 0:
                continue
            if key == "bytes":
                self.kv_transfer_bytes.inc(delta)
            elif key == "seconds":
                self.kv_transfer_seconds.inc(delta)
            elif key in ("remote", "bypass"):
                self.kv_transfer_routes.labels(self.model_name, key).inc(delta)
            else:
                self.kv_transfer_fallbacks.labels(self.model_name, key.split(":")[1]).inc(delta)
            self._kv_seen[key] = value


class LoRARequestsInfo:
    """vLLM's lora_requests_info gauge: one series, the adapters of the running and waiting requests as its labels
    and the time they became so as its value. A collector of this process's own rather than a Gauge: with several
    server processes a Gauge's series live in files that keep every label set ever written, and the old adapters
    would stay listed. Every process gets the engine's snapshots, so any of them can answer."""

    NAME = "llmserve:lora_requests_info"

    def __init__(self):
        self.labels: tuple[str, str, str] | None = None  # max_lora, running, waiting
        self.since = 0.0

    def update(self, stats) -> None:
        if stats.running_loras is None:  # LoRA off
            return
        labels = (str(stats.max_loras), ",".join(stats.running_loras), ",".join(stats.waiting_loras))
        if labels != self.labels:
            self.labels, self.since = labels, time.time()

    def collect(self):
        family = GaugeMetricFamily(self.NAME, "Adapters of the running and waiting requests.",
                                   labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        if self.labels is not None:
            family.add_metric(list(self.labels), self.since)
        yield family
