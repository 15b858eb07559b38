"""Start `llmserve serve` as a subprocess on a free port for a benchmark, and stop it afterwards; load it with `llmserve bench`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx

LLMSERVE = os.path.join(os.path.dirname(sys.executable), "llmserve")


def wait_healthy(base_url: str, timeout: float = 180, process: subprocess.Popen | None = None) -> None:
    """Polls BASE_URL/health until it answers 200 (llmserve and llama-server both have it). Raises if it does not
    within `timeout` seconds, or at once if `process` (the server) has exited."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, process.args))} exited with code {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} did not answer /health within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llmserve_server(*server_args: str, ready_timeout: float = 180):
    """Yields the server's base URL (http://127.0.0.1:PORT) once /health answers 200."""
    port = free_port()
    server = subprocess.Popen([LLMSERVE, "serve", "--port", str(port), *server_args], stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", ready_timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def sweep(base_url: str, label: str, concurrency: str, result: str, model_name: str | None, *target: str) -> dict:
    """`llmserve bench` at each concurrency (200 tokens in, 128 out, EOS ignored); returns {concurrency: summary}.
    `target` replaces the server (e.g. "--engine", "--compile": the engine in the bench's own process)."""
    cmd = [LLMSERVE, "bench", *(target or ("--base-url", base_url + "/v1")), "--concurrency", concurrency, "--input-len", "200",
           "--output-len", "128", "--ignore-eos", "--label", label, "--result", result, "--no-plots", "--quiet"]
    if model_name:
        cmd += ["--model", model_name]
    subprocess.run(cmd, check=True)
    with open(result) as f:
        return {lvl["load"]["concurrency"]: lvl["summary"] for lvl in json.load(f)["levels"]}
