"""The Triton kernels: CUDA's paged-attention backend (attention_backend triton) and the deterministic mode's
batch-invariant matmul and RMSNorm. On a GPU they run natively; elsewhere under Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py, which also makes the interpreter's tl.dot sum every row in one order, as a
GPU's MMA does), on CPU tensors, which is how this suite checks them on machines without a GPU.

Checked against the float64 reference and the SDPA backend, for bit-for-bit batch invariance (a position's output
is the same however the step that computes it is made up), and end to end: a model served with the Triton backend,
and the CUDA platform's deterministic mode, whose weight and norm kernels these are."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llmserve.attention.backend import SeqSpan  # noqa: E402
from llmserve.attention.triton_paged import TritonPagedBackend  # noqa: E402
from llmserve.config import EngineConfig  # noqa: E402
from llmserve.engine.step_io import NewRequestData, ScheduledRow, StepInput  # noqa: E402
from llmserve.kernels.triton_batch_invariant import batch_invariant_linear, batch_invariant_rms_norm  # noqa: E402
from llmserve.kernels.triton_fused import add_rms_norm, rotary_in_place, silu_and_mul, store_kv  # noqa: E402
from llmserve.layers.rotary import RotaryEmbedding  # noqa: E402
from llmserve.layers.attention import PagedAttention  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from tests.test_attention_backends import BLOCK, DIM, HEADS, KV_HEADS, STEPS, run_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_backend(dtype, kv_dtype=None, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, softcap=0.0):
    return TritonPagedBackend(heads, kv_heads, dim, BLOCK, dtype, kv_dtype or dtype, DEVICE, (), softcap)


# ---- attention against the reference --------------------------------------------------------------------------
@pytest.mark.parametrize("step", list(STEPS))
def test_triton_attention_matches_the_reference_in_float32(step):
    out, ref = run_backend(triton_backend(torch.float32), STEPS[step], torch.float32)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [3, 21])
def test_triton_attention_reads_only_a_layers_sliding_window(window):
    for step in ("mixed", "prompts", "decode"):
        out, ref = run_backend(triton_backend(torch.float32), STEPS[step], torch.float32, window=window)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4, msg=step)


@pytest.mark.parametrize("softcap, window", [(2.0, 0), (0.7, 21)])
def test_triton_attention_soft_caps_every_score(softcap, window):
    for step in ("mixed", "prompts", "decode"):
        out, ref = run_backend(triton_backend(torch.float32, softcap=softcap), STEPS[step], torch.float32,
                               window=window, softcap=softcap)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4, msg=step)


# Triton's interpreter multiplies bf16 blocks wrongly (tl.dot on bf16 gives garbage in triton 3.8), so bf16 runs where
# the kernels compile: on a GPU.
needs_gpu_for_bf16 = pytest.mark.skipif(DEVICE.type == "cpu", reason="Triton's interpreter has no correct bf16 tl.dot")


@needs_gpu_for_bf16
def test_triton_attention_stays_within_bf16_rounding():
    out, ref = run_backend(triton_backend(torch.bfloat16), STEPS["mixed"], torch.bfloat16)
    assert (out.double() - ref).abs().max() < 0.05
    out, ref = run_backend(triton_backend(torch.bfloat16, torch.float8_e4m3fn), STEPS["mixed"], torch.bfloat16)
    assert (out.double() - ref).abs().max() < 0.25


def test_triton_attention_reads_an_fp8_cache():
    """The history rounded to e4m3 in the cache; against the unrounded reference the error is the rounding's."""
    out, ref = run_backend(triton_backend(torch.float32, torch.float8_e4m3fn), STEPS["mixed"], torch.float32)
    assert (out.double() - ref).abs().max() < 0.25


