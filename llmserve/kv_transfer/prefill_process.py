"""The prefill instance that `llmserve serve --disaggregated` starts beside itself:
`python -m llmserve.kv_transfer.prefill_process <arguments>` (the engine settings pickled by the parent)."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_prefill_instance(engine_config, served_model_name: str):
    """Starts the prefill instance on 127.0.0.1; returns the decode side's settings (pointing at it) and the
    process. The instance listens for the KV link as soon as its model is loaded."""
    kv_link, http_port = f"127.0.0.1:{_free_port()}", _free_port()
    prefill_config = dataclasses.replace(engine_config, kv_role="prefill", kv_link=kv_link, prefill_url=None,
                                         max_local_prefill_length=None)
    args = base64.b64encode(pickle.dumps((prefill_config, http_port, served_model_name))).decode()
    process = subprocess.Popen([sys.executable, "-m", "llmserve.kv_transfer.prefill_process", args])
    decode_config = dataclasses.replace(engine_config, kv_role="decode", kv_link=kv_link,
                                        prefill_url=f"http://127.0.0.1:{http_port}")
    return decode_config, process


def main(engine_config, port: int, served_model_name: str) -> None:
    import logging

    import uvicorn

    from llmserve.gc_policy import freeze_startup_heap
    from llmserve.platforms import get_platform
    from llmserve.server.app import ServerConfig, create_server

    logging.basicConfig(level=logging.INFO, format="llmserve prefill: %(message)s", stream=sys.stderr)
    parent = os.getppid()

    def exit_with_parent():
        # the serving process started this one: if it is gone (killed outright), nothing routes here any more
        while os.getppid() == parent:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=exit_with_parent, name="llmserve-parent-watch", daemon=True).start()
    get_platform(engine_config.device).bind_rank(0, 2)  # the first half of the cores
    app, engine = create_server(engine_config, ServerConfig(served_model_name=served_model_name, webui=False))
    freeze_startup_heap()  # this process is llmserve's (gc_policy.py)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(*pickle.loads(base64.b64decode(sys.argv[1])))
