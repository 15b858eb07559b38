"""Summary tables, result files, plots and side-by-side comparison of two result files."""

from __future__ import annotations

import json
import os

from llmserve.bench.metrics import PERCENTILES
from llmserve.errors import InvalidRequestError

# (key in the summary, label, format)
TABLE_ROWS = [
    ("completed", "completed requests", "{:.0f}"),
    ("rejected", "rejected (429/503)", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("duration_s", "duration (s)", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.3f}"),
    ("goodput", "goodput (req/s within SLO)", "{:.3f}"),
    ("output_throughput", "output tokens/s", "{:.1f}"),
    ("total_token_throughput", "total tokens/s", "{:.1f}"),
    ("output_throughput_per_user", "output tokens/s per user", "{:.1f}"),
    ("cached_input_tokens", "cached input tokens", "{:.0f}"),
] + [
    (f"{stat}_{m}_ms", f"{stat} {m.upper()} (ms)", "{:.1f}")
    for m in ("ttft", "ttfvt", "tpot", "itl", "e2e") for stat in ("mean", *(f"p{p}" for p in PERCENTILES))
]
SPEC_ROWS = [
    ("spec_acceptance_rate", "draft acceptance rate", "{:.3f}"),
    ("spec_mean_accepted_length", "mean accepted length", "{:.2f}"),
]


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def summary_table(levels: list[dict]) -> str:
    headers = ["metric"] + [lv["label"] for lv in levels]
    rows = []
    for key, label, fmt in TABLE_ROWS + SPEC_ROWS:
        if all(key not in lv["summary"] for lv in levels):
            continue
        rows.append([label] + [_fmt(lv["summary"].get(key), fmt) for lv in levels])
    return format_table(headers, rows)


def write_result(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def load_result(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror}", "result") from None
    except json.JSONDecodeError:
        raise InvalidRequestError(f"{path} is not a JSON result file of llmserve bench", "result") from None
    if not isinstance(result, dict) or "levels" not in result:
        raise InvalidRequestError(f"{path} is not a result file of llmserve bench (no \"levels\")", "result")
    return result


def compare_table(a: dict, b: dict, name_a: str, name_b: str) -> str:
    """Levels are matched by their load label; each metric shows A, B and B/A."""
    blocks = []
    by_label = {lv["label"]: lv for lv in b["levels"]}
    for lva in a["levels"]:
        lvb = by_label.get(lva["label"])
        if lvb is None:
            continue
        rows = []
        for key, label, fmt in TABLE_ROWS + SPEC_ROWS:
            va, vb = lva["summary"].get(key), lvb["summary"].get(key)
            if va is None and vb is None:
                continue
            ratio = f"{vb / va:.2f}x" if va and vb is not None else "-"
            rows.append([label, _fmt(va, fmt), _fmt(vb, fmt), ratio])
        blocks.append(f"## {lva['label']}\n" + format_table(["metric", name_a, name_b, "B/A"], rows))
    if not blocks:
        raise InvalidRequestError("the two result files have no load level in common (compare runs of the same sweep)", "result")
    return "\n\n".join(blocks)


def plot_results(results: list[tuple[str, dict]], prefix: str) -> list[str]:
    """Pareto curve (per-user vs total output tokens/s), TTFT and ITL distributions. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for name, result in results:
        pts = [(lv["summary"]["output_throughput"], lv["summary"]["output_throughput_per_user"], lv["label"])
               for lv in result["levels"] if lv["summary"].get("output_throughput_per_user")]
        if not pts:
            continue
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, y, label in pts:
            ax.annotate(label.replace("concurrency ", "c="), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("total output throughput (tokens/s)")
    ax.set_ylabel("output tokens/s per user (1 / mean TPOT)")
    ax.set_title("Throughput vs interactivity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, prefix + ".pareto.png"))

    for metric, key, title in (("ttft", "ttft", "Time to first token"), ("itl", None, "Inter-token latency")):
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for name, result in results:
            for lv in result["levels"]:
                ok = [r for r in lv["requests"] if r["status"] == "ok"]
                if key:
                    values = [r[key] for r in ok if r[key] is not None]
                else:
                    values = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
                if not values:
                    continue
                ms = np.sort(np.asarray(values) * 1000)
                tag = lv["label"] if len(results) == 1 else f"{name}: {lv['label']}"
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=tag)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if key else "token gaps"))
        ax.set_title(f"{title}: cumulative distribution")
        if metric == "itl":
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, f"{prefix}.{metric}.png"))
    return paths


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
