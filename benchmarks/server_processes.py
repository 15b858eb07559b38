"""Where a loaded server's host CPU goes, and what giving the engine a process of its own buys.

    .venv/bin/python benchmarks/server_processes.py [--concurrency 256] [--requests 512] [--json out.json]

`llmserve serve` runs a tiny random-weight Llama (the default model's vocabulary and tokenizer, 2 layers of width 64)
on the CPU, so that the model's arithmetic is small and the host's Python is most of each step, as on a GPU. It is
loaded by `llmserve bench` at --concurrency (64 tokens in, 64 out, EOS ignored), once with the engine in a process of
its own (--engine-process, the default on CUDA) and once in a thread of the server's process (--no-engine-process,
the default on CPU), alternating for --rounds.

For each run: the output tok/s, and the CPU seconds per 1,000 output tokens spent by the server's process (HTTP,
SSE, streams, metrics; and, with --no-engine-process, the engine too) and by its child processes (the engine). The
client shares this machine's cores, so the tok/s here are a floor; the CPU seconds say what each side needs. In one
process the engine and the HTTP side share one GIL, so its tokens per second cannot exceed 1,000 over their sum;
with the engine in its own process, 1,000 over the larger of the two, given a core for each.
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


def cpu_seconds(proc: psutil.Process) -> tuple[float, float]:
    """(this process, its descendants): user + system CPU seconds."""
    own = proc.cpu_times()
    children = 0.0
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
            children += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return own.user + own.system, children


def run(folder: str, args, flags: list[str]) -> dict:
    port = free_port()
    server = subprocess.Popen([LLMSERVE, "serve", "--model", folder, "--port", str(port), "--device", "cpu",
                               "--dtype", "float32", "--max-num-seqs", str(args.concurrency),
                               "--max-num-batched-tokens", "8192", "--kv-cache-memory", "1GiB", "--no-webui", *flags],
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 300)
        bench = [LLMSERVE, "bench", "--base-url", url + "/v1", "--input-len", "64", "--output-len", "64", "--ignore-eos",
                 "--no-plots", "--quiet"]
        subprocess.run(bench + ["--concurrency", "16", "--num-requests", "32"], check=True)  # warm-up
        proc = psutil.Process(server.pid)
        own0, children0 = cpu_seconds(proc)
        result = os.path.join(tempfile.mkdtemp(prefix="server-processes-"), "bench.json")
        subprocess.run(bench + ["--concurrency", str(args.concurrency), "--num-requests", str(args.requests),
                                "--result", result], check=True)
        own1, children1 = cpu_seconds(proc)
        with open(result) as f:
            summary = json.load(f)["levels"][0]["summary"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = summary["total_output_tokens"]
    return {"output_tok_s": summary["output_throughput"],
            "server_process_cpu_s_per_1k_tokens": 1000 * (own1 - own0) / tokens,
            "engine_process_cpu_s_per_1k_tokens": 1000 * (children1 - children0) / tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="bench-results/server_processes.json")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="server-processes-")
    tokenizer = os.path.join(root, "tokenizer")
    make_tokenizer(tokenizer)
    folder = os.path.join(root, "tiny")
    model = build_hf_model("tiny", folder, tokenizer, torch.device("cpu"))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(folder, "model.safetensors"))
    modes = {"engine process": ["--engine-process"], "engine thread": ["--no-engine-process"]}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, flags in modes.items():
            runs[mode].append(run(folder, args, flags))
            print(mode, runs[mode][-1], flush=True)
    report = {"concurrency": args.concurrency, "requests": args.requests, "date": time.strftime("%Y-%m-%d %H:%M"),
              "runs": runs}
    print(f"\n{'mode':<16}{'output tok/s':>14}{'server CPU s/1k tok':>22}{'engine CPU s/1k tok':>22}")
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        report[mode] = med
        print(f"{mode:<16}{med['output_tok_s']:>14.0f}{med['server_process_cpu_s_per_1k_tokens']:>22.3f}"
              f"{med['engine_process_cpu_s_per_1k_tokens']:>22.3f}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
