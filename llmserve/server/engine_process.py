"""The engine in a process of its own, as vLLM runs its engine core: the server's process keeps HTTP, streams and
metrics; the engine process keeps scheduling, the model, sampling and detokenizing.

Why: in one process the engine thread and the event loop share the GIL. Under many streams the event loop has
Python to run all the time (a chunk per stream per step), and the engine thread gives up the GIL at every torch
call, then waits up to the interpreter's switch interval (5 ms) to get it back, many times per step. A GPU step of a
few milliseconds then waits mostly on the HTTP side. In its own process the loop never waits on HTTP.

With several API-server processes (--api-server-count, api_servers.py) the engine process has a pipe to each, and
sends each request's outputs to the process that added it.

What crosses a pipe is plain data. To the engine: AddRequest, AbortRequest, ("call", id, method, args), ("stop",),
or from one of several server processes ("leave",) (its requests are aborted; a closed pipe counts the same).
Back: ("ready", facts) or ("load_failed", error); ("outputs", [packed outputs]), ("stats", EngineStats),
("error", request id, error), ("reply", id, result, error), ("failed", reason), and with several server processes
("served_loras", version, {name: LoRARequest}) after each change of the adapters served by name (served_adapters.py).
Outputs go as deltas of plain tuples, whatever the request asked for: a cumulative output's lists would grow with its
length at every step, and tuples pickle several times faster than dataclasses. This side rebuilds the kind of output
each request asked for.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.errors import LLMServeError
from llmserve.gc_policy import freeze_startup_heap
from llmserve.outputs import CompletionOutput, ListPrefix, PoolingRequestOutput, RequestMetrics, RequestOutput
from llmserve.sampling_params import RequestOutputKind
from llmserve.server.async_engine import EngineClient, EngineDeadError
from llmserve.server.engine_loop import AbortRequest, AddRequest, CallEngine, EngineLoop, StopLoop

logger = logging.getLogger(__name__)

START_TIMEOUT = 600.0  # seconds to load the model (a large one from a slow disk, CUDA graphs captured)


@dataclass
class EngineFacts:
    """What the server's process needs to know about the loaded engine."""

    model_name: str
    max_model_len: int
    deterministic: bool
    max_logprobs: int
    task: str  # "generate", "embed" or "classify"


# ---- the engine's process ----------------------------------------------------------------------------------------
def pack_output(out: RequestOutput | PoolingRequestOutput, sent_prompt_logprobs: set) -> tuple | PoolingRequestOutput:
    """A DELTA or FINAL_ONLY output as plain tuples. The prompt's logprobs go once, with the first output. A pooling
    request's one output goes as it is."""
    if isinstance(out, PoolingRequestOutput):
        return out
    prompt_logprobs = None
    if out.prompt_logprobs is not None and out.request_id not in sent_prompt_logprobs:
        sent_prompt_logprobs.add(out.request_id)
        prompt_logprobs = list(out.prompt_logprobs)
    if out.finished:
        sent_prompt_logprobs.discard(out.request_id)
    m = out.metrics
    return (out.request_id, out.finished, out.num_cached_tokens, out.kv_transfer, prompt_logprobs,
            None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                    m.finished_time, m.num_preemptions, m.prefill_compute_seconds,
                                    m.decode_compute_seconds),
            [(c.index, c.delta_text, c.delta_token_ids, None if c.logprobs is None else list(c.logprobs),
              c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in out.outputs])


