"""Several API-server processes in front of one engine process (vLLM's --api-server-count).

Why: one server process has one core for HTTP, SSE, JSON, tokenizing prompts and metrics. It spends ~0.035 s of CPU
per 1,000 streamed tokens (docs/benchmarks.md), so it cannot stream much more than ~28,000 tok/s, whatever the GPU
behind it delivers. With N processes the HTTP work spreads over N cores; the engine stays one process, so batching,
the KV cache and the prefix cache are shared as before.

How: `llmserve serve` becomes a supervisor. It reserves the port, starts the engine process with one pipe per server
process (engine_process.py routes each request's outputs back to the process that sent it), and once the model has
loaded starts the N server processes, which all accept connections on that port (see BALANCED_PORTS). Metrics go
through prometheus-client's multiprocess mode (metrics.py); the admission queue's counts through shared memory
(admission.py), so --max-queued-requests and --max-queued-tokens hold for the server as a whole. If any process
exits, the supervisor stops the others: a server with a process missing is not the one the operator started.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.gc_policy import freeze_startup_heap

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds a process gets to finish its streams before it is killed


def run_http_server(app, engine, *, host: str | None = None, port: int | None = None,
                    sock: socket.socket | None = None, options: dict | None = None) -> bool:
    """uvicorn on host:port (or an already listening socket) until it is stopped or the engine dies; True if the
    engine died. A dead engine (a tensor-parallel rank that died, a bug) cannot recover in this process: the requests
    it held got their 503s; the server exits so that a supervisor restarts it rather than it answering 503 forever."""
    import uvicorn

    kwargs = {} if sock is not None else {"host": host, "port": port}
    options = {"log_level": "warning", **(options or {})}  # ServerConfig.uvicorn_options: logging, TLS
    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **kwargs, **options))
    died = threading.Event()

    def exit_when_engine_dies():
        while not server.should_exit:
            if not engine.alive:
                died.set()
                print(f"error: {engine.why_dead()}; shutting down", file=sys.stderr, flush=True)
                server.should_exit = True
            time.sleep(0.5)

    threading.Thread(target=exit_when_engine_dies, name="llmserve-watchdog", daemon=True).start()
    freeze_startup_heap()  # full collections no longer stop every stream for ~0.1 s (gc_policy.py)
    server.run(sockets=[sock] if sock is not None else None)
    return died.is_set()


# On Linux each server process listens on a socket of its own bound to the same port (SO_REUSEPORT), and the kernel
# spreads new connections over them by a hash of each connection's addresses. With one shared socket, the process that
# wakes first accepts everything queued (asyncio accepts up to 100 at a time): measured 1 and 15 of 16 concurrent
# streams. Elsewhere (macOS does not balance SO_REUSEPORT) the processes share the supervisor's socket.
BALANCED_PORTS = sys.platform.startswith("linux")


def _bound_socket(family, address, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """The supervisor's socket on host:port: it proves the port is free before anything starts (a one-line error if
    not). Where ports are balanced it does not listen (a listening one would get its share of connections); else it
    listens, and the server processes accept on it."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        # first without SO_REUSEPORT: else another server that set it (another llmserve) would share the port silently
        sock = _bound_socket(family, address, False)
        if BALANCED_PORTS:
            address = sock.getsockname()  # the port the system chose, if asked for port 0
            sock.close()
            sock = _bound_socket(family, address, True)
    except OSError as e:
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror or e}", "port") from None
    if not BALANCED_PORTS:
        sock.listen(2048)
    return sock


def _listening_socket(reserved: socket.socket) -> socket.socket:
    """A server process's socket: its own on the reserved port where ports are balanced, else the shared one."""
    if not BALANCED_PORTS:
        return reserved
    sock = _bound_socket(reserved.family, reserved.getsockname(), True)
    sock.listen(2048)
    reserved.close()
    return sock


def _api_server_main(index: int, engine_config: EngineConfig, server_config, queue_counts, connection,
                     reserved: socket.socket, log_level: int, status) -> None:
    """A server process: the HTTP side of `llmserve serve` over the shared engine, on the reserved port."""
    logging.basicConfig(level=logging.WARNING, format="llmserve: %(message)s")
    logging.getLogger("llmserve").setLevel(log_level)
    from llmserve.metrics import Metrics
    from llmserve.server.app import build_app
    from llmserve.server.engine_process import EngineProcessClient

    try:
        engine = EngineProcessClient(engine_config, connection=connection)
        engine.records_engine_stats = index == 0  # the engine's gauges once, not once per process
        if not server_config.served_model_name:
            server_config.served_model_name = engine.model_name
        metrics = Metrics(server_config.served_model_name)
        engine.metrics = metrics
        app = build_app(engine, server_config, metrics, queue_counts)
        sock = _listening_socket(reserved)  # connections queue here until uvicorn accepts them
    except Exception as e:  # noqa: BLE001 - the supervisor prints it once, as one line
        status.send(("failed", index, e.message if isinstance(e, LLMServeError) else f"{type(e).__name__}: {e}"))
        sys.exit(1)
    status.send(("started", index, engine.model_name))
    status.close()
    died = run_http_server(app, engine, sock=sock, options=server_config.uvicorn_options)
    engine.shutdown()
    sys.exit(1 if died else 0)


