"""A real llmserve server on 127.0.0.1, its HTTP side in a thread of the test process; its engine in a thread too (the
model read once for all of them), or in a process of its own (engine_process=True, as `llmserve serve` runs)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import httpx
import openai
import uvicorn

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.metrics import Metrics
from llmserve.server.app import ServerConfig, build_app
from llmserve.server.async_engine import AsyncEngine
from llmserve.server.engine_process import EngineProcessClient


def stop_process(proc, timeout: float = 60) -> None:
    """A server started with subprocess: SIGTERM (its graceful shutdown), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`llmserve serve FLAGS` (or `llmserve gateway FLAGS`) started as a user starts it, in a process of its own, on a
    free port of 127.0.0.1, its output (stdout and stderr) kept in a file. wait_ready() returns once /health answers
    and `ready` (if given) holds; it fails with the server's output if the server exits or does not get there in
    time."""

    def __init__(self, *flags: str, command: str = "serve", env: dict | None = None, verify=True):
        """verify: for an HTTPS server (--ssl-certfile), httpx's verify (an ssl.SSLContext trusting its CA)."""
        self.command = command
        self.port = free_port()
        self.verify = verify
        self.url = f"{'https' if '--ssl-certfile' in flags else 'http'}://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server never blocks on a full pipe
        self.proc = subprocess.Popen([sys.executable, "-m", "llmserve", command, "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)

    def wait_ready(self, timeout: float = 240, ready: Callable[[], bool] | None = None) -> ServerProcess:
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmserve {self.command} exited ({self.proc.returncode}):\n{self.output()}")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"llmserve {self.command} did not start in {timeout:.0f} s:\n{self.output()}")
            try:
                if (httpx.get(self.url + "/health", timeout=1, verify=self.verify).status_code == 200
                        and (ready is None or ready())):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        http = httpx.Client(verify=self.verify, timeout=120) if self.url.startswith("https") else None
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, http_client=http)

    def stop(self, timeout: float = 60) -> None:
        stop_process(self.proc, timeout)


class RunningServer:
    def __init__(self, files, engine_kw: dict, server_kw: dict, engine_process: bool = False):
        cfg = dict(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=32)
        cfg.update(engine_kw)
        self.metrics = Metrics("test-model")
        if engine_process:
            self.llm = None  # in the engine's process
            self.engine = EngineProcessClient(EngineConfig(model=files.path, **cfg), self.metrics)
        else:
            self.llm = LLMEngine(EngineConfig(**cfg), files=files)
            self.engine = AsyncEngine(self.llm, self.metrics)
        self.config = ServerConfig(served_model_name="test-model", **server_kw)
        app = build_app(self.engine, self.config, self.metrics)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine runs nothing and holds no KV block, and /metrics says so."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            stats = self.engine.call("stats").result()
            if not stats.num_running and not stats.num_waiting and stats.num_free_blocks == stats.num_blocks:
                gauges = httpx.get(self.base_url + "/metrics").text
                if all(f'{name}{{model_name="test-model"}} 0.0' in gauges for name in
                       ("llmserve:num_requests_running", "llmserve:num_requests_waiting", "llmserve:kv_cache_usage_perc")):
                    return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {stats.num_running} running, {stats.num_waiting} waiting, "
                             f"{stats.num_blocks - stats.num_free_blocks} blocks in use")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()
