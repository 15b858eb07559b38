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


@contextlib.contextmanager
def llmserve_server(*server_args: str):
    """Yields the server's base URL (http://127.0.0.1:PORT) once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([LLMSERVE, "serve", "--port", str(port), *server_args], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
