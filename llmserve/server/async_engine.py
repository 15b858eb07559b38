"""The server's handle on the engine: requests in, a stream of RequestOutputs per request out.

The HTTP side never touches engine state. It posts commands (add, abort, call) to the engine loop
(engine_loop.py) and receives each request's outputs on an asyncio.Queue. Here the loop runs in a
thread of this process; engine_process.py runs it in a process of its own, behind the same interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from llmserve.errors import LLMServeError
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.engine_loop import AbortRequest, AddRequest, CallEngine, EngineLoop, StopLoop

if TYPE_CHECKING:  # an API-server process (api_servers.py) imports this module and never loads torch
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineDeadError(LLMServeError):
    status_code = 503
    error_type = "ServiceUnavailableError"
    code = "engine_dead"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


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


class EngineClient:
    """What the HTTP side holds: each request's stream of outputs, and commands to the engine loop. Subclasses say
    where the loop runs (AsyncEngine: a thread here; EngineProcessClient: a process of its own) and implement
    _post, alive, why_dead, shutdown and the model's facts (tokenizer, model_config, model_name, max_model_len, sampling_defaults,
    max_logprobs, deterministic, structured, task). The loop's side calls the on_* methods (the EngineSink)."""

    def __init__(self, metrics=None):
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self.error: str | None = None  # why the engine stopped, once it has
        self.last_step_time = time.monotonic()
        # the engine's gauges and snapshot counters go to metrics here; with several server processes, in one only
        self.records_engine_stats = True

    def _post(self, command) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def why_dead(self) -> str:
        return f"the engine is not running: {self.error}" if self.error else "the engine is not running"

    # ---- event-loop side (EngineClient) ---------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       timeout: float | None = None, cache_salt: str | None = None, lora_request=None,
                       kv_transfer_params: dict | None = None):
        """Yields RequestOutputs (with deltas) until the request finishes. Closing the generator aborts it."""
        if not self.alive:
            raise EngineDeadError(self.why_dead())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._post(AddRequest(request_id, prompt_ids, params, priority, cache_salt, lora_request, kv_transfer_params,
                              time.monotonic() + timeout if timeout else None))
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
        self._post(AbortRequest(request_id))

    def call(self, method: str, *args) -> concurrent.futures.Future:
        """engine.<method>(*args), run by the engine loop between steps (the engine is single-threaded); the future
        holds its result or the error it raised. `await asyncio.wrap_future(...)` from the event loop, `.result()`
        elsewhere."""
        if not self.alive:
            raise EngineDeadError(self.why_dead())
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(CallEngine(method, args, _reply_to(future)))
        return future

    # ---- the engine's side (EngineSink) ---------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one call: a call per output costs a wake-up write and the
        loop a callback each (hundreds per step under load)."""
        self.last_step_time = time.monotonic()
        if self.metrics is not None:
            self.metrics.record_outputs(outputs)
        streams = self._streams
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def on_stats(self, stats: EngineStats) -> None:
        self.last_step_time = time.monotonic()
        if self.metrics is not None:
            if self.records_engine_stats:
                self.metrics.update_gauges(stats)
            else:  # another server process records the engine's gauges; each keeps which adapters run
                self.metrics.lora_info.update(stats)

    def on_request_error(self, request_id: str, error: LLMServeError) -> None:
        self._deliver(request_id, error)

    def on_request_dropped(self, request_id: str) -> None:
        pass  # its stream closed when the client aborted it

    def on_engine_failed(self, reason: str) -> None:
        """Fails every stream; 503 from then on. The first reason stays (a failure report, then the process's end)."""
        if self.error is None:
            self.error = reason
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(reason))


class AsyncEngine(EngineClient):
    """The engine stepped by a thread of this process. Give it an LLMEngine, or better a function that builds one:
    the model is then loaded in the engine thread itself, the first thread of the process to run torch ops. On CPU,
    stepping from a thread other than that one measured ~1.5x slower per decode step (benchmarks/engine_thread.py)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], metrics=None):
        super().__init__(metrics)
        self.engine: LLMEngine | None = engine if hasattr(engine, "step") else None  # else a function making one
        self._loop: EngineLoop | None = None
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
        self._loop = EngineLoop(self.engine, self)
        self._ready.set()
        self._loop.run()

    # ---- what the HTTP side reads about the model -----------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def sampling_defaults(self) -> dict:
        return self.engine.sampling_defaults

    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def task(self) -> str:
        """"generate", "embed" or "classify": what the engine does (--runner, as the engine settled it)."""
        return self.engine.task

    @property
    def deterministic(self) -> bool:
        return self.engine.executor.info.deterministic

    @property
    def structured(self):
        """Compiles grammars on the HTTP side, so that a bad one is a 400 before the request reaches the engine."""
        return self.engine.structured

    # ---- life ---------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return (self._thread.is_alive() and self.error is None
                and (self.engine is None or self.engine.executor.failure() is None))

    def why_dead(self) -> str:
        failure = self.engine.executor.failure() if self.engine is not None else None
        return f"the engine is not running: {failure}" if failure else super().why_dead()

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.post(StopLoop())
        self._thread.join(timeout=10)
        if self.engine is not None and not self._thread.is_alive():
            self.engine.shutdown()  # worker processes, if any

    def _post(self, command) -> None:
        self._loop.post(command)


def _reply_to(future: concurrent.futures.Future) -> Callable[[object, BaseException | None], None]:
    def reply(result, error):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    return reply
