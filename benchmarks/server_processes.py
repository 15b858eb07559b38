"""Where a loaded server's host CPU goes, and what giving the engine a process of its own (and the HTTP side
several) buys.

    .venv/bin/python benchmarks/server_processes.py [--concurrency 256] [--requests 512] [--output-len 64]
        [--modes process,thread,api2] [--json out.json]

`llmserve serve` runs a tiny random-weight Llama (the default model's vocabulary and tokenizer, 2 layers of width 64)
on the CPU, so that the model's arithmetic is small and the host's Python is most of each step, as on a GPU. It is
loaded by `llmserve bench` at --concurrency (64 tokens in, 64 out, EOS ignored), once with the engine in a process of
its own (--engine-process, the default on CUDA) and once in a thread of the server's process (--no-engine-process,
the default on CPU), and with --modes api2 with the engine in its own process behind 2 API-server processes
(--api-server-count 2), alternating for --rounds.

For each run: the output tok/s, the p99 inter-token latency, and the CPU seconds per 1,000 output tokens spent by the
server's process (HTTP, SSE, streams, metrics; and, with --no-engine-process, the engine too) and by its child
processes (the engine); and from a probe in those processes (gc_probe/), the garbage collector's share: its CPU
seconds per 1,000 tokens in the server's process, its full passes there, and the longest pass (a pause of the
whole process). The
client shares this machine's cores, so the tok/s here are a floor; the CPU seconds say what each side needs. In one
process the engine and the HTTP side share one GIL, so its tokens per second cannot exceed 1,000 over their sum;
with the engine in its own process, 1,000 over the larger of the engine's and the busiest HTTP process's, given a
core for each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import psutil  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from common import write_json  # noqa: E402
from gpu_bench import build_hf_model, make_tokenizer  # noqa: E402
from serving import LLMSERVE, free_port, wait_healthy  # noqa: E402

GC_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gc_probe")  # measures the collector's passes


def http_processes(proc: psutil.Process, port: int) -> list[psutil.Process]:
    """The processes that serve HTTP: those listening on the port (`llmserve serve` itself, or with
    --api-server-count its server processes)."""
    def listens(p):
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp"))
    return [p for p in [proc] + proc.children(recursive=True) if listens(p)]


def cpu_seconds(proc: psutil.Process, http: list[psutil.Process]) -> tuple[dict[int, float], float]:
    """({HTTP process id: its CPU seconds}, every other process of the server together: the engine's, a
    supervisor's): user + system."""
    served, other = {}, 0.0
    http_pids = {p.pid for p in http}
    for p in [proc] + proc.children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if p.pid in http_pids:
            served[p.pid] = t.user + t.system
        else:
            other += t.user + t.system
    return served, other


def gc_report(probe_dir: str, http_pids: set[int]) -> dict:
    """The gc probe's figures (gc_probe/sitecustomize.py): the HTTP processes summed, and the others summed."""
    sides = {"server_process": [], "engine_process": []}
    for name in os.listdir(probe_dir):
        if name.endswith(".json"):
            with open(os.path.join(probe_dir, name)) as f:
                probe = json.load(f)
            sides["server_process" if int(name[:-5]) in http_pids else "engine_process"].append(probe["generations"])
    report = {}
    for side, probes in sides.items():
        gens = [g for probe in probes for g in probe.values()]
        full = [probe["2"] for probe in probes]
        report[side] = {"gc_cpu_s": sum(g["cpu_s"] for g in gens),
                        "full_passes": sum(g["passes"] for g in full),
                        "longest_pass_ms": 1000 * max((g["longest_s"] for g in gens), default=0.0)}
    return report


def run(folder: str, args, flags: list[str]) -> dict:
    port = free_port()
    probe_dir = tempfile.mkdtemp(prefix="gc-probe-")
    env = dict(os.environ, GC_PROBE_DIR=probe_dir,
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), GC_PROBE) if p))
    server = subprocess.Popen([LLMSERVE, "serve", "--model", folder, "--port", str(port), "--device", "cpu",
                               "--dtype", "float32", "--max-num-seqs", str(args.concurrency),
                               "--max-num-batched-tokens", "8192", "--kv-cache-memory", "1GiB", "--no-webui", *flags],
                              stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 300)
        bench = [LLMSERVE, "bench", "--base-url", url + "/v1", "--input-len", "64", "--output-len", str(args.output_len),
                 "--ignore-eos", "--no-plots", "--quiet"]
        subprocess.run(bench + ["--concurrency", "16", "--num-requests", "32"], check=True)  # warm-up
        proc = psutil.Process(server.pid)
        http = http_processes(proc, port)
        own0, children0 = cpu_seconds(proc, http)
        result = os.path.join(tempfile.mkdtemp(prefix="server-processes-"), "bench.json")
        open(os.path.join(probe_dir, "arm"), "w").close()  # the gc probes count from here
        subprocess.run(bench + ["--concurrency", str(args.concurrency), "--num-requests", str(args.requests),
                                "--result", result], check=True)
        own1, children1 = cpu_seconds(proc, http)
        time.sleep(0.5)  # the probes' last reports
        gc_passes = gc_report(probe_dir, {p.pid for p in http})
        with open(result) as f:
            summary = json.load(f)["levels"][0]["summary"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = summary["total_output_tokens"]
    return {"output_tok_s": summary["output_throughput"],
            # the HTTP processes together, and the busiest one (which bounds the rate: 1,000 / it, given a core each)
            "server_process_cpu_s_per_1k_tokens": 1000 * sum(own1[p] - own0[p] for p in own1) / tokens,
            "busiest_http_process_cpu_s_per_1k_tokens": 1000 * max(own1[p] - own0[p] for p in own1) / tokens,
            "engine_process_cpu_s_per_1k_tokens": 1000 * (children1 - children0) / tokens,
            "p99_itl_ms": summary["p99_itl_ms"],
            "server_process_gc_cpu_s_per_1k_tokens": 1000 * gc_passes["server_process"]["gc_cpu_s"] / tokens,
            "server_process_gc_full_passes": gc_passes["server_process"]["full_passes"],
            "server_process_gc_longest_pass_ms": gc_passes["server_process"]["longest_pass_ms"],
            "engine_process_gc_longest_pass_ms": gc_passes["engine_process"]["longest_pass_ms"]}


def tiny_model(root: str) -> str:
    """A tiny random-weight Llama folder (2 layers of width 64, the default model's tokenizer) under root."""
    tokenizer = os.path.join(root, "tokenizer")
    make_tokenizer(tokenizer)
    folder = os.path.join(root, "tiny")
    model = build_hf_model("tiny", folder, tokenizer, torch.device("cpu"))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(folder, "model.safetensors"))
    return folder


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64,
                    help="tokens out per request (the GPU targets' workload: 256); per-request costs amortize over them")
    ap.add_argument("--modes", default="process,thread",
                    help="comma-separated: process (the engine in its own process), thread (in the server's), api2 "
                         "(its own process, and 2 API-server processes)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench-results/server_processes.json")
    args = ap.parse_args()
    folder = tiny_model(tempfile.mkdtemp(prefix="server-processes-"))
    modes = {"process": ("engine process", ["--engine-process"]),
             "thread": ("engine thread", ["--no-engine-process"]),
             "api2": ("2 API servers", ["--engine-process", "--api-server-count", "2"])}
    modes = {name: flags for key, (name, flags) in modes.items() if key in args.modes.split(",")}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, flags in modes.items():
            runs[mode].append(run(folder, args, flags))
            print(mode, runs[mode][-1], flush=True)
    report = {"concurrency": args.concurrency, "requests": args.requests, "output_len": args.output_len, "date": time.strftime("%Y-%m-%d %H:%M"),
              "runs": runs}
    print(f"\n{'mode':<16}{'output tok/s':>14}{'HTTP CPU s/1k tok':>19}{'busiest HTTP process':>22}{'engine CPU s/1k tok':>21}"
          f"{'p99 ITL ms':>12}{'server GC s/1k tok':>20}{'full GCs':>10}{'longest GC ms':>15}")
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        report[mode] = med
        print(f"{mode:<16}{med['output_tok_s']:>14.0f}{med['server_process_cpu_s_per_1k_tokens']:>19.3f}"
              f"{med['busiest_http_process_cpu_s_per_1k_tokens']:>22.3f}"
              f"{med['engine_process_cpu_s_per_1k_tokens']:>21.3f}{med['p99_itl_ms']:>12.1f}"
              f"{med['server_process_gc_cpu_s_per_1k_tokens']:>20.4f}{med['server_process_gc_full_passes']:>10.0f}"
              f"{med['server_process_gc_longest_pass_ms']:>15.1f}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
