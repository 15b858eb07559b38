"""Start-up of the commands: wall time and peak memory, this checkout against another git revision in the same run.

    .venv/bin/python benchmarks/command_startup.py --base eec69d0 [--rounds 5] [--json bench-results/command_startup.json]

Each side runs `python -m llmserve` with its own code on PYTHONPATH (the base checked out beside this one, as
revision_ab.py does), alternating which goes first. Per round and side:
- `plan Llama-3.1-8B --hardware h100`: wall time and the process's peak RSS;
- `bench` against one `llmserve serve` (this checkout's, started once for both sides), 4 requests of 16 tokens in and
  4 out, one at a time: wall time and peak RSS (the largest of its processes), with 1 and with 2 client processes;
- `gateway` with one backend: seconds from launch to /health answering, and its RSS then;
- commands that read the default model's weights: `generate "Hi" --max-tokens 1` (wall time, peak RSS) and `serve`
  (seconds from launch to /health answering, RSS then); `serve --api-server-count 2`: the same, with the RSS of its
  larger API-server process (the HTTP processes: those listening on the port).
Figures are medians over rounds; ratios are this checkout / base (below 1: faster, smaller).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, os.path.dirname(__file__))
from common import checkout_beside, write_json
from serving import free_port, wait_healthy

HERE = Path(__file__).resolve().parent.parent


def run_measured(checkout: Path, *args: str) -> tuple[float, float]:
    """Runs `python -m llmserve ARGS` from `checkout`: (wall seconds, peak RSS in MiB of its largest process)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", *args], cwd=checkout, stdout=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(checkout)})
    _, status, usage = os.wait4(proc.pid, 0)  # its own rusage; ru_maxrss covers the children it waited for too
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"llmserve {' '.join(args)} exited with {proc.returncode}")
    return time.perf_counter() - t, usage.ru_maxrss / 1024


def listening(pid: int, port: int) -> list[psutil.Process]:
    """The child processes of `pid` listening on `port` (`serve --api-server-count N`'s HTTP processes)."""
    return [c for c in psutil.Process(pid).children()
            if any(x.status == psutil.CONN_LISTEN and x.laddr.port == port for x in c.net_connections("tcp"))]


def ready_time(checkout: Path, *args: str, api_servers: int = 0) -> tuple[float, float]:
    """(seconds from launch to /health answering, RSS in MiB then) of `llmserve ARGS` (gateway, serve); with
    api_servers, once that many processes listen, and the RSS of the largest of them."""
    port = free_port()
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", *args, "--port", str(port)],
                            cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llmserve {' '.join(args)} exited with {proc.returncode}")
            try:
                if (httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code < 500
                        and len(listening(proc.pid, port)) >= api_servers):
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        ready = time.perf_counter() - t
        if api_servers:
            return ready, max(p.memory_info().rss for p in listening(proc.pid, port)) / 2**20
        rss_kb = next(int(line.split()[1]) for line in open(f"/proc/{proc.pid}/status") if line.startswith("VmRSS:"))
        return ready, rss_kb / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure(checkout: Path, server_url: str, config: str, out_dir: str) -> dict:
    figures = {}
    figures["plan_s"], figures["plan_mib"] = run_measured(checkout, "plan", "Llama-3.1-8B", "--hardware", "h100")
    for n in (1, 2):
        figures[f"bench{n}_s"], figures[f"bench{n}_mib"] = run_measured(
            checkout, "bench", "--base-url", server_url + "/v1", "--input-len", "16", "--output-len", "4",
            "--num-requests", "4", "--concurrency", "1", "--warmup", "0", "--client-processes", str(n), "--quiet",
            "--no-plots", "--result", f"{out_dir}/bench.json")
    figures["gateway_s"], figures["gateway_mib"] = ready_time(checkout, "gateway", "--config", config)
    figures["generate_s"], figures["generate_mib"] = run_measured(checkout, "generate", "Hi", "--max-tokens", "1")
    figures["serve_s"], figures["serve_mib"] = ready_time(checkout, "serve", "--no-webui")
    figures["api2_s"], figures["api2_mib"] = ready_time(checkout, "serve", "--no-webui", "--api-server-count", "2",
                                                        api_servers=2)
    return figures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="bench-results/command_startup.json")
    args = ap.parse_args()
    base = checkout_beside(args.base)
    out_dir = tempfile.mkdtemp(prefix="command-startup-")
    config = f"{out_dir}/gateway.yaml"
    Path(config).write_text("backends:\n  a: {url: 'http://127.0.0.1:9/v1', model: m}\nmodels:\n  chat: {targets: [a]}\n")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--port", str(port), "--no-webui"], cwd=HERE,
                              stderr=subprocess.DEVNULL)
    sides = [("base", base), ("new", HERE)]
    rounds = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300, server)
        for r in range(args.rounds):
            result = {}
            for name, checkout in sides if r % 2 == 0 else sides[::-1]:
                result[name] = measure(checkout, f"http://127.0.0.1:{port}", config, out_dir)
            print(f"round {r + 1}: " + ", ".join(f"{k} {result['base'][k]:.2f} -> {result['new'][k]:.2f}"
                                                 for k in result["base"]), flush=True)
            rounds.append(result)
    finally:
        server.terminate()
        server.wait(timeout=60)
    median = {side: {k: statistics.median(rd[side][k] for rd in rounds) for k in rounds[0][side]} for side, _ in sides}
    ratios = {k: median["new"][k] / median["base"][k] for k in median["base"]}
    print("median: " + ", ".join(f"{k} {median['base'][k]:.2f} -> {median['new'][k]:.2f} ({ratios[k]:.2f}x)"
                                 for k in ratios))
    write_json(args.json, {"base": args.base, "rounds": rounds, "median": median, "ratios": ratios})


if __name__ == "__main__":
    main()