class _Router:
    """The loop's products, sent to the server processes that asked for them (one, or N with --api-server-count).
    Only the loop's thread sends. Each request's outputs go to the process that added it; stats and a failure go to
    all of them."""

    def __init__(self, clients: list):
        self.single = clients[0] if len(clients) == 1 else None  # one server process: no routing to do
        self.open = list(clients)  # replaced, never changed in place: the loop's thread iterates it
        self.owner: dict[str, object] = {}  # request id -> its server process's connection (with several)
        self._sent_prompt_logprobs: set[str] = set()

    @staticmethod
    def send(conn, message) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, EOFError, OSError):  # that server process is gone; its reader aborts its requests
            pass

    def added(self, request_id: str, conn) -> None:
        """The command reader's thread, before it posts the request to the loop: its outputs will go to `conn`."""
        if self.single is None:
            self.owner[request_id] = conn

    def leave(self, conn) -> list[str]:
        """A server process went away: nothing more goes to it. Returns its requests, for the loop to abort."""
        self.open = [c for c in self.open if c is not conn]
        mine = [rid for rid, c in list(self.owner.items()) if c is conn]
        for rid in mine:
            self.owner.pop(rid, None)
        return mine

    def _conn(self, request_id: str, done: bool):
        if self.single is not None:
            return self.single
        return self.owner.pop(request_id, None) if done else self.owner.get(request_id)

    def on_outputs(self, outputs) -> None:
        sent = self._sent_prompt_logprobs
        if self.single is not None:
            self.send(self.single, ("outputs", [pack_output(o, sent) for o in outputs]))
            return
        by_conn: dict = {}
        for o in outputs:
            conn = self._conn(o.request_id, o.finished)
            if conn is not None:
                by_conn.setdefault(conn, []).append(pack_output(o, sent))
            elif o.finished:  # a request of a process that left
                sent.discard(o.request_id)
        for conn, packed in by_conn.items():
            self.send(conn, ("outputs", packed))

    def on_stats(self, stats) -> None:
        for conn in self.open:
            self.send(conn, ("stats", stats))

    def on_request_error(self, request_id, error) -> None:
        conn = self._conn(request_id, True)
        if conn is not None:
            self.send(conn, ("error", request_id, error))

    def on_request_dropped(self, request_id) -> None:
        conn = self._conn(request_id, True)
        if conn is not None:
            self.send(conn, ("dropped", request_id))

    def on_engine_failed(self, reason) -> None:
        for conn in self.open:
            self.send(conn, ("failed", reason))

    def on_served_loras(self, version: int, served: dict) -> None:
        for conn in self.open:
            self.send(conn, ("served_loras", version, served))


def run_engine_process(engine_config: EngineConfig, clients: list, log_level: int, control=None,
                       stored_responses: int = 0) -> None:
    """The engine process's main: load, report, then run the loop until told to stop or the server goes away.

    clients: one connection per server process. control: with several, the supervising `llmserve serve` process's
    connection: it hears whether the model loaded, and stops the engine (or, closed, stops it too). stored_responses:
    with several, how many Responses API responses the store they share keeps (responses_store.py)."""
    # Ctrl-C reaches every process of the terminal's group: the server's process stops this one in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="llmserve: %(message)s")
    logging.getLogger("llmserve").setLevel(log_level)
    from llmserve.engine.llm_engine import LLMEngine

    everyone = clients + ([control] if control is not None else [])
    try:
        engine = LLMEngine(engine_config)
    except BaseException as e:  # noqa: BLE001 - the server's process raises it (a user's error: one line)
        error = e if isinstance(e, LLMServeError) else RuntimeError(f"{type(e).__name__}: {e}")
        for conn in everyone:
            _Router.send(conn, ("load_failed", error))
        return
    engine.structured.warm_up()  # here, not when the first grammar would stall the running steps
    freeze_startup_heap()  # full collections no longer stall steps for ~0.1 s (gc_policy.py)
    facts = EngineFacts(engine.model_name, engine.max_model_len, engine.executor.info.deterministic, engine.max_logprobs,
                        engine.task)
    for conn in everyone:
        _Router.send(conn, ("ready", facts))
    sink = _Router(clients)
    catalogue = calls = None
    if len(clients) > 1:  # several server processes: the adapters' names and stored responses are kept here
        from llmserve.server.responses_store import ResponseStore
        from llmserve.server.served_adapters import LoRACatalogue

        catalogue = LoRACatalogue(engine, sink.on_served_loras)
        calls = {**catalogue.calls(), **ResponseStore(stored_responses).calls()}
    loop = EngineLoop(engine, sink, admit=catalogue.admit if catalogue is not None else None)
    open_clients = set(range(len(clients)))
    lock = threading.Lock()

    def client_gone(i: int) -> None:
        """A server process left: its requests are aborted (their KV blocks freed); the last one stops the loop."""
        for rid in sink.leave(clients[i]):
            loop.post(AbortRequest(rid))
        with lock:
            open_clients.discard(i)
            if not open_clients:
                loop.post(StopLoop())

    def read_commands(conn, i: int | None):
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # that process is gone
                msg = ("stop",) if i is None else ("leave",)  # the supervisor's: stop; a server process's: it left
            except Exception:  # noqa: BLE001 - a message that does not unpickle here (a bug): dropped, the rest goes on
                logger.exception("dropped a command the engine process could not read")
                continue
            if isinstance(msg, tuple) and msg[0] == "leave" and i is not None:
                client_gone(i)
                return
            if isinstance(msg, tuple) and msg[0] == "call":
                _, call_id, method, args = msg
                if calls is not None:
                    method = calls.get(method, method)
                loop.post(CallEngine(method, args, lambda result, error, c=call_id: sink.send(conn, ("reply", c, result, error))))
            elif isinstance(msg, tuple) and msg[0] == "stop":
                loop.post(StopLoop())
                return
            else:
                if isinstance(msg, AddRequest):
                    sink.added(msg.request_id, conn)
                loop.post(msg)

    for i, conn in enumerate(clients):
        threading.Thread(target=read_commands, args=(conn, i), name=f"llmserve-engine-commands-{i}", daemon=True).start()
    if control is not None:
        threading.Thread(target=read_commands, args=(control, None), name="llmserve-engine-control", daemon=True).start()
    try:
        loop.run()
    finally:
        engine.shutdown()


