"""Start `llmserve serve` as a subprocess on a free port for a benchmark, and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

LLMSERVE = os.path.join(os.path.dirname(sys.executable), "llmserve")


def wait_healthy(base_url: str, timeout: float = 180) -> None:
    """Polls BASE_URL/health until it answers 200 (llmserve and llama-server both have it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


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
