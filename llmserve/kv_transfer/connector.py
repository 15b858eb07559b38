"""Disaggregated prefill and decode: the KV connector, in the shape of vLLM's (scheduler side and worker side).

A decode instance takes every request. For each new one it decides where the prompt is prefilled:
- **bypass**: the uncached part of the prompt (after the decode side's own prefix-cache hits) is shorter than
  `max_local_prefill_length`: the decode instance prefills it itself, as a colocated server would (Dynamo's
  conditional disaggregation); shipping a short prompt's KV costs more than computing it;
- **remote**: it orders the prefill instance (an HTTP completion with `kv_transfer_params`, as vLLM's P/D proxy
  sends) to compute the prompt and send the KV of positions [skip, P-1) over the KV link, where `skip` is what the
  decode side already holds in its prefix cache (hits shrink what is sent). The request waits, out of the running
  batch, until the KV has arrived; then its blocks are allocated, the KV is written into them before the next
  forward, and the decode side computes only the last prompt token (whose logits it samples the first token from,
  with the request's own sampling parameters and seed). A transfer that fails (prefill instance down, link broken,
  checksum mismatch, nothing after KV_WAIT_TIMEOUT_S) falls back to local prefill: slower, never wrong.

A prefill instance computes ordered prompts and, when such a request finishes, holds its blocks until the sender
thread has read and sent them (`request_finished` returns True; `get_finished` hands them back to be freed).

Scheduler side (engine thread): on_new_request, get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, request_finished, get_finished. Worker side (model runner): register_kv_caches,
start_load_kv (writes the step's loads before the forward; on CPU the copy is done when it returns, so
wait_for_layer_load has nothing to wait for), and for the prefill role the blocks are read whole after the request
finished (vLLM saves layer by layer during the forward to overlap with compute; a CPU has no copy engine to
overlap with).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import httpx
import torch

from llmserve.engine.stats import ConnectorStats
from llmserve.kv_transfer.link import KVLayout, KVLink

logger = logging.getLogger(__name__)

KV_WAIT_TIMEOUT_S = 120.0  # a remote prefill that has not delivered by then is recomputed locally
ORDER_TIMEOUT_S = 600.0


@dataclass
class KVLoad:
    """Plain data in the step input: blocks to fill before the forward, and their KV ([blocks, layers, 2,
    block_size, kv_heads, head_dim])."""

    block_ids: list[int]
    payload: torch.Tensor


@dataclass
class TransferRecord:
    """What a request's prompt cost to hand over, for its usage and /metrics."""

    prefilled_remotely: bool
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Transfer:
    transfer_id: int
    request_id: str
    skip_tokens: int  # positions the decode side had cached when it ordered: not sent
    ordered_at: float
    state: str = "ordered"  # ordered -> arrived | failed
    payload: torch.Tensor | None = None
    bytes: int = 0
    seconds: float = 0.0


class KVConnectorWorker:
    """The worker side: the KV tensors it writes loaded blocks into."""

    def __init__(self):
        self.kv = None

    def register_kv_caches(self, kv_tensors) -> None:
        self.kv = kv_tensors

    def start_load_kv(self, loads: list[KVLoad]) -> None:
        for load in loads:
            for i, block in enumerate(load.block_ids):
                self.kv.write_block(block, load.payload[i])

    def wait_for_layer_load(self, layer: int) -> None:
        """Every load is written before the forward starts (start_load_kv is synchronous on CPU)."""


