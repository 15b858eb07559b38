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
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json
from revision_ab import HERE, alternating_rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--offline-only", action="store_true", help="pp512 and tg128 only, no serving sweep")
    ap.add_argument("--json", default="bench-results/deterministic.json")
    args = ap.parse_args()
    sides = [("default", HERE, {}, []), ("deterministic", HERE, {"deterministic": True}, ["--deterministic"])]
    rounds, median = alternating_rounds(sides, args.rounds, args.concurrency, args.offline_only, "deterministic-ab-")
    write_json(args.json, {"rounds": rounds, "median_ratios": median})


if __name__ == "__main__":
    main()
