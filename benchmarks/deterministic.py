"""Same-run A/B of the deterministic mode (--deterministic) against the default mode: pp512, batch-1 decode (tg128)
and a serving sweep, on the default model.

    .venv/bin/python benchmarks/deterministic.py [--rounds 2] [--concurrency 1,8,32] [--json bench-results/deterministic.json]

Both sides are this checkout; each round measures both, default first in odd rounds and deterministic first in even
ones, each in its own processes (revision_ab.py's offline and serving measurements: one 512-token prompt, median of
5; 128 greedy tokens from a 1-token prompt, median of 3; `llmserve serve` loaded by `llmserve bench` with 200-token
prompts, 128 output tokens, at each concurrency). Ratios are deterministic / default (above 1: faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json
from revision_ab import HERE, offline, serving


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--offline-only", action="store_true", help="pp512 and tg128 only, no serving sweep")
    ap.add_argument("--json", default="bench-results/deterministic.json")
    args = ap.parse_args()
    out_dir = tempfile.mkdtemp(prefix="deterministic-ab-")
    sides = [("default", {}, []), ("deterministic", {"deterministic": True}, ["--deterministic"])]
    rounds = []
    for r in range(args.rounds):
        result = {}
        for name, settings, flags in sides if r % 2 == 0 else sides[::-1]:
            t = time.perf_counter()
            result[name] = offline(HERE, settings)
            if not args.offline_only:
                result[name].update({f"c={c}": v for c, v in
                                     serving(HERE, flags, args.concurrency, f"{name}{r}", out_dir).items()})
            print(f"round {r + 1} {name}: {result[name]} ({time.perf_counter() - t:.0f} s)", flush=True)
        ratios = {k: result["deterministic"][k] / result["default"][k] for k in result["default"]}
        print(f"round {r + 1} deterministic / default: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()),
              flush=True)
        rounds.append({"figures": result, "ratios": ratios})
    median = {k: statistics.median(rd["ratios"][k] for rd in rounds) for k in rounds[0]["ratios"]}
    print("median deterministic / default: " + ", ".join(f"{k} {v:.3f}" for k, v in median.items()))
    write_json(args.json, {"rounds": rounds, "median_ratios": median})


if __name__ == "__main__":
    main()
