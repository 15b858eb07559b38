"""Attention backends against a reference written out in float64, through the backend interface: build a step's
metadata from sequence spans, run the paged attention layer, compare. And a new backend plugged in as one class plus
one line in a platform."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve import kernels
from llmserve.attention.backend import AttentionBackend, AttentionGroup, SeqSpan
from llmserve.attention.cpu_batch_invariant import BatchInvariantBackend
from llmserve.attention.cpu_native import CpuNativeBackend
from llmserve.attention.sdpa import SdpaBackend
from llmserve.engine.step_io import NewRequestData, ScheduledRow, StepInput
from llmserve.layers.attention import PagedAttention
from llmserve.platforms.cpu import CpuPlatform
from llmserve.sampling_params import SamplingParams

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16
# (tokens already in the cache, new tokens): decode rows, a fresh prompt, a chunk after earlier chunks, a one-token
# prompt
STEPS = {
    "decode": [(5, 1), (40, 1), (16, 1)],
    "prompts": [(0, 23), (32, 9)],
    "mixed": [(17, 1), (0, 12), (48, 20), (3, 1), (0, 1)],
    "fresh": [(0, 30), (0, 7)],
}


def reference(q, k_all, v_all, seqs, window=0, softcap=0.0):
    """Per sequence: its new queries against all its keys, causal, in float64 (GQA: query head h reads KV head
    h // (HEADS // KV_HEADS)); window > 0: a query at position p sees only the keys after p - window; softcap > 0:
    each score s taken to softcap * tanh(s / softcap) before the softmax."""
    out, at = [], 0
    for (cached, new), (keys, values) in zip(seqs, zip(k_all, v_all)):
        qs = q[at:at + new].double()  # [new, H, D]
        k = keys.double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
        v = values.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * DIM**-0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        visible = torch.arange(k.shape[0])[None, :] <= (cached + torch.arange(new))[:, None]
        if window:
            visible &= torch.arange(k.shape[0])[None, :] > (cached + torch.arange(new))[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        at += new
    return torch.cat(out)


def run_backend(backend: AttentionBackend, seqs, dtype, seed=0, window=0, softcap=0.0):
    """Random history in the cache and random new K/V/queries; returns (the layer's output, the reference). window,
    softcap: the layer's sliding window and score cap (the backend must have been built knowing them)."""
    g = torch.Generator().manual_seed(seed)
    layer = PagedAttention(HEADS, KV_HEADS, DIM, sliding_window=window, logits_soft_cap=softcap)
    num_blocks = 64
    layer.k_cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=backend.kv_dtype, device=backend.device)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    layer.block_size = BLOCK
    perm = torch.randperm(num_blocks, generator=g).tolist()  # tables point at scattered blocks
    spans, positions, slots, k_new, v_new, k_all, v_all = [], [], [], [], [], [], []
    offset = 0
    for cached, new in seqs:
        table = [perm.pop() for _ in range(-(-(cached + new) // BLOCK))]
        total = cached + new
        keys = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
        values = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
        pos = np.arange(total)
        seq_slots = np.asarray(table)[pos // BLOCK] * BLOCK + pos % BLOCK
        layer.k_cache[seq_slots[:cached]] = keys[:cached].to(backend.device, backend.kv_dtype)  # the history
        layer.v_cache[seq_slots[:cached]] = values[:cached].to(backend.device, backend.kv_dtype)
        k_new.append(keys[cached:])
        v_new.append(values[cached:])
        k_all.append(keys)
        v_all.append(values)
        spans.append(SeqSpan(offset, new, total, np.asarray(table)))
        positions.append(pos[cached:])
        slots.append(seq_slots[cached:])
        offset += new
    positions = np.concatenate(positions)
    q = torch.randn(offset, HEADS, DIM, generator=g).to(dtype)
    with torch.inference_mode():
        meta = backend.build_metadata(spans, positions, backend.tensor(np.concatenate(slots)))
        dev = backend.device
        out = layer(q.to(dev), torch.cat(k_new).to(dev), torch.cat(v_new).to(dev), meta)
    return out.cpu(), reference(q, k_all, v_all, seqs, window, softcap)


def backends(dtype, kv_dtype=None, windows=(), softcap=0.0):
    args = (HEADS, KV_HEADS, DIM, BLOCK, dtype, kv_dtype or dtype, torch.device("cpu"), windows, softcap)
    native = [CpuNativeBackend(*args), BatchInvariantBackend(*args)] if kernels.load_cpu_kernels() else []
    return [SdpaBackend(*args)] + native


@pytest.mark.parametrize("step", list(STEPS))
def test_every_backend_matches_the_reference_in_float32(step):
    for backend in backends(torch.float32):
        out, ref = run_backend(backend, STEPS[step], torch.float32)
        assert out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4, msg=f"{backend.name} on {step}")


@pytest.mark.parametrize("step", list(STEPS))
def test_every_backend_stays_within_bf16_rounding(step):
    for backend in backends(torch.bfloat16):
        out, ref = run_backend(backend, STEPS[step], torch.bfloat16)
        assert (out.double() - ref).abs().max() < 0.05, f"{backend.name} on {step}"


# windows shorter than, equal to and longer than a block; one longer than every sequence (the same as none)
@pytest.mark.parametrize("window", [3, BLOCK, 21, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_layer_reads_only_its_window(window, dtype):
    """Every kind of row (decode, fresh prompt, chunk after cached keys) in a layer with a sliding window, on every
    backend: in float32 to the reference's digits, in bf16 (where the native prompt kernel serves the model's other
    layers) within bf16 rounding. A model with windowed and full layers has both masks in one step's metadata."""
    for step in ("mixed", "decode", "fresh"):
        for backend in backends(dtype, windows=(window, 7)):
            out, ref = run_backend(backend, STEPS[step], dtype, window=window)
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4, msg=f"{backend.name} {step}")
            else:
                assert (out.double() - ref).abs().max() < 0.05, f"{backend.name} on {step}"
    if window < 40:  # the window matters to these rows: without it they differ
        sdpa = backends(torch.float32, windows=(window,))[0]
        _, windowed = run_backend(sdpa, STEPS["mixed"], torch.float32, window=window)
        _, full = run_backend(sdpa, STEPS["mixed"], torch.float32)
        assert not torch.allclose(full, windowed, atol=1e-3)


@pytest.mark.parametrize("softcap, window", [(2.0, 0), (0.7, 0), (2.0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_soft_capped_layer_caps_every_score(softcap, window, dtype):
    """Gemma 2's attention soft-capping, cap * tanh(score / cap) before the softmax, on every kind of row and every
    backend (the native backend's prompt rows go to SDPA's explicit softmax, its decode rows to the kernel's cap),
    with and without a sliding window; the cap changes these rows."""
    for step in ("mixed", "decode", "fresh", "prompts"):
        for backend in backends(dtype, windows=(window,) if window else (), softcap=softcap):
            out, ref = run_backend(backend, STEPS[step], dtype, window=window, softcap=softcap)
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4, msg=f"{backend.name} {step}")
            else:
                assert (out.double() - ref).abs().max() < 0.05, f"{backend.name} on {step}"
    sdpa = backends(torch.float32, windows=(window,) if window else ())[0]
    _, uncapped = run_backend(sdpa, STEPS["mixed"], torch.float32, window=window)
    _, capped = run_backend(sdpa, STEPS["mixed"], torch.float32, window=window, softcap=softcap)
    assert not torch.allclose(uncapped, capped, atol=1e-2)


def test_fp8_cache_backends_agree_with_the_reference_on_rounded_history():
    """An FP8 cache holds the history rounded to e4m3; the new tokens' keys are written rounded too (fresh prompts
    may attend to their own unrounded keys). Against the unrounded reference, the error is the rounding's."""
    for backend in backends(torch.bfloat16, torch.float8_e4m3fn):
        out, ref = run_backend(backend, STEPS["mixed"], torch.bfloat16)
        assert (out.double() - ref).abs().max() < 0.25, backend.name


# ---- a backend added as one file (here: this class) and one line in a platform -------------------------------
class LoopGroup(AttentionGroup):
    """Each sequence on its own: gather its keys through its table, causal softmax. Slow, obviously right."""

    def __init__(self, spans, device):
        self.spans = spans
        self.covers_batch = False
        self.dst = torch.tensor([s.offset + i for s in spans for i in range(s.num_queries)], dtype=torch.long,
                                device=device)

    def attend(self, layer, q, k, v):
        outs = []
        for s in self.spans:
            pos = torch.arange(s.num_keys)
            slots = torch.as_tensor(np.asarray(s.block_table))[pos // layer.block_size] * layer.block_size + pos % layer.block_size
            keys = layer.k_cache[slots].to(q.dtype).repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1)
            values = layer.v_cache[slots].to(q.dtype).repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1)
            queries = q[s.offset:s.offset + s.num_queries]
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * layer.scale
            first = s.num_keys - s.num_queries
            visible = pos[None, :] <= (first + torch.arange(s.num_queries))[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        return torch.cat(outs)


class LoopBackend(AttentionBackend):
    name = "loop"

    def build_group(self, spans, positions, min_blocks):
        return LoopGroup(spans, self.device)


class LoopPlatform(CpuPlatform):
    def attention_backend(self, config, model_config, dtype, kv_dtype, num_heads, num_kv_heads):
        return LoopBackend(num_heads, num_kv_heads, model_config.head_dim, config.block_size, dtype, kv_dtype,
                           self.device)


def test_a_new_backend_is_one_class_and_one_platform_line(tmp_path):
    """The loop backend above, plugged into a platform, serves a model through the executor's step boundary with the
    logits of the default backend."""
    from llmserve.config import EngineConfig
    from llmserve.loader import load_model_files
    from llmserve.worker.model_runner import ModelRunner
    from tests.helpers import save_tiny_llama

    out, ref = run_backend(LoopBackend(HEADS, KV_HEADS, DIM, BLOCK, torch.float32, torch.float32,
                                       torch.device("cpu")), STEPS["mixed"], torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)

    files = load_model_files(save_tiny_llama(tmp_path / "tiny", 96, seed=4), load_tokenizer=False)
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=16, block_size=4)
    runners = [ModelRunner(config, files.config, files.weights),
               ModelRunner(config, files.config, files.weights, platform=LoopPlatform(torch.device("cpu")))]
    assert runners[1].attention.name == "loop"
    logits = []
    for runner in runners:
        seen = []
        runner.logits_observers.append(lambda ids, rows: seen.append(rows.clone()))
        params = SamplingParams(temperature=0, max_tokens=4)
        new = [NewRequestData("a", list(range(3, 14)), params, set()), NewRequestData("b", [7, 8, 9], params, set())]
        runner.execute(StepInput([ScheduledRow("a", list(range(3, 14)), 0, [0, 1, 2], True),
                                  ScheduledRow("b", [7, 8, 9], 0, [3], True)], new_requests=new))
        runner.execute(StepInput([ScheduledRow("a", [20], 11, [0, 1, 2], True, 1),
                                  ScheduledRow("b", [21], 3, [3], True, 1)]))
        logits.append(torch.cat(seen))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
