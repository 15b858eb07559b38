"""Benchmark figures with `vllm bench serve`'s definitions.

TTFT  = send -> first streamed chunk with text (reasoning_content included).
TTFVT = send -> first chunk with visible answer text or a tool call: hidden thinking counts against it, not TTFT.
TPOT  = (E2E - TTFT) / (output tokens - 1), per request (requests with one output token have none).
ITL   = every gap between consecutive text chunks, pooled over all requests (AIPerf calls TPOT "ITL").
E2E   = send -> last byte of the stream.
Throughputs divide by the level's wall time (first send -> last completion); goodput counts only the
requests that met every SLO given. Percentiles interpolate linearly (numpy's default, as vLLM).
Rejections (HTTP 429/503) and failures are counted apart and excluded from the latency figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmserve.bench.backends import RequestRecord
from llmserve.errors import InvalidRequestError

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "SLO":
        """"ttft_ms=500,tpot_ms=50" -> SLO(500, 50, None)."""
        if not text:
            return cls()
        values = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in SLO_KEYS:
                raise InvalidRequestError(f"bad --slo entry {part!r}: use {', '.join(k + '=MS' for k in SLO_KEYS)}", "slo")
            try:
                values[key] = float(value)
            except ValueError:
                raise InvalidRequestError(f"bad --slo value {value!r} for {key}: a number of milliseconds", "slo") from None
            if values[key] <= 0:
                raise InvalidRequestError(f"--slo {key} must be positive", "slo")
        return cls(**values)

    def met_by(self, r: RequestRecord) -> bool:
        if r.status != "ok":
            return False
        if self.ttft_ms is not None and r.ttft * 1000 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and r.e2e * 1000 > self.e2e_ms)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in SLO_KEYS if getattr(self, k) is not None}


def _stats(name: str, values_s: list[float]) -> dict:
    if not values_s:
        return {f"mean_{name}_ms": None, **{f"p{p}_{name}_ms": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    out = {f"mean_{name}_ms": float(ms.mean())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO = SLO()) -> dict:
    ok = [r for r in records if r.status == "ok"]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.input_tokens or 0 for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    duration_s = max(duration_s, 1e-9)
    summary = {
        "completed": len(ok),
        "rejected": sum(r.status == "rejected" for r in records),
        "failed": sum(r.status == "failed" for r in records),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cached_input_tokens": sum(r.cached_tokens or 0 for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        **_stats("ttft", [r.ttft for r in ok if r.ttft is not None]),  # (none for embeddings: nothing streams)
        **_stats("ttfvt", [r.ttfvt for r in ok if r.ttfvt is not None]),
        **_stats("tpot", tpots),
        **_stats("itl", [g for r in ok for g in r.itl]),
        **_stats("e2e", [r.e2e for r in ok]),
    }
    # Interactivity: tokens/s one user sees once streaming started; the y axis of the Pareto plot.
    summary["output_throughput_per_user"] = 1000 / summary["mean_tpot_ms"] if summary["mean_tpot_ms"] else None
    if slo.as_dict():
        good = sum(slo.met_by(r) for r in ok)
        summary["slo"] = slo.as_dict()
        summary["good_requests"] = good
        summary["goodput"] = good / duration_s
    return summary
