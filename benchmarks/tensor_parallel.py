"""Tensor parallelism on this machine: two ranks (one core each) against one rank (both cores), same run: pp512,
batch-1 decode (tg128) and a serving sweep, on the default model.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 2] [--concurrency 1,8,32] [--json bench-results/tensor_parallel.json]

Both sides are this checkout; each round measures both, one rank first in odd rounds and two ranks first in even
ones, each in its own processes (revision_ab.py's offline and serving measurements: one 512-token prompt, median of
5; 128 greedy tokens from a 1-token prompt, median of 3; `llmserve serve` loaded by `llmserve bench` with 200-token
prompts, 128 output tokens, at each concurrency). Ratios are two ranks / one rank (above 1: faster).

It also times what tensor parallelism adds to every step, with two ranks: one all-reduce of a hidden-state row block
(the model has two per layer, 60 per step on the default model) at 1 and 32 rows, through gloo over loopback and
through shared memory (what spawned CPU ranks use), and the broadcast of a step input (gloo).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json
from revision_ab import HERE, alternating_rounds


def _median_us(call, warmup: int, calls: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _collective_costs(rank: int, port: int, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from llmserve.engine.step_io import ScheduledRow, StepInput

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for rows in (1, 32):
        x = torch.randn(rows, 576)  # the default model's hidden size
        us = _median_us(lambda: dist.all_reduce(x), 50, 500)
        if rank == 0:
            out[f"all_reduce_{rows}_rows_us"] = us
    step = StepInput([ScheduledRow(str(i), [100 + i], 200, list(range(14)), True, 12) for i in range(32)])
    times = []
    for _ in range(200):
        box = [step if rank == 0 else None]
        t = time.perf_counter()
        dist.broadcast_object_list(box, src=0)
        times.append(time.perf_counter() - t)
    if rank == 0:
        out["broadcast_step_input_32_rows_us"] = statistics.median(times) * 1e6
    # the same all-reduces through shared memory, as spawned CPU ranks run them (distributed/shm_collectives.py)
    from llmserve.distributed.shm_collectives import SharedMemoryCollectives, segment_path

    box = [segment_path() if rank == 0 else None]
    if rank == 0:
        shm = SharedMemoryCollectives(box[0], 0, 2, lambda: True, 60, create=True)
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        shm = SharedMemoryCollectives(box[0], 1, 2, lambda: True, 60, create=False)
    dist.barrier()
    if rank == 0:
        os.unlink(box[0])
    for rows in (1, 32):
        x = torch.randn(rows, 576)
        us = _median_us(lambda: shm.all_reduce(x), 50, 2000)
        if rank == 0:
            out[f"shm_all_reduce_{rows}_rows_us"] = us
    dist.destroy_process_group()


def collective_costs() -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_collective_costs, args=(port, out), nprocs=2)
    return dict(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--offline-only", action="store_true", help="pp512 and tg128 only, no serving sweep")
    ap.add_argument("--json", default="bench-results/tensor_parallel.json")
    args = ap.parse_args()
    costs = collective_costs()
    print("per-step collectives:", ", ".join(f"{k} {v:.0f}" for k, v in costs.items()), flush=True)
    sides = [("tp1", HERE, {}, []), ("tp2", HERE, {"tensor_parallel_size": 2}, ["--tensor-parallel-size", "2"])]
    rounds, median = alternating_rounds(sides, args.rounds, args.concurrency, args.offline_only, "tensor-parallel-ab-")
    write_json(args.json, {"collectives": costs, "rounds": rounds, "median_ratios": median})


if __name__ == "__main__":
    main()