def start_engine_process(engine_config: EngineConfig, num_clients: int, control: bool = False,
                         stored_responses: int = 0):
    """The engine's process, started: (process, [a connection per server process], the control connection or None)."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that has imported torch
    pairs = [ctx.Pipe(duplex=True) for _ in range(num_clients + int(control))]
    theirs = [b for _, b in pairs]
    process = ctx.Process(target=run_engine_process, name="llmserve-engine",
                          args=(engine_config, theirs[:num_clients], logging.getLogger("llmserve").getEffectiveLevel(),
                                theirs[num_clients] if control else None, stored_responses))
    process.start()
    for conn in theirs:  # the child has its own copies: a pipe reports EOF only once every copy of its end is closed
        conn.close()
    ours = [a for a, _ in pairs]
    return process, ours[:num_clients], ours[num_clients] if control else None


def wait_ready(conn, process, timeout: float = START_TIMEOUT) -> EngineFacts:
    """The engine's facts once it has loaded the model; raises what loading raised, or EngineDeadError (one line for
    the CLI) if the process died or hung while loading."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if process is not None and not process.is_alive():
            raise EngineDeadError(f"the engine process exited while loading the model (exit code {process.exitcode})")
        if time.monotonic() > deadline:
            raise EngineDeadError(f"the engine process did not load the model in {timeout:.0f} s")
    try:
        kind, payload = conn.recv()
    except (EOFError, OSError):
        raise EngineDeadError("the engine process exited while loading the model") from None
    if kind == "load_failed":
        raise payload
    return payload


# ---- the server's process ----------------------------------------------------------------------------------------
class _Assembly:
    """One request's outputs so far, rebuilt from the engine's deltas into the kind the request asked for."""

    __slots__ = ("prompt_token_ids", "kind", "texts", "token_ids", "logprobs", "prompt_logprobs")

    def __init__(self, prompt_token_ids: list[int], kind: RequestOutputKind):
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.texts: dict[int, str] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.prompt_logprobs = None

    def output(self, packed: tuple) -> RequestOutput:
        rid, finished, num_cached, kv_transfer, prompt_logprobs, metrics, completions = packed
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        outs = []
        cumulative = self.kind is RequestOutputKind.CUMULATIVE
        for index, delta_text, delta_ids, delta_logprobs, finish_reason, stop_reason, cumulative_logprob in completions:
            if cumulative:
                text = self.texts[index] = self.texts.get(index, "") + delta_text
                ids = self.token_ids.setdefault(index, [])
                ids.extend(delta_ids)
                token_ids = ListPrefix(ids)
                logprobs = None
                if delta_logprobs is not None:
                    lps = self.logprobs.setdefault(index, [])
                    lps.extend(delta_logprobs)
                    logprobs = ListPrefix(lps)
            else:  # DELTA, or FINAL_ONLY (whose one output is all delta)
                text, token_ids, logprobs = delta_text, delta_ids, delta_logprobs
            outs.append(CompletionOutput(index, text, token_ids, finish_reason, stop_reason, cumulative_logprob,
                                         logprobs, delta_text, list(delta_ids)))
        pl = self.prompt_logprobs
        return RequestOutput(rid, None, self.prompt_token_ids, outs, finished,
                             None if metrics is None else RequestMetrics(*metrics), num_cached,
                             None if pl is None else ListPrefix(pl), kv_transfer)


