"""The chapter's serving arithmetic, from a model's real shape: memory, FLOPs, rooflines, KV transfer, cost.

Units: bytes and FLOPs as plain numbers; GB = 1e9 bytes (as vendors quote memory), KiB = 1024 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmserve.errors import InvalidRequestError
from llmserve.plan.hardware import Hardware
from llmserve.plan.models import ModelSpec
from llmserve.plan.pricing import HOSTED_PRICES, HOSTED_PRICES_AS_OF

# Bits per weight, block scales included (NVFP4: 16-element blocks with FP8 scales; MXFP4: 32-element blocks, E8M0).
WEIGHT_BITS = {"FP32": 32, "BF16": 16, "FP16": 16, "FP8": 8, "INT8": 8, "INT4": 4, "NVFP4": 4.5, "MXFP4": 4.25}
KV_BYTES = {"FP32": 4, "BF16": 2, "FP16": 2, "FP8": 1}


def weight_bits(fmt: str) -> float:
    key = fmt.upper()
    if key in WEIGHT_BITS:
        return WEIGHT_BITS[key]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[key]]
    except KeyError:
        raise InvalidRequestError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_BITS)} or a GGUF type "
                                  "such as Q4_K, Q8_0", "weight_dtype") from None
    return size * 8 / block


@dataclass(frozen=True)
class PlanInputs:
    spec: ModelSpec
    hardware: Hardware
    weight_format: str | None = None  # None: as stored (a GGUF's file bytes), else BF16
    kv_format: str = "BF16"
    context: int = 8192
    batch: int = 1
    tensor_parallel: int = 1
    prompt_len: int | None = None  # for TTFT and the KV handoff (default: the context)
    mfu: float = 0.4  # fraction of peak FLOP/s that matmuls reach
    overhead_fraction: float = 0.06  # activations and runtime, on top of weights + KV (the chapter: 5-10%)
    memory_utilization: float = 1.0  # share of device memory the engine may fill
    link_gbps: float = 400.0  # prefill -> decode KV link
    handoff_ms: float = 50.0  # queueing and set-up of a remote prefill, before any KV moves
    gpu_hour_price: float | None = None  # per device; default: the catalogue's
    utilization: float = 0.6  # share of hours that do useful work, for cost
    input_per_output: float = 3.0  # input tokens per output token, for blended cost

    def validate(self) -> None:
        for name in ("context", "batch", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}", name)
        if self.prompt_len is not None and self.prompt_len < 1:
            raise InvalidRequestError(f"prompt-len must be at least 1, got {self.prompt_len}", "prompt_len")
        for name in ("mfu", "memory_utilization", "utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidRequestError(f"{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}", name)
        for name in ("overhead_fraction", "handoff_ms", "input_per_output"):
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"{name.replace('_', '-')} must not be negative", name)
        if self.link_gbps <= 0:
            raise InvalidRequestError("link-gbps must be positive", "link_gbps")
        if self.gpu_hour_price is not None and self.gpu_hour_price <= 0:
            raise InvalidRequestError("gpu-hour-price must be positive", "gpu_hour_price")
        if self.kv_format.upper() not in KV_BYTES:
            raise InvalidRequestError(f"unknown KV format {self.kv_format!r}; use one of {', '.join(KV_BYTES)}", "kv_dtype")
        if self.weight_format is not None:
            weight_bits(self.weight_format)


class Planner:
    def __init__(self, inputs: PlanInputs):
        inputs.validate()
        self.i = inputs
        self.spec, self.hw = inputs.spec, inputs.hardware
        self.kv_bytes = KV_BYTES[inputs.kv_format.upper()]
        self.prompt_len = inputs.prompt_len or inputs.context

    # ---- memory --------------------------------------------------------------------------------
    @property
    def weight_format(self) -> str:
        if self.i.weight_format:
            return self.i.weight_format.upper()
        return self.spec.native_weight_format if self.spec.file_weight_bytes else "BF16"

    def weights_bytes(self) -> float:
        if self.i.weight_format is None and self.spec.file_weight_bytes:
            return float(self.spec.file_weight_bytes)
        return self.spec.total_params * weight_bits(self.weight_format) / 8

    def kv_per_request(self, context: int | None = None) -> float:
        return self.spec.kv_bytes_per_request(context or self.i.context, self.kv_bytes)

    def kv_share_per_device(self, tp: int) -> float:
        """KV heads split across devices; with fewer KV heads than devices each device keeps whole heads (replicas)."""
        if self.spec.is_mla:
            return 1.0  # one latent per token, replicated on every device
        return math.ceil(self.spec.num_kv_heads / tp) / self.spec.num_kv_heads

    def per_device_bytes(self, tp: int, batch: int) -> float:
        weights = self.weights_bytes() / tp
        kv = self.kv_per_request() * batch * self.kv_share_per_device(tp)
        return (weights + kv) * (1 + self.i.overhead_fraction)

    def capacity(self) -> float:
        return self.hw.memory_gb * 1e9 * self.i.memory_utilization

    def max_batch(self, tp: int) -> int:
        room = self.capacity() / (1 + self.i.overhead_fraction) - self.weights_bytes() / tp
        per_request = self.kv_per_request() * self.kv_share_per_device(tp)
        return max(0, int(room // per_request)) if room > 0 else 0

    def devices_needed(self) -> int | None:
        tp = 1
        while tp <= 1024:
            if self.per_device_bytes(tp, self.i.batch) <= self.capacity():
                return tp
            tp *= 2
        return None

    # ---- compute -----------------------------------------------------------------------------------
    def flops_per_token(self, context: int) -> float:
        return 2.0 * self.spec.active_params + self.spec.attention_flops_per_token(context)

    def prefill_seconds(self, prompt_len: int) -> float:
        # Attention work grows with position; the mean position of a prompt is half its length.
        flops = prompt_len * (2.0 * self.spec.active_params + self.spec.attention_flops_per_token(prompt_len // 2))
        return flops / (self.hw.peak_flops(self.weight_format) * self.i.tensor_parallel * self.i.mfu)

    def weight_bytes_read_per_step(self, batch: int) -> float:
        """All dense weights; for MoE only the experts the batch's tokens route to (uniform routing, expected count)."""
        total = self.weights_bytes()
        s = self.spec
        if not s.is_moe:
            return total
        per_param = total / s.total_params
        expert = 3 * s.hidden_size * s.moe_intermediate_size
        moe_layers = s.num_layers - s.first_dense_layers
        touched = s.num_experts * (1 - (1 - s.experts_per_token / s.num_experts) ** batch)
        untouched = moe_layers * (s.num_experts - touched) * expert
        return total - untouched * per_param

    def decode_step(self, batch: int) -> tuple[float, float]:
        """(memory-bound seconds, compute-bound seconds) of one decode step at the context."""
        tp = self.i.tensor_parallel
        bytes_read = self.weight_bytes_read_per_step(batch) + batch * self.kv_per_request()
        mem_s = bytes_read / (self.hw.bandwidth_tbps * 1e12 * tp)
        comp_s = batch * self.flops_per_token(self.i.context) / (self.hw.peak_flops(self.weight_format) * tp * self.i.mfu)
        return mem_s, comp_s

    def compute_bound_batch(self) -> int | None:
        """The smallest batch at which a decode step is limited by FLOPs rather than bytes; None if never
        (KV reads grow as fast as compute: long contexts)."""
        lo, hi = 1, 1
        while self.decode_step(hi)[1] < self.decode_step(hi)[0]:
            hi *= 2
            if hi > 1 << 20:
                return None
        while lo < hi:
            mid = (lo + hi) // 2
            mem, comp = self.decode_step(mid)
            if comp >= mem:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # ---- disaggregated serving ---------------------------------------------------------------------
    def kv_transfer_seconds(self, prompt_len: int) -> float:
        return self.kv_per_request(prompt_len) / (self.i.link_gbps * 1e9 / 8)

    def bypass_threshold(self) -> int | None:
        """Prompts shorter than this are faster to prefill on the decode pool than to prefill remotely and ship:
        local prefill(P) < handoff + transfer(P)."""
        handoff = self.i.handoff_ms / 1000

        def local_wins(p: int) -> bool:
            return self.prefill_seconds(p) < handoff + self.kv_transfer_seconds(p)

        if not local_wins(1):
            return 0
        hi = 1
        while local_wins(hi):
            hi *= 2
            if hi > 1 << 24:
                return None  # the link is slower than prefill itself: shipping KV never pays
        lo = hi // 2
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if local_wins(mid) else (lo, mid)
        return hi

    # ---- the whole plan ------------------------------------------------------------------------------
    def plan(self) -> dict:
        s, i, hw = self.spec, self.i, self.hw
        tp = i.tensor_parallel
        mem_s, comp_s = self.decode_step(i.batch)
        step = max(mem_s, comp_s)
        prefill_s = self.prefill_seconds(self.prompt_len)
        devices = self.devices_needed()
        per_device = self.per_device_bytes(tp, i.batch)
        weights, kv_req = self.weights_bytes(), self.kv_per_request()
        decode_tps = i.batch / step
        prefill_tps = self.prompt_len / prefill_s
        price = i.gpu_hour_price if i.gpu_hour_price is not None else hw.hour_price
        out = {
            "model": {
                "name": s.name, "layers": s.num_layers, "hidden": s.hidden_size, "heads": s.num_heads, "kv_heads": s.num_kv_heads,
                "head_dim": s.head_dim, "attention": "MLA" if s.is_mla else ("GQA" if s.num_kv_heads < s.num_heads else "MHA"),
                "sliding_window": s.sliding_window, "sliding_layers": s.num_sliding_layers,
                "moe": f"{s.num_experts} experts, {s.experts_per_token} per token" + (f" + {s.num_shared_experts} shared" if s.num_shared_experts else "") if s.is_moe else None,
                "total_params": s.total_params, "active_params": s.active_params,
            },
            "settings": {"weight_format": self.weight_format, "kv_format": i.kv_format.upper(), "context": i.context, "batch": i.batch,
                         "tensor_parallel": tp, "prompt_len": self.prompt_len, "hardware": hw.name, "mfu": i.mfu,
                         "overhead_fraction": i.overhead_fraction, "memory_utilization": i.memory_utilization},
            "memory": {
                "weights_bytes": weights,
                "kv_bytes_per_token": s.kv_bytes_per_token(self.kv_bytes),
                "kv_bytes_per_request": kv_req,
                "kv_bytes_batch": kv_req * i.batch,
                "overhead_bytes": (weights + kv_req * i.batch) * i.overhead_fraction,
                "total_bytes": (weights + kv_req * i.batch) * (1 + i.overhead_fraction),
                "per_device_bytes": per_device,
                "device_memory_bytes": hw.memory_gb * 1e9,
                "fits": per_device <= self.capacity(),
                "devices_needed": devices,
                "max_batch_at_context": self.max_batch(tp),
            },
            "compute": {
                "flops_per_token_weights": 2.0 * s.active_params,
                "flops_per_token_attention": s.attention_flops_per_token(i.context),
                "peak_flops_per_device": hw.peak_flops(self.weight_format),
                "bandwidth_bytes_per_s": hw.bandwidth_tbps * 1e12,
                "prefill_seconds": prefill_s,
                "prefill_tokens_per_s": prefill_tps,
                "decode_step_memory_s": mem_s,
                "decode_step_compute_s": comp_s,
                "decode_bound": "compute" if comp_s > mem_s else "memory bandwidth",
                "decode_tokens_per_s_per_user": 1 / step,
                "decode_tokens_per_s_total": decode_tps,
                "compute_bound_from_batch": self.compute_bound_batch(),
            },
            "disaggregation": {
                "prompt_len": self.prompt_len,
                "kv_bytes_for_prompt": self.kv_per_request(self.prompt_len),
                "link_gbps": i.link_gbps,
                "transfer_seconds": self.kv_transfer_seconds(self.prompt_len),
                "handoff_ms": i.handoff_ms,
                "bypass_below_prompt_tokens": self.bypass_threshold(),
            },
        }
        if price is not None:
            per_s = price * tp / 3600
            gpu_s_per_out = 1 / decode_tps + i.input_per_output / prefill_tps
            hosted = []
            for name, p in HOSTED_PRICES.items():
                blended = (p.output + i.input_per_output * p.input) / 1e6
                hosted.append({"model": name, "input": p.input, "cached_input": p.cached_input, "output": p.output,
                               "break_even_utilization": per_s * gpu_s_per_out / blended})
            out["cost"] = {
                "device_hour_price": price, "devices": tp, "utilization": i.utilization,
                "input_per_million": per_s * 1e6 / (prefill_tps * i.utilization),
                "output_per_million": per_s * 1e6 / (decode_tps * i.utilization),
                "input_per_output": i.input_per_output,
                "hosted_prices_as_of": HOSTED_PRICES_AS_OF,
                "hosted": hosted,
            }
        return out