def serve_with_api_servers(engine_config: EngineConfig, server_config, host: str, port: int, count: int) -> int:
    """`llmserve serve --api-server-count N` (N > 1): runs until interrupted or a process exits; the exit status."""
    from llmserve.server.admission import QueueCounts
    from llmserve.server.engine_process import start_engine_process, wait_ready

    sock = reserve_port(host, port)
    metrics_dir = tempfile.mkdtemp(prefix="llmserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the server processes, read at their import
    engine, clients, control = start_engine_process(engine_config, count, control=True,
                                                   stored_responses=server_config.max_stored_responses)
    servers: list[multiprocessing.Process] = []
    try:
        wait_ready(control, engine)
        ctx = multiprocessing.get_context("spawn")
        status, status_theirs = ctx.Pipe(duplex=False)
        level = logging.getLogger("llmserve").getEffectiveLevel()
        queue_counts = QueueCounts(shared_through=ctx)
        for i, conn in enumerate(clients):
            servers.append(ctx.Process(target=_api_server_main, name=f"llmserve-api-server-{i}",
                                       args=(i, engine_config, server_config, queue_counts, conn, sock, level,
                                             status_theirs)))
            servers[-1].start()
            conn.close()  # the server process has its own copy
        status_theirs.close()
        model_name = _wait_started(status, servers, engine)
        name = server_config.served_model_name or model_name
        print(f"llmserve: serving {name} on {server_config.scheme}://{host}:{port}/v1 with {count} API-server processes",
              file=sys.stderr, flush=True)
        if server_config.webui:
            print(f"llmserve: playground at {server_config.scheme}://{host}:{port}/", file=sys.stderr, flush=True)
        ready = multiprocessing.connection.wait([p.sentinel for p in servers] + [engine.sentinel])
        gone = next(p for p in servers + [engine] if p.sentinel in ready)
        gone.join(timeout=5)  # for its exit code
        if gone.exitcode == 0:  # stopped by a signal sent to it alone
            print(f"llmserve: {gone.name} stopped; shutting down", file=sys.stderr, flush=True)
            return 0
        print(f"error: {gone.name} exited (code {gone.exitcode}); shutting down", file=sys.stderr, flush=True)
        return 1
    finally:
        sock.close()  # after the server processes have bound theirs: no moment with the port free for another program
        _stop(servers, engine, control)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def _wait_started(status, servers: list, engine) -> str:
    """Until every server process has built its app; raises the first one's error (once, for every process would
    have the same). Returns the model's name."""
    started, model_name = 0, ""
    while started < len(servers):
        ready = multiprocessing.connection.wait([status] + [p.sentinel for p in servers] + [engine.sentinel])
        if status in ready:
            try:
                kind, index, payload = status.recv()
            except EOFError:
                raise LLMServeError("the API-server processes exited while starting") from None
            if kind == "failed":
                raise LLMServeError(payload)
            started, model_name = started + 1, payload
        else:
            gone = next(p for p in servers + [engine] if p.sentinel in ready)
            gone.join(timeout=5)
            raise LLMServeError(f"{gone.name} exited while starting (code {gone.exitcode})")
    return model_name


def _stop(servers: list, engine, control) -> None:
    """The server processes first (each finishes its streams, then leaves the engine), then the engine."""
    for p in servers:
        if p.is_alive():
            p.terminate()  # SIGTERM: uvicorn's graceful shutdown
    deadline = time.monotonic() + STOP_TIMEOUT
    for p in servers:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    try:
        control.send(("stop",))
    except (BrokenPipeError, EOFError, OSError):
        pass
    engine.join(timeout=STOP_TIMEOUT)
    if engine.is_alive():
        engine.terminate()
        engine.join(timeout=5)
    if engine.is_alive():
        engine.kill()
        engine.join()
    control.close()


def leave_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that `finally` blocks stop the engine's other processes (the prefill instance,
    tensor-parallel ranks, the server processes). uvicorn shuts down gracefully on SIGTERM, then raises the signal
    again once it has restored this handler: with the default one the process would die there, before them."""
    def leave(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
