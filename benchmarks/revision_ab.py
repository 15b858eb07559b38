"""Same-run A/B of this checkout against another git revision: pp512, batch-1 decode (tg128) and a serving sweep.

    .venv/bin/python benchmarks/revision_ab.py --base f2a6c39 [--rounds 2] [--concurrency 1,8,32]
        [--flags=--compile] [--offline-only | --serving-only] [--decodes 3] [--json bench-results/revision_ab.json]

The base revision is checked out beside this one (git worktree, outside the repository). Each round measures both
sides, base first in odd rounds and this checkout first in even ones, so that the machine's drift falls on both;
each side runs in its own processes with its own code on PYTHONPATH (and its own native kernels build):
- offline: one 512-token prompt through LLM (median of 5) and 128 greedy tokens from a 1-token prompt (median of 3,
  or --decodes);
- serving: `llmserve serve` from that side, loaded by this checkout's `llmserve bench` (200-token prompts, 128 output
  tokens, EOS ignored, streaming) at each concurrency.
Ratios are this checkout / base (above 1: faster), per round and the median over rounds.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import checkout_beside, write_json
from serving import free_port, sweep, wait_healthy

HERE = Path(__file__).resolve().parent.parent
OFFLINE = """
import json, sys
sys.path.append(sys.argv[1])
from vs_llamacpp import llmserve_offline
from llmserve.loader import default_model_path
print("RESULT " + json.dumps(llmserve_offline(default_model_path(), int(sys.argv[3]), **json.loads(sys.argv[2]))))
"""


def side_env(checkout: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(checkout)}


def offline(checkout: Path, settings: dict, decodes: int = 3) -> dict:
    out = subprocess.run([sys.executable, "-c", OFFLINE, str(HERE / "benchmarks"), json.dumps(settings), str(decodes)],
                         cwd=checkout, env=side_env(checkout), capture_output=True, text=True, check=True)
    return json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[7:])


def serving(checkout: Path, flags: list[str], concurrency: str, label: str, out_dir: str) -> dict:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--port", str(port), *flags], cwd=checkout,
                              env=side_env(checkout), stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 600)
        levels = sweep(f"http://127.0.0.1:{port}", label, concurrency, f"{out_dir}/{label}.json", None)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {c: s["output_throughput"] for c, s in levels.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--flags", default="", help="server flags for both sides, e.g. --flags=--compile")
    ap.add_argument("--offline-only", action="store_true", help="pp512 and tg128 only, no serving sweep")
    ap.add_argument("--serving-only", action="store_true", help="the serving sweep only, no pp512 and tg128")
    ap.add_argument("--decodes", type=int, default=3,
                    help="tg128 is the median of this many decodes in each side's process (more: less noise)")
    ap.add_argument("--json", default="bench-results/revision_ab.json")
    args = ap.parse_args()
    flags = args.flags.split()
    settings = {"compile": True} if "--compile" in flags else {}
    base = checkout_beside(args.base)
    sides = [("base", base, settings, flags), ("new", HERE, settings, flags)]
    rounds, median = alternating_rounds(sides, args.rounds, args.concurrency, args.offline_only, "revision-ab-",
                                        args.serving_only, args.decodes)
    write_json(args.json, {"base": args.base, "flags": flags, "rounds": rounds, "median_ratios": median})


def alternating_rounds(sides, rounds: int, concurrency: str, offline_only: bool, tmp_prefix: str,
                       serving_only: bool = False, decodes: int = 3):
    """Each round measures both sides (name, checkout, offline settings, server flags), the first side first in odd
    rounds and last in even ones, so that the machine's drift falls on both. Returns the rounds (figures, and the
    second side's over the first's) and the median ratios."""
    out_dir = tempfile.mkdtemp(prefix=tmp_prefix)
    (ref, *_), (other, *_) = sides
    results = []
    for r in range(rounds):
        result = {}
        for name, checkout, settings, flags in sides if r % 2 == 0 else sides[::-1]:
            t = time.perf_counter()
            result[name] = {} if serving_only else offline(checkout, settings, decodes)
            if not offline_only:
                result[name].update({f"c={c}": v for c, v in
                                     serving(checkout, flags, concurrency, f"{name}{r}", out_dir).items()})
            print(f"round {r + 1} {name}: {result[name]} ({time.perf_counter() - t:.0f} s)", flush=True)
        ratios = {k: result[other][k] / result[ref][k] for k in result[ref]}
        print(f"round {r + 1} {other} / {ref}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
        results.append({"figures": result, "ratios": ratios})
    median = {k: statistics.median(rd["ratios"][k] for rd in results) for k in results[0]["ratios"]}
    print(f"median {other} / {ref}: " + ", ".join(f"{k} {v:.3f}" for k, v in median.items()))
    return results, median


if __name__ == "__main__":
    main()