# ---- a position gives the same bits however its step is made up ------------------------------------------------
class Sequences:
    """Fixed keys, values and queries per sequence, attended in steps of any composition over one paged cache."""

    def __init__(self, lengths: dict[str, int], heads=9, kv_heads=3, dim=64, seed=0, window=0, softcap=0.0):
        g = torch.Generator().manual_seed(seed)
        self.window, self.softcap = window, softcap
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.data = {name: [torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
                     for name, n in lengths.items()}
        blocks = torch.randperm(64, generator=g).tolist()
        self.tables = {name: [blocks.pop() for _ in range(-(-n // BLOCK))] for name, n in lengths.items()}

    def run(self, step: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
        """step: (sequence, keys already cached, new tokens) each; returns each sequence's new rows' outputs."""
        backend = triton_backend(torch.float32, heads=self.heads, kv_heads=self.kv_heads, dim=self.dim,
                                 softcap=self.softcap)
        layer = PagedAttention(self.heads, self.kv_heads, self.dim, sliding_window=self.window,
                               logits_soft_cap=self.softcap)
        layer.k_cache = torch.zeros(backend.kv_cache_shape(64), device=DEVICE)
        layer.v_cache = torch.zeros_like(layer.k_cache)
        layer.block_size = BLOCK
        spans, positions, slots, qs, ks, vs = [], [], [], [], [], []
        offset = 0
        for name, cached, new in step:
            q, k, v = self.data[name]
            table = np.asarray(self.tables[name])
            pos = np.arange(cached + new)
            seq_slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
            layer.k_cache[seq_slots[:cached]] = k[:cached].to(DEVICE)
            layer.v_cache[seq_slots[:cached]] = v[:cached].to(DEVICE)
            spans.append(SeqSpan(offset, new, cached + new, table))
            positions.append(pos[cached:])
            slots.append(seq_slots[cached:])
            qs.append(q[cached:cached + new])
            ks.append(k[cached:cached + new])
            vs.append(v[cached:cached + new])
            offset += new
        with torch.inference_mode():
            meta = backend.build_metadata(spans, np.concatenate(positions), backend.tensor(np.concatenate(slots)))
            out = layer(torch.cat(qs).to(DEVICE), torch.cat(ks).to(DEVICE), torch.cat(vs).to(DEVICE), meta).cpu()
        result, at = {}, 0
        for name, _, new in step:
            result[name] = out[at:at + new]
            at += new
        return result


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (19, 0.0), (19, 1.5)])
def test_a_position_gives_the_same_bits_as_prompt_chunk_decode_or_verification_row(window, softcap):
    """Also under a sliding window, where a query tile's rows start reading at different keys, and with Gemma 2's
    score cap."""
    seqs = Sequences({"a": 70, "b": 33, "c": 12}, window=window, softcap=softcap)
    whole = seqs.run([("a", 0, 70)])["a"]  # the whole prompt alone
    batched = seqs.run([("b", 0, 33), ("a", 0, 70), ("c", 11, 1)])["a"]  # in a batch with a prompt and a decode row
    chunked = torch.cat([seqs.run([("a", 0, 29)])["a"], seqs.run([("c", 0, 12), ("a", 29, 41)])["a"]])
    decode = seqs.run([("b", 32, 1), ("a", 69, 1)])["a"]  # the last position as a decode row
    verify = seqs.run([("c", 11, 1), ("a", 65, 5), ("b", 30, 3)])["a"]  # the last five as verification rows
    assert torch.equal(batched, whole)
    assert torch.equal(chunked, whole)
    assert torch.equal(decode, whole[69:])
    assert torch.equal(verify, whole[65:])


# ---- the batch-invariant matmul and RMSNorm ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_gpu_for_bf16)])
def test_batch_invariant_linear_matches_torch_and_each_row_is_the_same_in_any_batch(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 200, generator=g).to(DEVICE, dtype)
    w = torch.randn(150, 200, generator=g).to(DEVICE, dtype)  # neither dimension a multiple of a tile
    bias = torch.randn(150, generator=g).to(DEVICE, dtype)
    out = batch_invariant_linear(x, w, bias)
    ref = F.linear(x.double(), w.double(), bias.double())
    tolerance = 1e-4 if dtype == torch.float32 else 0.5  # bf16: the output's own rounding at |values| ~ 20
    assert (out.double() - ref).abs().max() < tolerance
    for rows in (slice(0, 1), slice(5, 8), slice(31, 64), slice(69, 70)):
        assert torch.equal(batch_invariant_linear(x[rows], w, bias), out[rows])
    assert batch_invariant_linear(x[:0], w).shape == (0, 150)


def test_batch_invariant_rms_norm_matches_the_model_norm_and_each_row_is_the_same_in_any_batch():
    from llmserve.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(576, 1e-5).to(DEVICE, dtype)
        norm.weight.data = torch.randn(576, generator=g).to(DEVICE, dtype)
        x = (torch.randn(40, 576, generator=g) * 3).to(DEVICE, dtype)
        out = batch_invariant_rms_norm(x, norm.weight, norm.eps)
        torch.testing.assert_close(out, norm(x), atol=1e-5 if dtype == torch.float32 else 0.05, rtol=1e-5 if dtype == torch.float32 else 0.02)
        for rows in (slice(0, 1), slice(3, 17)):
            assert torch.equal(batch_invariant_rms_norm(x[rows], norm.weight, norm.eps), out[rows])
    heads = torch.randn(5, 4, 64, generator=g).to(DEVICE)  # Qwen3's per-head norms: any leading dims
    assert batch_invariant_rms_norm(heads, torch.ones(64, device=DEVICE), 1e-6).shape == heads.shape


# ---- fused elementwise kernels ---------------------------------------------------------------------------------
# bf16 on a GPU only: the interpreter rounds float32 to bf16 by truncation, not to nearest as GPUs and torch do
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (9, 3, 128), (3, 1, 48)])
def test_rotary_in_place_rotates_the_qkv_output_as_the_model_does(dtype, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(dim + heads)
    rotary = RotaryEmbedding(dim, 256, 10000.0)
    positions = torch.tensor([0, 1, 7, 100, 255, 31])
    table = tuple(t.to(DEVICE) for t in rotary.table(positions))
    qkv = torch.randn(len(positions), heads + 2 * kv_heads, dim, generator=g).to(DEVICE, dtype)
    want = RotaryEmbedding.apply(qkv[:, : heads + kv_heads], table)
    got = qkv.clone()
    rotary_in_place(got[:, : heads + kv_heads], table)  # a strided view: the V heads after it stay as they are
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[:, : heads + kv_heads], want, **tol)
    assert torch.equal(got[:, heads + kv_heads:], qkv[:, heads + kv_heads:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 2 * 1500), (3, 2 * 4096)])
def test_silu_and_mul_matches_the_eager_swiglu(dtype, rows, width):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width)).to(DEVICE, dtype) * 3
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(silu_and_mul(x), want, **tol)
    assert silu_and_mul(x[:0]).shape == (0, width // 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_gives_the_sum_and_the_norm_of_the_eager_layer(dtype):
    from llmserve.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(576, 1e-5).to(DEVICE, dtype)
    norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    x, residual = (torch.randn(9, 576, generator=g).to(DEVICE, dtype) for _ in range(2))
    normed, total = add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, x + residual)
    want = norm(x + residual)  # torch's float32 norm (the model's eager path)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(normed, want, **tol)
    assert torch.equal(normed, batch_invariant_rms_norm(x + residual, norm.weight, norm.eps))  # the same kernel math
    for rows in (slice(0, 1), slice(2, 7)):  # per row: the same bits in any batch
        assert torch.equal(add_rms_norm(x[rows], residual[rows], norm.weight, norm.eps)[0], normed[rows])


