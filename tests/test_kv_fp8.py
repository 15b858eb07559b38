"""FP8 KV cache (--kv-cache-dtype fp8): e4m3fn values, scale 1.

The native kernel converts every stored value exactly, so on an FP8 cache it must give what it gives on the same
values held in the model's dtype, bit for bit. The pool holds twice the tokens of bf16 in the same memory, blocks
survive the spill tiers byte for byte, and the model's accuracy cost is checked in test_precision_modes.
"""

import pytest
import torch

from llmserve import kernels
from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.plan.models import load_spec
from llmserve.sampling_params import SamplingParams
from tests.helpers import greedy, run_to_completion
from tests.test_native_kernels import needs_prefill_kernel, reference
from tests.test_prefix_cache import evict_all, spill_run, tiny_engine, tiny_model_dir  # noqa: F401 (fixture)

FP8 = torch.float8_e4m3fn
needs_kernels = pytest.mark.skipif(not kernels.load_cpu_kernels(), reason=f"no C++ toolchain: {kernels.build_error()}")


def _paged(generator, heads, kv_heads, head_dim, block_size, num_blocks=48):
    lengths = torch.tensor([1, 2, block_size, block_size + 1, 31, 32, 33, 5 * block_size + 3])
    width = -(-int(lengths.max()) // block_size) + 1
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:width] for _ in lengths])
    q = torch.randn(len(lengths), heads, head_dim, generator=generator)
    return q, tables, lengths


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # the default model's attention
    (8, 2, 128, 64),  # blocks larger than the kernel's chunk
    (6, 2, 48, 16),  # portable path
])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 2.0)])
def test_fp8_cache_gives_what_its_values_give_in_the_model_dtype(dtype, heads, kv_heads, head_dim, block_size, k_scale, v_scale):
    g = torch.Generator().manual_seed(head_dim + block_size)
    slots = 48 * block_size
    k8 = (torch.randn(slots, kv_heads, head_dim, generator=g) * 3).to(FP8)
    v8 = (torch.randn(slots, kv_heads, head_dim, generator=g) * 3).to(FP8)
    q, tables, lengths = _paged(g, heads, kv_heads, head_dim, block_size)
    q, scale = q.to(dtype), head_dim**-0.5
    op = torch.ops.llmserve_kernels.paged_decode_attention
    out = op(q, k8, v8, tables, lengths, block_size, scale, k_scale, v_scale)
    # powers of two: scaling is exact in float arithmetic, wherever it is applied
    same = op(q, (k8.float() * k_scale).to(dtype), (v8.float() * v_scale).to(dtype), tables, lengths, block_size, scale)
    assert out.dtype == dtype and torch.equal(out, same)


@needs_kernels
def test_every_e4m3_code_is_read_exactly():
    """All 254 finite codes, subnormals and +-448 included, as keys and as values, against float64 attention."""
    codes = torch.arange(256, dtype=torch.int64)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7F and 0xFF are e4m3fn's NaNs
    values = codes.view(FP8)
    block_size, kv_heads, head_dim = 16, 1, 64
    slots = 4 * block_size  # 254 codes over 64 slots x 64 dims, repeated
    cache = values.repeat(slots * head_dim // len(values) + 1)[: slots * head_dim].view(slots, kv_heads, head_dim)
    shuffled = cache.view(torch.uint8).flip(0).flip(2).view(FP8)
    tables = torch.tensor([[0, 1, 2, 3], [3, 1, 0, 2]])
    lengths = torch.tensor([64, 57])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, head_dim, generator=g) * 1e-3  # small: scores of keys up to 448 stay moderate
    for k8, v8 in ((cache, shuffled), (shuffled, cache)):
        out = torch.ops.llmserve_kernels.paged_decode_attention(q, k8, v8, tables, lengths, block_size, 1.0)
        expected = reference(q, k8.double(), v8.double(), tables, lengths, block_size, 1.0)
        assert (out.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_fp8_pool_holds_twice_the_tokens_and_matches_the_planner(make_engine, default_gguf):
    bf16 = make_engine(dtype="bfloat16", kv_cache_memory="64MiB")
    fp8 = make_engine(dtype="bfloat16", kv_cache_memory="64MiB", kv_cache_dtype="fp8")
    assert fp8.kv.num_blocks == 2 * bf16.kv.num_blocks
    per_token = fp8.executor.info.kv_cache_bytes / (fp8.kv.num_blocks * fp8.config.block_size)
    assert per_token == load_spec(default_gguf).kv_bytes_per_token(1) == 11_520
    assert fp8.executor.info.kv_dtype == "float8_e4m3fn" and fp8.executor.read_block(0).dtype == FP8


def test_fp8_engine_serves_a_batch_and_frees_every_block(make_engine):
    engine = make_engine(dtype="bfloat16", kv_cache_dtype="fp8")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    tok = engine.tokenizer
    for i, p in enumerate(prompts):
        engine.add_request(str(i), tok.encode(p), greedy(16, ignore_eos=True))
    outs = run_to_completion(engine)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_float8_e5m2_and_unknown_dtypes_are_refused():
    for bad in ("fp8_e5m2", "int8", "bf16"):
        with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
            EngineConfig(kv_cache_dtype=bad)


def test_fp8_blocks_come_back_from_the_disk_tier_byte_for_byte(tiny_model_dir, tmp_path):
    """A prefix evicted to disk in FP8 and read back gives the logits of the same prompt run without the cache, in
    two chunks: both attend to the first 20 tokens' K/V as stored in FP8."""
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, kv_offload_dir=str(tmp_path / "kv"), kv_cache_dtype="fp8")
    reference_engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, enable_prefix_caching=False, kv_cache_dtype="fp8",
                                   max_num_batched_tokens=20)
    prompt = list(range(3, 23)) + [7]  # 5 full blocks + 1 token
    spill_run(engine, prompt)
    evict_all(engine, 1)
    again, logits = spill_run(engine, prompt)
    assert again.num_cached_tokens == 20 and engine.kv.stats.hits["disk"] == 20
    ref, ref_logits = spill_run(reference_engine, prompt)
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    engine.kv.check_integrity()


@needs_prefill_kernel
def test_fresh_prompts_under_fp8_take_the_prompt_kernel_on_their_own_keys(make_engine):
    """Under an FP8 cache a whole prompt attends to its own keys before they are rounded, through the prompt kernel a
    bf16 cache takes (not SDPA): its prompt logprobs and first token's are the bf16 cache's, bit for bit."""
    if kernels.lowbit_linear_isa() == "amx":
        pytest.skip("on an AMX CPU prompts keep torch's flash attention")

    def run(kv_cache_dtype):
        engine = make_engine(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
        assert engine.executor.info.attention_backend == "native"
        prompt = engine.tokenizer.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 8))
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, logprobs=5))
        out = run_to_completion(engine)["p"]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        return out.prompt_logprobs, out.outputs[0].logprobs, out.outputs[0].token_ids

    fp8, bf16 = run("fp8"), run("auto")
    assert len(fp8[0]) > 70 and fp8 == bf16
