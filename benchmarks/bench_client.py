"""The CPU that `llmserve bench`'s own client spends per 1,000 streamed tokens, this checkout's against a base revision's,
or this checkout's with one client process against several (--client-processes 1,2: the busiest process's CPU, which
bounds what the client can measure).

    .venv/bin/python benchmarks/bench_client.py --base e013ed6 [--rounds 3] [--concurrency 256] [--requests 768]
    .venv/bin/python benchmarks/bench_client.py --client-processes 1,2 [--rounds 3]

One server (this checkout's `llmserve serve --engine-process`, the tiny random-weight Llama of server_processes.py on
the CPU) is loaded in turn by each side's `llmserve bench` (64 tokens in, 64 out, EOS ignored). A client's CPU is
its process's user + system seconds, less its start-up (a run of one request, measured the same way). A client that
spends C seconds per 1,000 tokens cannot measure more than 1,000 / C tok/s, whatever the server does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from common import checkout_beside, write_json  # noqa: E402
from serving import LLMSERVE, free_port, wait_healthy  # noqa: E402
from server_processes import tiny_model  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_command(url: str, concurrency: int, requests: int, *flags: str) -> tuple[list[str], str]:
    """`llmserve bench` of 64 tokens in and 64 out at that load, and the file its result goes to."""
    result = os.path.join(tempfile.mkdtemp(prefix="bench-client-"), "bench.json")
    return [LLMSERVE, "bench", "--base-url", url + "/v1", "--input-len", "64", "--output-len", "64", "--ignore-eos",
            "--no-plots", "--quiet", "--concurrency", str(concurrency), "--num-requests", str(requests),
            "--result", result, *flags], result


def client_run(checkout: Path, url: str, concurrency: int, requests: int) -> tuple[float, dict]:
    """(CPU seconds, the bench's summary) of one `llmserve bench` run of that checkout's code."""
    command, result = bench_command(url, concurrency, requests)
    before = children_cpu()
    subprocess.run(command, env={**os.environ, "PYTHONPATH": str(checkout)}, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    cpu = children_cpu() - before
    with open(result) as f:
        return cpu, json.load(f)["levels"][0]["summary"]


def client_tree_run(url: str, concurrency: int, requests: int, processes: int) -> tuple[float, list[float], dict]:
    """(the main process's CPU seconds, each client process's, the bench's summary) of one `llmserve bench
    --client-processes N` run, its processes' CPU sampled every 0.1 s until they exit."""
    import psutil

    command, result = bench_command(url, concurrency, requests, "--client-processes", str(processes))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu: dict[int, float] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    assert proc.wait() == 0
    with open(result) as f:
        summary = json.load(f)["levels"][0]["summary"]
    main = cpu.pop(proc.pid)
    return main, sorted(cpu.values()), summary


def compare_processes(args, url: str, counts: list[int]) -> dict:
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else reversed(counts)):
            # each process's start-up, from a run of one request: the same processes (the client processes and
            # multiprocessing's resource tracker), matched by rank of their CPU
            main_start, others_start, _ = client_tree_run(url, 1, 1, n)
            main, others, summary = client_tree_run(url, args.concurrency, args.requests, n)
            work = [main - main_start] + [c - c0 for c, c0 in zip(others, others_start)]
            tokens = summary["total_output_tokens"]
            runs[n].append({"busiest_process_cpu_s_per_1k_tokens": 1000 * max(work) / tokens,
                            "all_processes_cpu_s_per_1k_tokens": 1000 * sum(work) / tokens,
                            "output_tok_s": summary["output_throughput"], "p99_itl_ms": summary["p99_itl_ms"]})
            print(n, runs[n][-1], flush=True)
    report = {"concurrency": args.concurrency, "requests": args.requests, "runs": runs}
    print(f"\n{'client processes':<18}{'busiest CPU s per 1k tokens':>29}{'all':>8}{'output tok/s':>14}"
          f"{'p99 ITL ms':>12}")
    for n, rs in runs.items():
        med = report[f"processes={n}"] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{n:<18}{med['busiest_process_cpu_s_per_1k_tokens']:>29.3f}"
              f"{med['all_processes_cpu_s_per_1k_tokens']:>8.3f}{med['output_tok_s']:>14.0f}{med['p99_itl_ms']:>12.1f}")
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the git revision whose client to compare against")
    ap.add_argument("--client-processes", default=None, help="instead: this checkout's client with these numbers of "
                    "client processes, e.g. 1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--json", default="bench-results/bench_client.json")
    args = ap.parse_args()
    if (args.base is None) == (args.client_processes is None):
        ap.error("give --base or --client-processes")
    if args.base is not None:
        base = checkout_beside(args.base)
    folder = tiny_model(tempfile.mkdtemp(prefix="bench-client-"))
    port = free_port()
    server = subprocess.Popen([LLMSERVE, "serve", "--model", folder, "--port", str(port), "--device", "cpu",
                               "--dtype", "float32", "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens",
                               "8192", "--kv-cache-memory", "1GiB", "--no-webui", "--engine-process"],
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 300, server)
        client_run(HERE, url, 16, 32)  # the server's warm-up
        if args.client_processes is not None:
            write_json(args.json, compare_processes(args, url, [int(n) for n in args.client_processes.split(",")]))
            return
        sides = {"base": base, "new": HERE}
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(args.rounds):
            for side, checkout in (sides.items() if r % 2 == 0 else reversed(sides.items())):
                client_run(checkout, url, 16, 32)  # the server's warm-up
                start_up, _ = client_run(checkout, url, 1, 1)
                cpu, summary = client_run(checkout, url, args.concurrency, args.requests)
                tokens = summary["total_output_tokens"]
                runs[side].append({"client_cpu_s_per_1k_tokens": 1000 * (cpu - start_up) / tokens,
                                   "start_up_cpu_s": start_up, "output_tok_s": summary["output_throughput"],
                                   "p99_itl_ms": summary["p99_itl_ms"]})
                print(side, runs[side][-1], flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = {"base": args.base, "concurrency": args.concurrency, "requests": args.requests, "runs": runs}
    print(f"\n{'client':<8}{'CPU s per 1k tokens':>21}{'output tok/s':>14}{'p99 ITL ms':>12}")
    for side, rs in runs.items():
        med = report[side] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{side:<8}{med['client_cpu_s_per_1k_tokens']:>21.3f}{med['output_tok_s']:>14.0f}{med['p99_itl_ms']:>12.1f}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