def fmt_bytes(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def plan_rows(p: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The plan as titled sections of (label, value) rows, for the terminal."""
    m, st, mem, c, d = p["model"], p["settings"], p["memory"], p["compute"], p["disaggregation"]
    arch = f"{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']} ({m['attention']})"
    if m["sliding_window"]:
        arch += f", {m['sliding_layers']} layers with a {m['sliding_window']}-token window"
    sections = [
        ("model", [("name", m["name"]), ("architecture", arch)] + ([("MoE", m["moe"])] if m["moe"] else []) + [
            ("parameters (resident / active per token)", f"{_params(m['total_params'])} / {_params(m['active_params'])}")]),
        ("settings", [("weights / KV format", f"{st['weight_format']} / {st['kv_format']}"),
                      ("context x batch", f"{st['context']:,} x {st['batch']}"),
                      ("hardware x tensor parallel", f"{st['hardware']} x {st['tensor_parallel']}")]),
        ("memory", [
            ("weights", fmt_bytes(mem["weights_bytes"])),
            ("KV per token", f"{mem['kv_bytes_per_token'] / 1024:.1f} KiB" + (" (full-attention layers)" if m["sliding_window"] else "")),
            (f"KV per request at {st['context']:,}", fmt_bytes(mem["kv_bytes_per_request"])),
            (f"KV for the batch of {st['batch']}", fmt_bytes(mem["kv_bytes_batch"])),
            (f"activations + runtime ({st['overhead_fraction']:.0%})", fmt_bytes(mem["overhead_bytes"])),
            ("total", fmt_bytes(mem["total_bytes"])),
            (f"per device (TP {st['tensor_parallel']})", f"{fmt_bytes(mem['per_device_bytes'])} of {fmt_bytes(mem['device_memory_bytes'])}: "
                                                         + ("fits" if mem["fits"] else "does NOT fit")),
            ("devices needed (tensor parallel)", str(mem["devices_needed"] or "more than 1024")),
            (f"largest batch at {st['context']:,} (TP {st['tensor_parallel']})", str(mem["max_batch_at_context"])),
        ]),
        ("compute", [
            ("FLOPs per token (2 x active params)", f"{c['flops_per_token_weights'] / 1e9:.1f} GFLOP"),
            (f"+ attention at {st['context']:,} tokens", f"{c['flops_per_token_attention'] / 1e9:.1f} GFLOP"),
            (f"prefill of {st['prompt_len']:,} tokens (TTFT, MFU {st['mfu']:.0%})", f"{fmt_seconds(c['prefill_seconds'])} "
                                                                                  f"({c['prefill_tokens_per_s']:,.0f} tokens/s)"),
            ("decode step: bytes / FLOPs bound", f"{fmt_seconds(c['decode_step_memory_s'])} / {fmt_seconds(c['decode_step_compute_s'])} "
                                                 f"-> {c['decode_bound']}-bound"),
            ("decode tokens/s per user", f"{c['decode_tokens_per_s_per_user']:,.1f}"),
            (f"decode tokens/s total (batch {st['batch']})", f"{c['decode_tokens_per_s_total']:,.1f}"),
            ("decode turns compute-bound at batch", str(c["compute_bound_from_batch"] or "never (KV reads grow as fast)")),
        ]),
        ("disaggregated prefill/decode", [
            (f"KV for a {d['prompt_len']:,}-token prompt", fmt_bytes(d["kv_bytes_for_prompt"])),
            (f"transfer at {d['link_gbps']:g} Gb/s", fmt_seconds(d["transfer_seconds"])),
            (f"bypass to decode pays below (handoff {d['handoff_ms']:g} ms)",
             "never" if d["bypass_below_prompt_tokens"] == 0 else (f"{d['bypass_below_prompt_tokens']:,} tokens"
                                                                  if d["bypass_below_prompt_tokens"] else "always")),
        ]),
    ]
    if "cost" in p:
        k = p["cost"]
        rows = [
            ("device-hour price x devices", f"${k['device_hour_price']:.2f} x {k['devices']} at {k['utilization']:.0%} utilization"),
            ("self-hosted input / output per 1M tokens", f"${k['input_per_million']:.3f} / ${k['output_per_million']:.3f}"),
        ]
        for h in k["hosted"]:
            cached = f" (cached {h['cached_input']:.2f})" if h["cached_input"] is not None else ""
            u = h["break_even_utilization"]
            rows.append((f"vs {h['model']}: ${h['input']:.2f}{cached} / ${h['output']:.2f}",
                         f"break-even utilization {u:.0%}" if u <= 1 else f"never cheaper (needs {u:.0%} utilization)"))
        sections.append((f"cost (hosted list prices as of {k['hosted_prices_as_of']}, {k['input_per_output']:g} input tokens per output)", rows))
    return sections
