"""What --long-prefill-token-threshold does to time to first token when short and long prompts arrive together.

    .venv/bin/python benchmarks/long_prefill_threshold.py [--threshold 256] [--rounds 3] [--json bench-results/long_prefill.json]

Each round starts `llmserve serve` (default model and settings) without the cap and with it, in alternating order,
and loads each with the same two `llmserve bench` workloads:
- mixed: prompts of 120 to 2,280 tokens (synthetic, --input-len 1200 --range-ratio 0.9, fixed seed), 32 out, EOS
  ignored, 8 at a time; TTFT p50 of the shortest third of the prompts and of the longest third, overall TTFT p50 and
  p90, output tok/s;
- behind a long one: one ~6,000-token prompt, then 12 prompts of ~40 tokens arriving at 6/s (Poisson, fixed seed),
  8 out each; the long prompt's TTFT and the short ones' TTFT p50 and p90.
Reported per side: medians over rounds; the ratios are capped / uncapped (below 1: sooner, for TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json
from serving import LLMSERVE, llmserve_server

WORKLOAD = ["--input-len", "1200", "--range-ratio", "0.9", "--output-len", "32", "--ignore-eos", "--concurrency",
            "8", "--num-requests", "32", "--warmup", "2", "--seed", "7"]


def measure(base_url: str, result: str) -> dict:
    subprocess.run([LLMSERVE, "bench", "--base-url", base_url + "/v1", *WORKLOAD, "--result", result, "--no-plots",
                    "--quiet"], check=True, stdout=subprocess.DEVNULL)
    with open(result) as f:
        level = json.load(f)["levels"][0]
    requests = sorted((r for r in level["requests"] if r["status"] == "ok"), key=lambda r: r["input_tokens"])
    third = len(requests) // 3
    return {"short_p50_ttft_ms": 1000 * statistics.median(r["ttft"] for r in requests[:third]),
            "long_p50_ttft_ms": 1000 * statistics.median(r["ttft"] for r in requests[-third:]),
            "p50_ttft_ms": level["summary"]["p50_ttft_ms"], "p90_ttft_ms": level["summary"]["p90_ttft_ms"],
            "output_throughput": level["summary"]["output_throughput"]}


def behind_a_long_prompt_dataset(path: str) -> None:
    """One ~6,000-token prompt, then 12 distinct ~40-token ones (distinct, so that no prefix is cached)."""
    from llmserve.loader import load_model_files

    tok = load_model_files(None).tokenizer
    words = "the river carried small stones past the old mill while the miller counted sacks of grain".split()
    long_text, n = [], 0
    while n < 6000:
        long_text.append(words[len(long_text) % len(words)])
        n = len(tok.encode(" ".join(long_text))) if len(long_text) % 200 == 0 else n
    rows = [{"prompt": " ".join(long_text), "max_tokens": 8}]
    rows += [{"prompt": f"Question {i}: in one word, what colour is a {w} leaf in autumn, and why does it change "
                        f"colour at all?", "max_tokens": 8} for i, w in enumerate(words[:12])]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def measure_behind_a_long_prompt(base_url: str, dataset: str, result: str) -> dict:
    subprocess.run([LLMSERVE, "bench", "--base-url", base_url + "/v1", "--dataset", dataset, "--request-rate", "6",
                    "--num-requests", "13", "--warmup", "0", "--ignore-eos", "--seed", "7", "--result", result,
                    "--no-plots", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    with open(result) as f:
        requests = sorted(json.load(f)["levels"][0]["requests"], key=lambda r: r["index"])
    assert requests[0]["input_tokens"] > 5000, "the long prompt must go first"
    short = sorted(1000 * r["ttft"] for r in requests[1:])
    return {"long_ttft_ms": 1000 * requests[0]["ttft"], "short_p50_ttft_ms": statistics.median(short),
            "short_p90_ttft_ms": short[int(0.9 * (len(short) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threshold", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="bench-results/long_prefill.json")
    args = ap.parse_args()
    sides = {"uncapped": ["--long-prefill-token-threshold", "0"],
             "capped": ["--long-prefill-token-threshold", str(args.threshold)]}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = os.path.join(tmp, "behind_a_long_prompt.jsonl")
        behind_a_long_prompt_dataset(dataset)
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                with llmserve_server("--disable-log-stats", *sides[name]) as url:
                    mixed = measure(url, os.path.join(tmp, f"{name}{i}.json"))
                    behind = measure_behind_a_long_prompt(url, dataset, os.path.join(tmp, f"{name}{i}b.json"))
                    runs[name].append({**{f"mixed_{k}": v for k, v in mixed.items()},
                                       **{f"behind_{k}": v for k, v in behind.items()}})
                print(f"round {i + 1} {name}: {runs[name][-1]}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratios = {k: medians["capped"][k] / medians["uncapped"][k] for k in medians["capped"]}
    for name, m in medians.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    print("capped / uncapped: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    write_json(args.json, {"threshold": args.threshold, "rounds": runs, "medians": medians, "ratios": ratios})


if __name__ == "__main__":
    main()
