"""Native CPU kernels (C++ in this folder), built from source the first time they are needed with torch's extension
builder and the machine's C++ compiler, then cached (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) under a key
of their contents, flags and CPU (build.py). Where no compiler can build them, callers fall back to the pure-PyTorch
path; `build_error()` says why."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name)
           for name in ("paged_attention.cpp", "packed_linear.cpp", "lowbit_linear.cpp", "lowbit_linear_avx2.cpp",
                        "lowbit_linear_vnni.cpp", "argmax_rows.cpp", "rms_norm.cpp", "prefill_attention.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("amx.h", "lowbit_avx2.h", "lowbit_vnni.h", "simd_exp.h")]
# paged_decode_attention's scratch limits (kMaxHeads, kMaxDim in paged_attention.cpp)
MAX_QUERY_HEADS = 256
MAX_HEAD_DIM = 1024

CFLAGS = ["-O3", "-march=native", "-fopenmp"]
if platform.machine().lower() in ("x86_64", "amd64"):
    CFLAGS.append("-mprefer-vector-width=512")  # gcc keeps to 256-bit vectors on AVX-512 CPUs unless told
_state: dict[str, object] = {}


def fused_kernels_disabled() -> bool:
    """LLMSERVE_FUSED_KERNELS=0 turns CUDA's fused Triton kernels (norms, rotary, SwiGLU, the KV write) off, for
    torch's own ops: to measure what they bring, or to get around one that fails on some GPU."""
    return os.environ.get("LLMSERVE_FUSED_KERNELS", "1") == "0"


def _cpu_tag() -> str:
    """Built with -march=native: the cached library is only valid on a CPU with the same instruction sets."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def load_cpu_kernels() -> bool:
    """Builds (once per machine and source version) and loads the kernels; False if they cannot be built here."""
    if "ok" in _state:
        return bool(_state["ok"])
    t0 = time.perf_counter()
    try:
        from llmserve.kernels.build import load_extension

        load_extension("llmserve_kernels", SOURCES, HEADERS, CFLAGS, "llmserve's native CPU kernels",
                       extra_key=_cpu_tag())
        torch.library.register_fake("llmserve_kernels::paged_decode_attention")(_paged_decode_attention_shape)
        torch.library.register_fake("llmserve_kernels::packed_linear")(packed_linear_shape)
        torch.library.register_fake("llmserve_kernels::lowbit_linear")(_lowbit_linear_shape)
        torch.library.register_fake("llmserve_kernels::float_panel_linear")(_float_panel_linear_shape)
        torch.library.register_fake("llmserve_kernels::argmax_rows")(_argmax_rows_shape)
        torch.library.register_fake("llmserve_kernels::prefill_attention")(_prefill_attention_shape)
        _state["ok"] = True
        logger.info("native CPU kernels ready in %.1fs", time.perf_counter() - t0)
    except Exception as e:  # no compiler, no OpenMP, a failed build: the PyTorch path still works
        _state["ok"] = False
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch attention path", _state["error"])
    return bool(_state["ok"])


def source_digest() -> str:
    """Changes whenever the kernels or their Python-side shapes change: compiled graphs that call them are cached
    under it (torch's graph cache does not look inside custom ops)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS, Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def loaded() -> bool:
    """Whether the kernels were built and loaded in this process (no build is attempted)."""
    return bool(_state.get("ok"))


def lowbit_linear_isa() -> str | None:
    """Which route llmserve's low-bit matmul takes here for bf16 activations: "amx" (the kernels built on a CPU with
    AMX, and the OS granted its registers), "avx512_bf16" (AVX512-BF16 without AMX), or None (neither, or no build)."""
    if "lowbit_isa" not in _state:
        _state["lowbit_isa"] = (torch.ops.llmserve_kernels.lowbit_linear_isa() or None) if load_cpu_kernels() else None
    return _state["lowbit_isa"]  # type: ignore[return-value]


def lowbit_linear_float32_isa() -> str | None:
    """The route for float32 activations: "avx2" (a CPU with AVX2, FMA and F16C), or None."""
    if "lowbit_f32_isa" not in _state:
        _state["lowbit_f32_isa"] = ((torch.ops.llmserve_kernels.lowbit_linear_float32_isa() or None)
                                    if load_cpu_kernels() else None)
    return _state["lowbit_f32_isa"]  # type: ignore[return-value]


def lowbit_linear_int8_isa() -> str | None:
    """The int8 route for bf16 activations and 4-bit codes: "avx512_int8" (a CPU with AVX512-VNNI), or None."""
    if "lowbit_int8_isa" not in _state:
        _state["lowbit_int8_isa"] = ((torch.ops.llmserve_kernels.lowbit_linear_int8_isa() or None)
                                     if load_cpu_kernels() else None)
    return _state["lowbit_int8_isa"]  # type: ignore[return-value]


def lowbit_linear_route(dtype: torch.dtype) -> str | None:
    """llmserve's low-bit route for activations of this dtype on this CPU, or None (torch's kernels then)."""
    if dtype == torch.bfloat16:
        return lowbit_linear_isa()
    if dtype == torch.float32:
        return lowbit_linear_float32_isa()
    return None


def lowbit_linear_int8_route(dtype: torch.dtype) -> str | None:
    """The route that rounds activations of this dtype to int8 against 4-bit codes (decode_quantization w4a8):
    "avx2_int8" for float32, "avx512_int8" for bf16, or None where this CPU or build has none."""
    if dtype == torch.float32 and lowbit_linear_float32_isa() == "avx2":
        return "avx2_int8"
    if dtype == torch.bfloat16:
        return lowbit_linear_int8_isa()
    return None


def prefill_attention_available(head_dim: int) -> bool:
    """Whether the native prompt-attention kernel runs here: built with AVX512-BF16, for this head_dim (64 or 128)."""
    if "prefill_attention" not in _state:
        _state["prefill_attention"] = bool(load_cpu_kernels() and torch.ops.llmserve_kernels.prefill_attention_built())
    return bool(_state["prefill_attention"]) and head_dim in (64, 128)


def lowbit_linear_available() -> bool:
    """Whether llmserve's low-bit matmul runs here for bf16 activations, by either of its routes."""
    return lowbit_linear_isa() is not None


def fast_argmax_available() -> bool:
    """Whether argmax_rows beats torch's max(dim=-1) here: already loaded (this never starts a build), and
    vectorized (AVX-512)."""
    if not loaded():
        return False
    if "fast_argmax" not in _state:
        _state["fast_argmax"] = bool(torch.ops.llmserve_kernels.argmax_rows_vectorized())
    return bool(_state["fast_argmax"])


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def _paged_decode_attention_shape(q, k_cache, v_cache, block_tables, lengths, block_size, scale, k_scale=1.0, v_scale=1.0,
                                  split_keys=0, window=0, softcap=0.0):
    return q.new_empty(q.shape)


def _prefill_attention_shape(q, k_cache, v_cache, block_tables, spans, block_size, scale):
    return q.new_empty(q.shape)


def _lowbit_linear_shape(x, codes, scales, offsets, route):
    return x.new_empty((x.shape[0], codes.shape[0] * scales.shape[2]))  # blocks x output columns per block


def _float_panel_linear_shape(x, panel):
    return x.new_empty((x.shape[0], panel.shape[0] * 32))


def _argmax_rows_shape(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


def packed_linear_shape(x, packed, bias):
    """Output of a matmul on a oneDNN-packed [out, in] weight, for torch.compile's tracing."""
    return x.new_empty((*x.shape[:-1], packed.shape[0]))