def test_store_kv_writes_k_and_v_rows_into_their_slots():
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, slots = 6, 3, 64, 40
    qkv = torch.randn(5, heads + 2 * kv_heads, dim, generator=g).to(DEVICE)
    k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]  # strided views, as the model passes them
    where = torch.tensor([3, 17, 0, 39, 21], device=DEVICE)
    k_cache, v_cache = torch.zeros(slots, kv_heads, dim, device=DEVICE), torch.zeros(slots, kv_heads, dim, device=DEVICE)
    store_kv(k_cache, v_cache, where, k, v)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.index_copy_(0, where, k)
    want_v.index_copy_(0, where, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# ---- end to end -------------------------------------------------------------------------------------------------
def _runner_logits(runner, steps):
    seen = []
    runner.logits_observers.append(lambda ids, rows: seen.append(rows.clone().cpu()))
    for step in steps:
        runner.execute(step)
    runner.logits_observers.clear()
    return seen


def test_a_model_served_with_the_triton_backend_gives_the_sdpa_backends_tokens_and_logits(tmp_path):
    """Prompts of several lengths in one batch, then decode steps (and a prefix-cache hit on the second run)."""
    from llmserve.engine.llm_engine import LLMEngine
    from tests.helpers import assert_same_generation, generate_with_logits, greedy, save_tiny_llama

    path = save_tiny_llama(tmp_path / "tiny", 96, seed=4)
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40)]
    results = {}
    for backend in ("sdpa", "triton"):
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", device=str(DEVICE), attention_backend=backend,
                                        kv_cache_memory="8MiB"), skip_tokenizer=True)
        results[backend] = generate_with_logits(engine, prompts, [greedy(6) for _ in prompts])
        again = generate_with_logits(engine, prompts[2:], [greedy(6)])  # the prompt's blocks come from the cache
        assert_same_generation(*again, [results[backend][0][2]], [results[backend][1][2]])
    assert_same_generation(*results["triton"], *results["sdpa"])