class EngineProcessClient(EngineClient):
    """The engine loop in a process of its own (see the module's docstring). Loads the model there; raises what
    loading raised. The tokenizer and the model's config are read here too, for the HTTP side.

    connection: the engine process is already started (several server processes share it, api_servers.py) and this
    is this process's connection to it; else this client starts the engine process and owns it."""

    def __init__(self, engine_config: EngineConfig, metrics=None, connection=None):
        super().__init__(metrics)
        from llmserve.loader import load_engine_model_files
        from llmserve.loader.hf import generation_defaults
        from llmserve.structured import StructuredOutputManager

        if connection is None:
            self._process, (self._conn,), _ = start_engine_process(engine_config, 1)
        else:
            self._process, self._conn = None, connection
        self._send_lock = threading.Lock()
        self._stopping = False
        self._calls: dict[int, CallEngine] = {}
        self._call_ids = itertools.count()
        self._assemblies: dict[str, _Assembly] = {}
        # with several server processes: each change of the adapters served by name (served_adapters.py)
        self.on_served_loras: Callable[[int, dict], None] | None = None
        try:
            # the weights stay unread: they load lazily
            files = load_engine_model_files(engine_config)
            # this side compiles grammars only to refuse bad ones early; it indexes its tokenizer while the engine loads
            self.structured = StructuredOutputManager(files.tokenizer, files.config.vocab_size, files.config.eos_token_ids)
            threading.Thread(target=self.structured.warm_up, name="llmserve-grammar-warm-up", daemon=True).start()
            self.facts = wait_ready(self._conn, self._process)
        except BaseException:
            if self._process is not None:
                self._process.kill()
                self._process.join()
            raise
        self.tokenizer = files.tokenizer
        if engine_config.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(engine_config.chat_template)
        self.sampling_defaults = generation_defaults(engine_config, files.config)
        self.model_config = files.config
        self.model_name = self.facts.model_name
        self.max_model_len = self.facts.max_model_len
        self.max_logprobs = self.facts.max_logprobs
        self.deterministic = self.facts.deterministic
        self.task = self.facts.task
        self._reader = threading.Thread(target=self._read, name="llmserve-engine-outputs", daemon=True)
        self._reader.start()

    # ---- life -------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The engine process's id, if this client started it."""
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self.error is None and (self._process is None or self._process.is_alive())

    def why_dead(self) -> str:
        if self.error is None and self._process is not None and not self._process.is_alive():
            return f"the engine is not running: the engine process exited (code {self._process.exitcode})"
        return super().why_dead()

    def shutdown(self) -> None:
        self._stopping = True
        if self._process is None:  # shared: whoever started it stops it; leaving aborts this process's requests there
            try:
                self._send(("leave",))
            except EngineDeadError:
                pass
            self._conn.close()
            return
        try:
            self._send(("stop",))
        except EngineDeadError:
            pass
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    # ---- to the engine ------------------------------------------------------------------------------------
    def _send(self, message) -> None:
        try:
            with self._send_lock:  # the event loop and other threads (start-up, tests) send
                self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise EngineDeadError(self.why_dead()) from e

    def _post(self, command) -> None:
        if isinstance(command, AddRequest):
            params = command.params
            self._assemblies[command.request_id] = _Assembly(command.prompt_token_ids, params.output_kind)
            if params.output_kind is RequestOutputKind.CUMULATIVE:  # rebuilt here from deltas
                command = dataclasses.replace(command, params=dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
        elif isinstance(command, CallEngine):
            call_id = next(self._call_ids)
            self._calls[call_id] = command  # its reply runs when the engine's answer comes back
            command = ("call", call_id, command.method, command.args)
        self._send(command)

    # ---- from the engine ----------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError, TypeError) as e:
                # shutdown() closing the connection while recv waits in it leaves recv a None handle: a TypeError
                if isinstance(e, TypeError) and not self._stopping:
                    raise
                if self._stopping:
                    pass
                elif self._process is None:
                    self.on_engine_failed("the engine process exited")
                else:
                    self._process.join(timeout=1)  # for its exit code
                    self.on_engine_failed(f"the engine process exited (code {self._process.exitcode})")
                self._fail_calls()
                return
            kind = msg[0]
            if kind == "outputs":
                assemblies = self._assemblies
                outputs = []
                for packed in msg[1]:
                    if isinstance(packed, PoolingRequestOutput):
                        assemblies.pop(packed.request_id, None)
                        outputs.append(packed)
                        continue
                    rid = packed[0]
                    assembly = assemblies.pop(rid, None) if packed[1] else assemblies.get(rid)
                    if assembly is not None:  # else a request this side never sent (cannot happen) or has closed
                        outputs.append(assembly.output(packed))
                self.on_outputs(outputs)
            elif kind == "stats":
                self.on_stats(msg[1])
            elif kind == "error":
                self._assemblies.pop(msg[1], None)
                self.on_request_error(msg[1], msg[2])
            elif kind == "dropped":  # aborted before it joined the engine: no final output will free its assembly
                self._assemblies.pop(msg[1], None)
                self.on_request_dropped(msg[1])
            elif kind == "reply":
                _, call_id, result, error = msg
                command = self._calls.pop(call_id, None)
                if command is not None:
                    command.reply(result, error)
            elif kind == "failed":
                self.on_engine_failed(msg[1])
            elif kind == "served_loras" and self.on_served_loras is not None:
                self.on_served_loras(msg[1], msg[2])

    def _fail_calls(self) -> None:
        for command in list(self._calls.values()):
            command.reply(None, EngineDeadError(self.why_dead()))
        self._calls.clear()
