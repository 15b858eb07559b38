"""The loop that drives an LLMEngine for a server: commands in, steps, outputs out.

It runs in a thread of the server's process (AsyncEngine) or alone in a process of its own (engine_process.py), where
the HTTP side's Python cannot hold the GIL while a step waits for it. Either way the loop owns the engine: nothing
else touches it while the loop runs, and everything it produces goes to a sink.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from llmserve.engine.request import RequestStatus
from llmserve.errors import LLMServeError
from llmserve.lora.request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.stat_logger import StatLogger

if TYPE_CHECKING:  # the engine's process has it loaded; an API-server process (api_servers.py) loads no torch
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)

# How often a busy engine reports its gauges and counters (/metrics). Every step would cost a snapshot per step;
# an idle engine reports at each wake-up, which is also the server's sign that the loop is alive.
STATS_INTERVAL = 0.05
IDLE_WAIT = 0.05


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict | None = None
    deadline: float | None = None  # time.monotonic(), one clock for all processes of a machine


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class CallEngine:
    """engine.<method>(*args) between two steps, or method(*args) where it is a function (the engine process's own
    bookkeeping, which must not run beside a step either); reply(result, error) gets the outcome."""

    method: str | Callable
    args: tuple
    reply: Callable[[object, BaseException | None], None]


@dataclass
class StopLoop:
    pass


class GrammarEngineError(LLMServeError):
    """The grammar engine failed on a grammar the server had already compiled: a bug there, not the user's."""

    status_code = 500
    error_type = "InternalServerError"


@dataclass
class _GrammarCompiled:
    """From the loop's compiler thread: the request, its grammar now compiled (or the error that refused it)."""

    add: AddRequest
    error: LLMServeError | None


class EngineSink(Protocol):
    """Where the loop's products go. Called from the loop's thread."""

    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...

    def on_stats(self, stats: EngineStats) -> None: ...

    def on_request_error(self, request_id: str, error: LLMServeError) -> None: ...

    def on_request_dropped(self, request_id: str) -> None:
        """An aborted request that never joined the engine (its grammar was compiling): no output will come for it."""

    def on_engine_failed(self, reason: str) -> None: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, sink: EngineSink,
                 admit: Callable[[AddRequest], LLMServeError | None] | None = None):
        """admit: a last check of each request as it joins the engine, in the loop's thread (an error refuses it)."""
        self.engine = engine
        self.sink = sink
        self.admit = admit
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._deadlines: dict[str, float] = {}
        self._stats_time = 0.0
        # Requests whose grammar is compiled off the loop, so that no step waits for it. A grammar arrives uncompiled
        # when the server runs in another process (a compiled one cannot be pickled; the server compiled it there
        # only to refuse a bad one early). A compile takes milliseconds, mostly outside the GIL; an engine whose
        # tokenizer is not yet indexed for grammars takes ~0.4 s more (a server indexes it while it starts). As vLLM's
        # requests waiting for their grammar do, they join the engine when it is ready; an abort meanwhile drops them.
        self._compiling: set[str] = set()
        self._compiler: ThreadPoolExecutor | None = None
        self._stat_logger = StatLogger() if engine.config.log_stats else None

    def post(self, command) -> None:
        """Any thread: a command for the loop, run before its next step."""
        self._inbox.put(command)
        self._wake.set()

    def run(self) -> None:
        """Until a StopLoop command; a failure of the engine is reported to the sink and ends the loop."""
        engine, sink = self.engine, self.sink
        try:
            while not self._stop:
                self._drain_commands()
                if self._deadlines:
                    self._expire()
                failure = engine.executor.failure()
                if failure is not None:  # a worker process died: no step can run any more
                    sink.on_engine_failed(failure)
                    return
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(engine)
                if not engine.has_unfinished_requests():
                    sink.on_stats(engine.stats())
                    self._wake.wait(timeout=IDLE_WAIT)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                if self._deadlines:
                    for out in outputs:
                        if out.finished:
                            self._deadlines.pop(out.request_id, None)
                sink.on_outputs(outputs)
                now = time.monotonic()
                if now - self._stats_time >= STATS_INTERVAL:
                    self._stats_time = now
                    sink.on_stats(engine.stats())
        except BaseException as e:  # a bug in the engine: the sink fails every stream
            logger.exception("the engine loop died")
            sink.on_engine_failed(f"the engine failed: {e.message if isinstance(e, LLMServeError) else type(e).__name__}")

    def _drain_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                spec = cmd.params.structured_outputs
                if spec is not None and spec.compiled is None:
                    self._compile_then_add(cmd)
                else:
                    self._add(cmd)
            elif isinstance(cmd, _GrammarCompiled):
                rid = cmd.add.request_id
                if rid not in self._compiling:  # aborted meanwhile
                    self.sink.on_request_dropped(rid)
                    continue
                self._compiling.discard(rid)
                if cmd.error is not None:
                    self.sink.on_request_error(rid, cmd.error)
                else:
                    self._add(cmd.add)
            elif isinstance(cmd, AbortRequest):
                self._compiling.discard(cmd.request_id)
                self._deadlines.pop(cmd.request_id, None)
                out = engine.abort_request(cmd.request_id)
                if out is not None:
                    self.sink.on_outputs([out])
            elif isinstance(cmd, CallEngine):
                try:
                    method = cmd.method if callable(cmd.method) else getattr(engine, cmd.method)
                    result = method(*cmd.args)
                except Exception as e:  # noqa: BLE001 - the caller's error (a 500 if not a user's); the engine goes on
                    cmd.reply(None, e)
                else:
                    cmd.reply(result, None)
            elif isinstance(cmd, StopLoop):
                self._stop = True
                if self._compiler is not None:
                    self._compiler.shutdown(wait=False, cancel_futures=True)
            else:
                raise TypeError(f"unknown engine command {cmd!r}")

    def _add(self, cmd: AddRequest) -> None:
        if self.admit is not None:
            error = self.admit(cmd)
            if error is not None:
                self.sink.on_request_error(cmd.request_id, error)
                return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, priority=cmd.priority,
                                    cache_salt=cmd.cache_salt, lora_request=cmd.lora_request,
                                    kv_transfer_params=cmd.kv_transfer_params)
        except LLMServeError as e:
            self.sink.on_request_error(cmd.request_id, e)
            return
        if cmd.deadline is not None:
            self._deadlines[cmd.request_id] = cmd.deadline

    def _compile_then_add(self, add: AddRequest) -> None:
        """Compile the request's grammar in the compiler thread, which posts it back to the loop when done (the engine
        then finds the grammar attached). Its deadline counts from when the server sent it."""
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="llmserve-grammar")
        self._compiling.add(add.request_id)
        structured = self.engine.structured

        def compile_grammar():
            try:
                structured.compile(add.params.structured_outputs)
            except LLMServeError as e:
                self.post(_GrammarCompiled(add, e))
            except Exception as e:  # noqa: BLE001 - a bug in the grammar engine fails this request, not the loop
                logger.exception("compiling a grammar failed")
                self.post(_GrammarCompiled(add, GrammarEngineError(f"the grammar failed to compile in the engine: "
                                                                    f"{type(e).__name__}; see the server log")))
            else:
                self.post(_GrammarCompiled(add, None))

        self._compiler.submit(compile_grammar)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, deadline in list(self._deadlines.items()):
            if now >= deadline:
                del self._deadlines[rid]
                out = self.engine.abort_request(rid, RequestStatus.FINISHED_TIMEOUT)
                if out is not None:
                    self.sink.on_outputs([out])
