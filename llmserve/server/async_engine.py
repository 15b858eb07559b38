"""The engine in its own thread, with asyncio queues toward the HTTP layer.

The HTTP side never touches engine state: it posts commands (add, abort) to a thread-safe queue
and receives RequestOutputs on a per-request asyncio.Queue. The engine thread drains commands,
expires timed-out requests, steps, and hands outputs back to the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import RequestStatus
from llmserve.errors import LLMServeError
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(LLMServeError):
    status_code = 503
    error_type = "ServiceUnavailableError"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None
    on_first_output: list = field(default_factory=list)


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two successive cumulative outputs of one request as one: the later's state, with both steps' deltas."""
    previous = {c.index: c for c in earlier.outputs}
    merged = []
    for c in later.outputs:
        before = previous.get(c.index)
        if before is not None and (before.delta_text or before.delta_token_ids):
            c = dataclasses.replace(c, delta_text=before.delta_text + c.delta_text,
                                    delta_token_ids=before.delta_token_ids + c.delta_token_ids)
        merged.append(c)
    return dataclasses.replace(later, outputs=merged)


class AsyncEngine:
    """Give it an LLMEngine, or better a function that builds one: the model is then loaded in the engine
    thread itself, the first thread of the process to run torch ops. On CPU, stepping from a thread other
    than that one measured ~1.5x slower per decode step (benchmarks/engine_thread.py)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], metrics=None):
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(engine,), name="llmserve-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def _main(self, factory) -> None:
        if self.engine is None:
            try:
                self.engine = factory()
            except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
                self._load_error = e
                self._ready.set()
                return
        self._ready.set()
        self._run()

    @property
    def alive(self) -> bool:
        return (self._thread.is_alive() and self.error is None
                and (self.engine is None or self.engine.executor.failure() is None))

    def why_dead(self) -> str:
        failure = self.engine.executor.failure() if self.engine is not None else None
        return f"the engine is not running: {failure}" if failure else "the engine is not running"

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self.engine is not None and not self._thread.is_alive():
            self.engine.shutdown()  # worker processes, if any

    # ---- event-loop side ---------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       timeout: float | None = None, cache_salt: str | None = None, lora_request=None,
                       kv_transfer_params: dict | None = None):
        """Yields RequestOutputs (with deltas) until the request finishes. Closing the generator aborts it."""
        if not self.alive:
            raise EngineDeadError(self.why_dead())
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic() + timeout if timeout else None)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_ids, params, priority, cache_salt, lora_request,
                            kv_transfer_params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                error = None
                while not stream.queue.empty() and not item.finished:
                    # The consumer fell behind (many streams, one event loop): the outputs that queued up meanwhile
                    # go out as one, as vLLM's output collector does, so that a loaded server writes fewer chunks
                    # instead of falling further behind. An error behind them is raised once they are out.
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item = merge_outputs(item, later)
                yield item
                if error is not None:
                    raise error
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def submit(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Runs fn(engine) in the engine thread between steps (the engine is single-threaded); the future holds its
        result or the error it raised. `await asyncio.wrap_future(...)` from the event loop, `.result()` elsewhere."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return future

    # ---- engine thread --------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _deliver_step(self, outputs: list) -> None:
        """A step's outputs, handed to each event loop in one call: a call per output costs the engine thread a
        wake-up write and the loop a callback each (hundreds per step under load)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, priority, salt, lora, order = cmd
                if rid not in self._streams:  # the client left before we got to it
                    continue
                try:
                    self.engine.add_request(rid, ids, params, priority=priority, cache_salt=salt, lora_request=lora,
                                            kv_transfer_params=order)
                except LLMServeError as e:
                    self._deliver(rid, e)
            elif cmd[0] == "call":
                _, fn, future = cmd
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - the caller's error (a 500 if not a user's); the engine goes on
                    future.set_exception(e)
            else:
                out = self.engine.abort_request(cmd[1])
                if out is not None and self.metrics:
                    self.metrics.record_finished(out, self.engine)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, stream in list(self._streams.items()):
            if stream.deadline is not None and now >= stream.deadline:
                stream.deadline = None
                out = self.engine.abort_request(rid, RequestStatus.FINISHED_TIMEOUT)
                if out is not None:
                    if self.metrics:
                        self.metrics.record_finished(out, self.engine)
                    self._deliver(rid, out)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                self._expire()
                if not self.engine.has_unfinished_requests():
                    if self.metrics:
                        self.metrics.update_gauges(self.engine)
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    self.last_step_time = time.monotonic()
                    continue
                outputs = self.engine.step()
                self.last_step_time = time.monotonic()
                if self.metrics:
                    for out in outputs:
                        self.metrics.record_output(out, self.engine)
                self._deliver_step(outputs)
                if self.metrics:
                    self.metrics.update_gauges(self.engine)
        except BaseException as e:  # a bug in the engine: fail every stream, report 503 from then on
            logger.exception("engine thread died")
            self.error = e
            why = e.message if isinstance(e, LLMServeError) else type(e).__name__  # a user-facing reason, or the kind
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine failed: {why}"))
