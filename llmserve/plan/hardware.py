"""Accelerators the planner knows (vendor datasheet figures, dense, no sparsity) and this machine's CPU, measured."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from llmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float  # per device, 1e9 bytes
    bandwidth_tbps: float  # memory bandwidth, 1e12 bytes/s
    tflops: dict = field(default_factory=dict)  # dense peak by compute type: bf16, fp8, fp4 (fp32: a CPU)
    hour_price: float | None = None  # a rough on-demand rental price per device-hour (override with --gpu-hour-price)
    measured: bool = False

    def peak_flops(self, weight_format: str) -> float:
        """FLOP/s for matmuls with these weights: FP8/FP4 formats use their own tensor cores where the chip has them;
        integer and GGUF formats are dequantized to bf16 for the matmul."""
        kind = {"FP8": "fp8", "NVFP4": "fp4", "MXFP4": "fp4"}.get(weight_format.upper(), "bf16")
        if kind == "fp4" and "fp4" not in self.tflops:
            kind = "fp8"
        if kind not in self.tflops:  # a measured CPU without native bf16 has its float32 rate only
            kind = "bf16" if "bf16" in self.tflops else next(iter(self.tflops))
        return self.tflops[kind] * 1e12


# Dates and sources: NVIDIA and AMD datasheets; prices are typical 2026 on-demand cloud rates, for orientation only.
CATALOGUE: dict[str, Hardware] = {h.name.lower(): h for h in [
    Hardware("H100-SXM", 80, 3.35, {"bf16": 989, "fp8": 1979}, 2.50),
    Hardware("H100-PCIe", 80, 2.0, {"bf16": 756, "fp8": 1513}, 2.00),
    Hardware("H200", 141, 4.8, {"bf16": 989, "fp8": 1979}, 3.50),
    Hardware("B200", 180, 8.0, {"bf16": 2250, "fp8": 4500, "fp4": 9000}, 5.50),
    Hardware("A100-40GB", 40, 1.555, {"bf16": 312}, 1.30),
    Hardware("A100-80GB", 80, 2.039, {"bf16": 312}, 1.70),
    Hardware("L4", 24, 0.3, {"bf16": 121, "fp8": 242}, 0.70),
    Hardware("L40S", 48, 0.864, {"bf16": 362, "fp8": 733}, 1.00),
    Hardware("MI300X", 192, 5.3, {"bf16": 1307, "fp8": 2615}, 2.50),
]}
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "mi300": "mi300x"}


def measure_cpu(seconds: float = 1.0) -> Hardware:
    """This machine: bandwidth from a large tensor copy, the matmul rate in the dtype the engine serves here (bf16
    where the CPU computes it natively, else float32: emulated bf16 is far slower), and the memory available now."""
    import torch

    from llmserve.platforms.cpu import CpuPlatform, cpu_has_fast_bf16

    def timed(fn, reps: int) -> float:
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    src = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB: far past every cache
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 5)
    bandwidth = 2 * src.numel() * 4 / copy_s  # a copy reads and writes every byte
    kind, dtype = ("bf16", torch.bfloat16) if cpu_has_fast_bf16() else ("fp32", torch.float32)
    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.randn(1024, 1024, dtype=dtype)
    mm_s = timed(lambda: torch.mm(a, b), 5)
    flops = 2 * 1024**3 / mm_s
    return Hardware(f"this CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
                    CpuPlatform(torch.device("cpu")).available_memory() / 1e9, bandwidth / 1e12, {kind: flops / 1e12}, None, measured=True)


def get_hardware(name: str) -> Hardware:
    key = name.lower()
    if key in ("cpu", "this-cpu", "this cpu"):
        return measure_cpu()
    key = ALIASES.get(key, key)
    if key not in CATALOGUE:
        raise InvalidRequestError(f"unknown hardware {name!r}; known: {', '.join(h.name for h in CATALOGUE.values())}, cpu", "hardware")
    return CATALOGUE[key]
