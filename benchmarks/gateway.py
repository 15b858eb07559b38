"""The gateway, measured two ways in one run.

    .venv/bin/python benchmarks/gateway.py [--json bench-results/gateway.json]

1. Prefix affinity against round-robin: two `llmserve serve` replicas on the default model behind one
   `llmserve gateway` that offers them as two models, `affinity` (route: prefix-affinity) and `rr` (round-robin).
   `llmserve bench --workload shared-prefix` runs against each (different seeds, so neither finds the other's
   prefixes cached). Figures: the replicas' prefix-cache hit rate over the run (from their /metrics) and TTFT p50/p99.
2. The gateway's own latency: a backend that answers at once (a tiny FastAPI app in a subprocess), called directly and
   through the gateway at concurrency 32; the added latency is the difference of the per-request medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import httpx

from common import write_json
from serving import LLMSERVE, free_port, wait_healthy

FAST_BACKEND = textwrap.dedent('''
    import sys, uvicorn
    from fastapi import FastAPI
    app = FastAPI()
    ANSWER = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    @app.get("/health")
    async def health():
        return {}
    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}
    @app.post("/v1/chat/completions")
    async def chat():
        return ANSWER
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


def prefix_counters(base: str) -> tuple[float, float]:
    text = httpx.get(base + "/metrics").text
    def total(name):
        return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))
    return total("llmserve:prefix_cache_hits_total"), total("llmserve:prefix_cache_queries_total")


def pinned(core: int | None, cmd: list[str]) -> list[str]:
    """cmd on one core (with one torch thread), when the machine has more than one."""
    return cmd if core is None or (os.cpu_count() or 1) < 2 else ["taskset", "-c", str(core % os.cpu_count()), *cmd]


def start(cmd: list[str], health: str):
    env = dict(os.environ, OMP_NUM_THREADS="1") if cmd[0] == "taskset" else None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_healthy(health)
    return proc


def affinity_vs_round_robin(args) -> dict:
    ports = [free_port() for _ in range(2)]
    # each replica on its own core, as replicas on their own machines would be
    replicas = [start(pinned(i, [LLMSERVE, "serve", "--port", str(p), "--max-num-seqs", "8", "--no-webui"]), f"http://127.0.0.1:{p}")
                for i, p in enumerate(ports)]
    gw_port = free_port()
    config = {"backends": {f"r{i}": {"url": f"http://127.0.0.1:{p}/v1", "model": "SmolLM2-135M-Instruct.Q4_1"}
                           for i, p in enumerate(ports)},
              "models": {"affinity": {"route": "prefix-affinity", "targets": ["r0", "r1"]},
                         "rr": {"route": "round-robin", "targets": ["r0", "r1"]}},
              "first_token_timeout": 600}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)  # JSON is YAML
    gateway = start([LLMSERVE, "gateway", "--config", f.name, "--port", str(gw_port), "--no-webui"], f"http://127.0.0.1:{gw_port}")
    out = {}
    try:
        for seed, model in enumerate(("rr", "affinity")):
            before = [prefix_counters(f"http://127.0.0.1:{p}") for p in ports]
            result = f"bench-results/gateway_{model}.json"
            subprocess.run([LLMSERVE, "bench", "--base-url", f"http://127.0.0.1:{gw_port}/v1", "--model", model,
                            "--workload", "shared-prefix", "--num-prefixes", str(args.num_prefixes), "--prefix-len",
                            str(args.prefix_len), "--question-len", "32", "--output-len", "16", "--ignore-eos",
                            "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                            "--seed", str(100 + seed), "--result", result, "--no-plots", "--quiet"], check=True)
            after = [prefix_counters(f"http://127.0.0.1:{p}") for p in ports]
            hits = sum(a[0] - b[0] for a, b in zip(after, before))
            queries = sum(a[1] - b[1] for a, b in zip(after, before))
            with open(result) as fr:
                summary = json.load(fr)["levels"][0]["summary"]
            out[model] = {"hit_rate": hits / queries if queries else 0.0, "p50_ttft_ms": summary["p50_ttft_ms"],
                          "p99_ttft_ms": summary["p99_ttft_ms"], "completed": summary["completed"]}
            print(model, out[model], file=sys.stderr)
    finally:
        for proc in (gateway, *replicas):
            proc.terminate()
            proc.wait(timeout=30)
        os.unlink(f.name)
    return out


async def latencies(url: str, concurrency: int, n: int) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    times: list[float] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=60) as client:
        queue = asyncio.Queue()
        for _ in range(n):
            queue.put_nowait(None)

        async def worker():
            while not queue.empty():
                queue.get_nowait()
                t = time.perf_counter()
                r = await client.post(url, json=body)
                r.raise_for_status()
                times.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times


def gateway_overhead(args) -> dict:
    backend_port, gw_port = free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(FAST_BACKEND)
    # the backend and this client share core 0, the gateway has core 1: it is a hop of its own, as deployed
    backend = start(pinned(0, [sys.executable, f.name, str(backend_port)]), f"http://127.0.0.1:{backend_port}")
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    config = {"backends": {"fast": {"url": f"http://127.0.0.1:{backend_port}/v1", "model": "m"}},
              "models": {"m": {"targets": ["fast"]}}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as g:
        json.dump(config, g)
    gateway = start(pinned(1, [LLMSERVE, "gateway", "--config", g.name, "--port", str(gw_port), "--no-webui"]),
                    f"http://127.0.0.1:{gw_port}")
    try:
        direct_url = f"http://127.0.0.1:{backend_port}/v1/chat/completions"
        via_url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        asyncio.run(latencies(via_url, args.overhead_concurrency, 200))  # warm-up
        out = {}
        for concurrency, n in ((1, args.overhead_requests // 4), (args.overhead_concurrency, args.overhead_requests)):
            rounds = []
            for _ in range(3):  # interleaved, so drift hits both
                direct = asyncio.run(latencies(direct_url, concurrency, n))
                via = asyncio.run(latencies(via_url, concurrency, n))
                rounds.append((statistics.median(direct) * 1000, statistics.median(via) * 1000))
            direct_ms = statistics.median(r[0] for r in rounds)
            via_ms = statistics.median(r[1] for r in rounds)
            out[f"c{concurrency}"] = {"direct_p50_ms": direct_ms, "via_gateway_p50_ms": via_ms, "added_p50_ms": via_ms - direct_ms}
            print(concurrency, out[f"c{concurrency}"], file=sys.stderr)
        return out
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        for proc in (gateway, backend):
            proc.terminate()
            proc.wait(timeout=30)
        os.unlink(f.name)
        os.unlink(g.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--overhead-concurrency", type=int, default=32)
    ap.add_argument("--overhead-requests", type=int, default=2000)
    ap.add_argument("--skip-affinity", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--json", default="bench-results/gateway.json")
    args = ap.parse_args()
    result = {} if args.skip_overhead else {"overhead": gateway_overhead(args)}
    if not args.skip_affinity:
        result["affinity"] = affinity_vs_round_robin(args)
    write_json(args.json, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