class DisaggConnector:
    """The scheduler side of one instance, prefill or decode, with the KV link to its peer."""

    def __init__(self, config, engine, layout: KVLayout, device: torch.device):
        self.role = config.kv_role
        self.block_size = config.block_size
        self.engine = engine
        self.link = KVLink(self.role, config.kv_link, layout, device)
        self.layout = layout
        self.stats = ConnectorStats()
        self._lock = threading.Lock()
        self.threshold = config.max_local_prefill_length
        # decode side: transfers ordered, by request id and by transfer id; loads for the next step
        self._transfers: dict[str, _Transfer] = {}
        self._by_id: dict[int, _Transfer] = {}
        self._loads: list[KVLoad] = []
        # prefill side: requests whose blocks are held until sent, by transfer id; and those sent
        self._held: dict[int, object] = {}
        self._sent: queue.SimpleQueue = queue.SimpleQueue()
        if self.role == "decode":
            self.prefill_url = config.prefill_url.rstrip("/")
            self._ids = itertools.count(1)
            self._orders: queue.SimpleQueue = queue.SimpleQueue()
            self._http = httpx.Client(timeout=ORDER_TIMEOUT_S)
            self.prefill_model = self._prefill_model_name()
            if self.threshold is None:
                self.threshold = default_bypass_threshold(engine, self.link.bandwidth_bytes_per_s)
            for i in range(4):  # orders wait for their prefill: several in flight keep the prefill side busy
                threading.Thread(target=self._order_loop, name=f"llmserve-kv-order{i}", daemon=True).start()
            self.link.start_receiver(self._on_received)
            logger.info("disaggregated decode: prefill at %s, KV link %.2f GB/s measured, prompts with fewer than "
                        "%d uncached tokens prefilled here", self.prefill_url, self.link.bandwidth_bytes_per_s / 1e9,
                        self.threshold)
        else:
            self.link.start_sender(self._on_sent)
            logger.info("disaggregated prefill: KV link %.2f GB/s measured", self.link.bandwidth_bytes_per_s / 1e9)

    # ---- decode side ---------------------------------------------------------------------------------
    def _prefill_model_name(self) -> str:
        """The prefill instance's model name, from its /v1/models (its server may start a moment after the link)."""
        deadline, error = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            try:
                r = self._http.get(self.prefill_url + "/v1/models", timeout=10)
                r.raise_for_status()
                return r.json()["data"][0]["id"]
            except httpx.HTTPStatusError as e:
                error = e
                break
            except httpx.HTTPError as e:
                error = e
                time.sleep(0.2)
        from llmserve.errors import InvalidRequestError

        raise InvalidRequestError(f"cannot reach the prefill instance at {self.prefill_url}: {error}", "prefill_url")

    def on_new_request(self, request) -> None:
        """Decides where the prompt is prefilled (engine thread, when the request is added)."""
        if request.prompt_logprobs is not None or request.lora_request is not None:
            return  # scored prompts and adapters are computed where they are served
        cached = self.engine.kv.num_cached_prefix_tokens(request)
        uncached = request.num_tokens - cached
        if uncached < self.threshold or self.link.error is not None:
            self.stats.bypasses += 1
            request.kv_transfer = TransferRecord(prefilled_remotely=False)
            return
        transfer = _Transfer(next(self._ids), request.request_id, cached, time.monotonic())
        with self._lock:
            self._transfers[request.request_id] = transfer
            self._by_id[transfer.transfer_id] = transfer
        self.stats.remote_prefills += 1
        request.kv_transfer = TransferRecord(prefilled_remotely=True)
        self._orders.put((transfer, list(request.prompt_token_ids), request.cache_salt, request.priority))

    def _order_loop(self) -> None:
        while True:
            transfer, prompt, salt, priority = self._orders.get()
            body = {"model": self.prefill_model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "priority": priority,
                    "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer.transfer_id,
                                           "skip_tokens": transfer.skip_tokens}}
            if salt is not None:
                body["cache_salt"] = salt
            try:
                r = self._http.post(self.prefill_url + "/v1/completions", json=body)
                ok, why = r.status_code == 200, r.text[:200]
            except httpx.HTTPError as e:
                ok, why = False, str(e)
            if not ok:
                logger.warning("remote prefill of transfer %d failed (%s): prefilling locally", transfer.transfer_id,
                               why)
                self._fail(transfer, "order_failed")

    def _fail(self, transfer: _Transfer, reason: str) -> None:
        with self._lock:
            if transfer.state == "ordered":
                transfer.state = "failed"
                self.stats.fallbacks[reason] += 1

    def _on_received(self, transfer_id: int, payload, nbytes: int, seconds: float) -> None:
        with self._lock:
            transfer = self._by_id.get(transfer_id)
            if transfer is None or transfer.state != "ordered":
                return  # its request was aborted or already fell back
            if payload is None:
                transfer.state = "failed"
                self.stats.fallbacks["checksum" if nbytes else "order_failed"] += 1
                return
            transfer.state, transfer.payload = "arrived", payload
            transfer.bytes, transfer.seconds = nbytes, seconds
            self.stats.bytes += nbytes
            self.stats.seconds += seconds

    def is_waiting(self, request) -> bool:
        """The request's KV is on its way: leave it out of this step (others behind it may go)."""
        transfer = self._transfers.get(request.request_id) if self.role == "decode" else None
        if transfer is None or transfer.state != "ordered":
            return False
        if self.link.error is not None:
            self._fail(transfer, "link")
        elif time.monotonic() - transfer.ordered_at > KV_WAIT_TIMEOUT_S:
            logger.warning("transfer %d: no KV after %.0f s: prefilling locally", transfer.transfer_id,
                           KV_WAIT_TIMEOUT_S)
            self._fail(transfer, "timeout")
        return transfer.state == "ordered"

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Prompt tokens beyond the local hits whose KV arrived (0: compute them here). No state changes, so a
        request that cannot be allocated this step asks again."""
        transfer = self._transfers.get(request.request_id) if self.role == "decode" else None
        if transfer is None:
            return 0
        if transfer.state == "failed" or num_computed_tokens < transfer.skip_tokens:
            if transfer.state == "arrived":  # the cached blocks it counted on were evicted meanwhile
                with self._lock:
                    self.stats.fallbacks["evicted"] += 1
            self._drop(request.request_id)
            return 0
        return max(request.num_tokens - 1 - num_computed_tokens, 0)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int,
                                 num_computed_tokens: int) -> None:
        """The blocks for tokens [num_computed, num_computed + num_external) are allocated: load them next step."""
        if self.role != "decode":
            return
        transfer = self._drop(request.request_id)
        if transfer is None or not num_external_tokens:
            return
        first = (num_computed_tokens - transfer.skip_tokens) // self.block_size
        self._loads.append(KVLoad(block_ids, transfer.payload[first:first + len(block_ids)]))
        request.kv_transfer.bytes, request.kv_transfer.seconds = transfer.bytes, transfer.seconds

    def build_connector_meta(self) -> list[KVLoad]:
        loads, self._loads = self._loads, []
        return loads

    def _drop(self, request_id: str) -> _Transfer | None:
        with self._lock:
            transfer = self._transfers.pop(request_id, None)
            if transfer is not None:
                self._by_id.pop(transfer.transfer_id, None)
        return transfer

    # ---- prefill side ------------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> bool:
        """True: hold the request's blocks until they are sent (prefill side, a completed remote prefill)."""
        if self.role == "decode":
            self._drop(request.request_id)
            return False
        params = request.kv_transfer_params
        if not params or request.status.name == "FINISHED_ABORTED" or not block_ids:
            return False
        skip_blocks = params["skip_tokens"] // self.block_size
        last_block = -(-(request.num_prompt_tokens - 1) // self.block_size)  # up to position P-2
        blocks = list(block_ids[skip_blocks:last_block])
        transfer_id = params["transfer_id"]
        with self._lock:
            self._held[transfer_id] = request
        read_block = self.engine.executor.read_block
        self.link.send(transfer_id, lambda: torch.stack([read_block(b) for b in blocks]) if blocks else
                       torch.empty((0, *self.layout.block_shape), dtype=self.layout.torch_dtype))
        return True

    def _on_sent(self, transfer_id: int, nbytes: int, seconds: float | None) -> None:
        with self._lock:
            request = self._held.pop(transfer_id, None)
            if seconds is not None:
                self.stats.bytes += nbytes
                self.stats.seconds += seconds
        if request is not None:
            request.kv_transfer = TransferRecord(True, nbytes, seconds or 0.0)
            self._sent.put(request)

    def get_finished(self) -> list:
        """Requests whose held blocks were sent: the engine frees them."""
        if self.role == "decode":
            return []
        done = []
        while True:
            try:
                done.append(self._sent.get_nowait())
            except queue.Empty:
                return done

    def has_pending(self) -> bool:
        """Blocks held for a transfer, or sent and not yet handed back to be freed."""
        return self.role == "prefill" and (bool(self._held) or not self._sent.empty())

    def close(self) -> None:
        self.link.close()


def default_bypass_threshold(engine, link_bytes_per_s: float) -> int:
    """`llmserve plan`'s arithmetic for this model, this CPU and the measured link: prompts shorter than this are
    faster to prefill on the decode instance than to hand over (a remote prefill's fixed handoff plus the KV's
    transfer)."""
    from llmserve.plan.estimate import PlanInputs, Planner
    from llmserve.plan.hardware import measure_cpu
    from llmserve.plan.models import load_spec

    hardware = measure_cpu(0.3)
    spec = load_spec(engine.model_path)
    kv_format = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}.get(engine.executor.info.kv_dtype, "FP8")
    planner = Planner(PlanInputs(spec=spec, hardware=hardware, kv_format=kv_format,
                                 link_gbps=link_bytes_per_s * 8 / 1e9))
    threshold = planner.bypass_threshold()
    return 1 << 30 if threshold is None else threshold