def test_cuda_deterministic_mode_gives_a_request_the_same_logits_alone_chunked_or_batched(tmp_path):
    """The CUDA platform's deterministic mode (Triton matmul, RMSNorm and attention for every layer), run here on
    whatever device the suite has (on CPU through the interpreter): a request's logits are bit for bit the same
    alone, chunked, or batched with other requests."""
    from llmserve.loader import load_model_files
    from llmserve.platforms.cuda import CudaPlatform
    from llmserve.worker.model_runner import ModelRunner
    from tests.helpers import save_tiny_llama

    files = load_model_files(save_tiny_llama(tmp_path / "tiny", 96, seed=5), load_tokenizer=False)
    config = EngineConfig(device=str(DEVICE), dtype="float32", deterministic=True, num_kv_blocks=32, block_size=16,
                          kv_cache_memory="8MiB")
    runner = ModelRunner(config, files.config, files.weights, platform=CudaPlatform(DEVICE))
    assert runner.deterministic and runner.attention.name == "triton"
    assert set(runner.weights.methods.values()) == {"float/batch-invariant-triton"}
    params = SamplingParams(temperature=0, max_tokens=4)
    prompt = list(range(3, 24))

    def new(name, ids):
        return NewRequestData(name, ids, params, set())

    alone = _runner_logits(runner, [StepInput([ScheduledRow("a", prompt, 0, [0, 1], True)],
                                              new_requests=[new("a", prompt)])])
    runner.execute(StepInput([], finished_request_ids=["a"]))
    other = list(range(40, 75))
    mixed = _runner_logits(runner, [
        StepInput([ScheduledRow("o", other[:30], 0, [4, 5, 6], False), ScheduledRow("b", prompt[:9], 0, [2, 3], False)],
                  new_requests=[new("o", other), new("b", prompt)]),
        StepInput([ScheduledRow("o", other[30:], 30, [4, 5, 6], True), ScheduledRow("b", prompt[9:], 9, [2, 3], True)]),
    ])
    assert torch.equal(mixed[-1][1], alone[-1][0])
