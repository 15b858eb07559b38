"""Measures Python's garbage collector in every process started with this folder on PYTHONPATH and GC_PROBE_DIR
set (benchmarks/server_processes.py uses it for the server's processes). From when the file GC_PROBE_DIR/arm exists,
each process rewrites GC_PROBE_DIR/<pid>.json every 0.2 s: per generation, the passes, their CPU seconds (the
collecting thread's) and the longest. A pass holds the GIL, so the longest is how long it stopped that process."""

import os

if os.environ.get("GC_PROBE_DIR"):
    import gc
    import json
    import sys
    import threading
    import time

    _dir = os.environ["GC_PROBE_DIR"]
    _passes = {g: {"passes": 0, "cpu_s": 0.0, "longest_s": 0.0} for g in range(3)}
    _started = [0.0]
    _armed = threading.Event()

    def _on_gc(phase, info):
        if not _armed.is_set():
            return
        if phase == "start":
            _started[0] = time.thread_time()
            return
        took = time.thread_time() - _started[0]
        p = _passes[info["generation"]]
        p["passes"] += 1
        p["cpu_s"] += took
        p["longest_s"] = max(p["longest_s"], took)

    def _report():
        while not os.path.exists(os.path.join(_dir, "arm")):
            time.sleep(0.05)
        _armed.set()
        # once: gc.get_freeze_count() walks the whole frozen heap, holding the GIL (~20 ms for a server's)
        frozen = gc.get_freeze_count()
        while True:
            time.sleep(0.2)
            with open(os.path.join(_dir, f"{os.getpid()}.json.tmp"), "w") as f:
                json.dump({"argv": sys.argv, "generations": _passes, "frozen": frozen}, f)
            os.replace(os.path.join(_dir, f"{os.getpid()}.json.tmp"), os.path.join(_dir, f"{os.getpid()}.json"))

    gc.callbacks.append(_on_gc)
    threading.Thread(target=_report, name="gc-probe", daemon=True).start()
