"""Deterministic mode (--deterministic): a request's tokens and logprobs are bit-for-bit those it gets alone with a
fresh cache, whatever shares its steps, however its prompt is chunked, cached, preempted or speculatively verified.

Checked through the engine on the default model (its int4 codes through the AVX2 route) and on a tiny random Llama
in float32 (float layers through the batch-invariant float matmul), and on the kernels the mode is made of.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError
from llmserve import kernels

pytestmark = pytest.mark.skipif(not kernels.load_cpu_kernels() or kernels.lowbit_linear_float32_isa() != "avx2",
                                reason="deterministic mode needs llmserve's AVX2 kernels")


def outcome(out):
    """What must be bitwise equal: the tokens, every position's logprobs, the finish."""
    o = out.outputs[0]
    return o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason


# ---- the kernels --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1536, 576), (1000, 63), (96, 32)])
def test_float_panel_matmul_is_batch_invariant_and_accurate(n, k):
    from llmserve.layers.quant.float_panel import FloatPanelWeight

    class Layer:
        bias = None

    torch.manual_seed(n)
    weight, x = torch.randn(n, k), torch.randn(29, k)
    method = FloatPanelWeight(weight)
    full = method.apply(Layer, x)
    reference = (x.double() @ weight.double().T).float()
    assert torch.allclose(full, reference, rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 5, 6, 7, 13):
        for start in (0, 3, 29 - rows):
            assert torch.equal(method.apply(Layer, x[start:start + rows]), full[start:start + rows]), (rows, start)


def test_rowwise_attention_is_batch_invariant():
    """A query row gives the same bits alone, among other sequences' rows, or as one of its own prompt's rows; and
    matches SDPA."""
    from llmserve.attention.backend import SeqSpan
    from llmserve.attention.cpu_batch_invariant import BatchInvariantBackend
    from llmserve.layers.attention import PagedAttention

    torch.manual_seed(0)
    heads, kv_heads, d, bs = 8, 2, 64, 16
    backend = BatchInvariantBackend(heads, kv_heads, d, bs, torch.float32, torch.float32, torch.device("cpu"))
    layer = PagedAttention(heads, kv_heads, d)
    layer.block_size = bs
    num_blocks = 80
    layer.k_cache = torch.zeros(num_blocks * bs, kv_heads, d)
    layer.v_cache = torch.zeros(num_blocks * bs, kv_heads, d)
    lengths = [700, 37, 300]  # past 2 x 256 keys: several ranges of the fixed split
    tables, free = [], list(np.random.default_rng(0).permutation(num_blocks))
    keys, values = [], []
    for n in lengths:
        tables.append([int(free.pop()) for _ in range(-(-n // bs))])
        keys.append(torch.randn(n, kv_heads, d))
        values.append(torch.randn(n, kv_heads, d))
        slots = torch.tensor([tables[-1][p // bs] * bs + p % bs for p in range(n)])
        layer.k_cache[slots], layer.v_cache[slots] = keys[-1], values[-1]
    queries = [torch.randn(n, heads, d) for n in lengths]

    def attend(spans_rows):
        """spans_rows: (sequence, first position, number of rows) per span."""
        spans, q, offset = [], [], 0
        for s, first, n in spans_rows:
            spans.append(SeqSpan(offset, n, first + n, tables[s]))
            q.append(queries[s][first:first + n])
            offset += n
        positions = np.concatenate([np.arange(f, f + n) for _, f, n in spans_rows])
        meta = backend.build_metadata(spans, positions, torch.empty(0, dtype=torch.long))
        q = torch.cat(q)
        return meta.groups[0].attend(layer, q, None, None)

    batched = attend([(0, 690, 10), (1, 0, 37), (2, 299, 1)])
    alone_decode = attend([(0, 699, 1)])
    alone_prompt = attend([(0, 0, 700)])
    assert torch.equal(batched[9], alone_decode[0]) and torch.equal(batched[9], alone_prompt[699])
    assert torch.equal(batched[10:47], attend([(1, 0, 37)]))
    assert torch.equal(batched[47], attend([(2, 299, 1)])[0])
    # against SDPA on the first sequence's whole prompt (GQA: KV heads repeated)
    k = keys[0].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    v = values[0].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(queries[0].transpose(0, 1), k, v, is_causal=True)
    assert torch.allclose(alone_prompt, ref.transpose(0, 1), atol=2e-5)


# ---- the three cases a user saw -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def det_llm():
    return LLM(deterministic=True, kv_cache_memory="128MiB", device="cpu")


def test_seeded_request_alone_and_in_a_batch(det_llm):
    params = SamplingParams(seed=42, temperature=0.9, top_p=0.95, max_tokens=24, logprobs=2)
    prompt = "Tell me a story about a dragon who"
    alone = det_llm.generate([prompt], params, use_tqdm=False)[0]
    others = ["The capital of France is", "Write a poem about the sea.", "List three fruits:", "Why is the sky blue?"]
    batch = det_llm.generate([prompt] + others, [params] + [SamplingParams(temperature=0.7, max_tokens=24, seed=i)
                                                            for i in range(4)], use_tqdm=False)[0]
    assert outcome(batch) == outcome(alone)


def test_greedy_then_top_k_1_through_the_prefix_cache(det_llm):
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters. "
    prompts = [story + "The eldest", story + "One morning, the youngest daughter", "def quicksort(arr):\n" * 6,
               "Why is the sky blue? Explain it to a child, in simple words, with an example from everyday life."]
    first = det_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=2), use_tqdm=False)
    second = det_llm.generate(prompts, SamplingParams(top_k=1, max_tokens=24, logprobs=2), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in second) > 0  # the second call did hit the cache
    assert [outcome(o) for o in second] == [outcome(o) for o in first]


def test_speculation_changes_speed_not_output(det_llm):
    spec = LLM(deterministic=True, kv_cache_memory="128MiB", device="cpu",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = ["1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4",
               "def f(x):\n    return x\ndef g(x):\n    return x\ndef h(x):\n"]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    plain = det_llm.generate(prompts, params, use_tqdm=False)
    fast = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.speculator.stats.num_accepted_tokens > 0  # drafts were verified, several positions a row
    assert [outcome(o) for o in fast] == [outcome(o) for o in plain]


# ---- the property: random workloads against each request alone ---------------------------------------------------

class Workloads:
    """Engines of one model, built once per configuration, and each request's reference: run alone, with a fresh
    cache (prefix caching off), the whole prompt in one step."""

    def __init__(self, model: str | None, vocab: int, files=None, deterministic: bool = True, **engine_kw):
        self.model, self.vocab, self.files, self.deterministic = model, vocab, files, deterministic
        self.engine_kw = engine_kw
        self.engines: dict[tuple, LLMEngine] = {}
        self.references: dict[tuple, tuple] = {}

    def engine(self, budget: tuple[int, int], prefix_caching: bool, tight_kv: bool, spec: bool) -> LLMEngine:
        """budget: the step's token budget and each prompt's cap in it (long_prefill_token_threshold, 0: none)."""
        key = (budget, prefix_caching, tight_kv, spec)
        if key not in self.engines:
            kv = dict(num_kv_blocks=24, block_size=4) if tight_kv else dict(kv_cache_memory="64MiB")
            # drafts for every sequence on every step (no step budget), so that what a request drafts, and so the
            # random numbers a sampled one uses, depend on its own tokens only
            spec_args = dict(speculative_method="ngram", num_speculative_tokens=3, spec_max_tokens_per_step=4096,
                             ngram_min=1, ngram_max=3) if spec else {}
            self.engines[key] = LLMEngine(EngineConfig(
                model=self.model, device="cpu", deterministic=self.deterministic, max_num_batched_tokens=budget[0],
                long_prefill_token_threshold=budget[1],
                max_num_seqs=8, enable_prefix_caching=prefix_caching, **kv, **spec_args, **self.engine_kw), files=self.files)
        return self.engines[key]

    def reference(self, prompt: list[int], params: SamplingParams) -> tuple:
        key = (tuple(prompt), repr(params))
        if key not in self.references:
            engine = self.engine((4096, 0), False, False, False)
            engine.add_request("alone", prompt, params)
            self.references[key] = outcome(run(engine, [])["alone"])
        return self.references[key]


def run(engine: LLMEngine, arrivals: list[tuple[int, str, list[int], SamplingParams]]) -> dict:
    """Adds each request at its step, steps until every one is done; checks no KV block is left behind."""
    done, pending, step = {}, sorted(arrivals, key=lambda a: a[0]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return done


def workloads(vocab: int):
    """1-5 requests: prompts from a few shared prefixes (prefix-cache hits) plus random or repeating tails (drafts for
    ngram speculation), greedy or seeded sampling with penalties and logprobs, arriving at different steps."""
    prefix_rng = np.random.default_rng(7)
    prefixes = [[], list(prefix_rng.integers(3, vocab, 21)), list(prefix_rng.integers(3, vocab, 37))]
    tail = st.one_of(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=24),
                     st.tuples(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=4), st.integers(2, 6))
                     .map(lambda t: t[0] * t[1]))
    greedy = st.builds(lambda n, lp: SamplingParams(temperature=0, max_tokens=n, logprobs=lp, ignore_eos=True),
                       st.integers(1, 12), st.integers(0, 3))
    sampled = st.builds(lambda n, lp, seed, t, p, k, rep: SamplingParams(
        temperature=t, top_p=p, top_k=k, repetition_penalty=rep, seed=seed, max_tokens=n, logprobs=lp,
        ignore_eos=True), st.integers(1, 12), st.integers(0, 3), st.integers(0, 2**31), st.sampled_from([0.6, 1.0, 1.4]),
        st.sampled_from([1.0, 0.9]), st.sampled_from([0, 5]), st.sampled_from([1.0, 1.2]))
    request = st.tuples(st.integers(0, 4), st.sampled_from(range(len(prefixes))), tail, st.one_of(greedy, sampled))
    return st.lists(request, min_size=1, max_size=5).map(
        lambda reqs: [(at, f"r{i}", [int(t) for t in prefixes[p]] + tail_ids, params)
                      for i, (at, p, tail_ids, params) in enumerate(reqs)])


def check_workload(bench: Workloads, budget, prefix_caching, tight_kv, spec, arrivals):
    """Every request equals its reference bit for bit, except a sampled one under speculation: how many drafts its
    rows carry depends on how its prompt was chunked, and a verified draft consumes its random numbers differently
    (rejection sampling), so it is equal in distribution only (the χ² tests in test_spec_decode.py). Its greedy
    neighbours under speculation must equal the reference without it."""
    done = run(bench.engine(budget, prefix_caching, tight_kv, spec), arrivals)
    for _, rid, prompt, params in arrivals:
        if spec and params.temperature > 0:
            assert len(done[rid].outputs[0].token_ids) == params.max_tokens
            continue
        assert outcome(done[rid]) == bench.reference(prompt, params), rid


ENGINE_SHAPES = dict(budget=st.sampled_from([(5, 0), (16, 0), (16, 3), (4096, 0), (4096, 7)]),
                     prefix_caching=st.booleans(), tight_kv=st.booleans(), spec=st.booleans())


@pytest.fixture(scope="module")
def tiny_workloads(tmp_path_factory):
    """The tiny random Llama's workloads by KV cache dtype: with FP8 every row reads the rounded keys, so a prompt row
    equals its decode-row self there too."""
    from tests.lora_helpers import tiny_base

    folder = tmp_path_factory.mktemp("tiny_det")
    tiny_base(folder, "llama", seed=3, vocab_size=256)
    return {kv: Workloads(str(folder), 256, kv_cache_dtype=kv) for kv in ("auto", "fp8")}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), **ENGINE_SHAPES)
def test_property_tiny_llama_every_request_as_if_alone(tiny_workloads, kv_cache_dtype, data, budget, prefix_caching,
                                                       tight_kv, spec):
    check_workload(tiny_workloads[kv_cache_dtype], budget, prefix_caching, tight_kv, spec, data.draw(workloads(256)))


@pytest.fixture(scope="module")
def default_workloads(default_files):
    return Workloads(None, 49152, default_files)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), **ENGINE_SHAPES)
def test_property_default_model_every_request_as_if_alone(default_workloads, data, budget, prefix_caching, tight_kv,
                                                          spec):
    check_workload(default_workloads, budget, prefix_caching, tight_kv, spec, data.draw(workloads(49152)))


# ---- the interface: defaults, reports, refusals -------------------------------------------------------------------

def test_default_on_for_float32_cpus_and_off_where_asked(default_files):
    """This machine serves float32 (AVX2 without fast bf16): the mode is on unless something incompatible is asked."""
    from llmserve.platforms.cpu import cpu_has_fast_bf16

    def mode(**kw):
        return LLMEngine(EngineConfig(device="cpu", kv_cache_memory="16MiB", **kw), files=default_files).executor.info

    auto = mode()
    assert auto.deterministic is (not cpu_has_fast_bf16())
    if auto.deterministic:
        assert auto.dtype == "float32" and auto.attention_backend == "batch-invariant"
    assert not mode(deterministic=False).deterministic
    assert not mode(attention_backend="native").deterministic  # a backend chosen: the user's choice holds
    assert mode(deterministic=True, dtype="float32").deterministic


@pytest.mark.parametrize("setting,param", [
    (dict(compile=True), "compile"),
    (dict(enable_lora=True), "enable_lora"),
    (dict(attention_backend="sdpa"), "attention_backend"),
    (dict(decode_quantization_max_rows=4), "decode_quantization_max_rows"),
])
def test_incompatible_settings_are_refused(setting, param):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(deterministic=True, **setting)
    assert e.value.param == param and "deterministic" in str(e.value)


def test_bf16_on_cpu_and_what_cuda_cannot_do_are_refused(default_files, monkeypatch):
    with pytest.raises(InvalidRequestError, match="float32 on CPU") as e:
        LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", deterministic=True), files=default_files)
    assert e.value.param == "dtype"
    import llmserve.attention.triton_paged as triton_paged
    from llmserve.platforms.cuda import CudaPlatform

    cuda = CudaPlatform(torch.device("cuda"))
    # CUDA's mode runs Triton kernels (tests/test_triton_kernels.py runs them); one GPU only
    with pytest.raises(InvalidRequestError, match="tensor parallelism") as e:
        cuda.resolve_deterministic(EngineConfig(deterministic=True, tensor_parallel_size=2))
    assert e.value.param == "tensor_parallel_size"
    monkeypatch.setattr(triton_paged, "triton_available", lambda: "the triton package is not installed")
    with pytest.raises(InvalidRequestError, match="Triton kernels, and the triton package is not installed") as e:
        cuda.resolve_deterministic(EngineConfig(deterministic=True))
    assert e.value.param == "deterministic"


def test_cli_reports_and_refuses():
    from tests.test_cli import llmserve as run

    info = run("info", "--deterministic")
    assert info.returncode == 0 and "deterministic (batch-invariant)   on" in info.stdout
    bad = run("generate", "hi", "--deterministic", "--dtype", "bfloat16", "--max-tokens", "2")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: deterministic mode runs in float32 on CPU (its batch-invariant "
                                               "matmuls are float32 ones); drop --dtype bfloat16"]


def test_server_metrics_and_concurrent_requests_equal_alone(default_files):
    """Over HTTP with the real openai client: concurrent requests give what each gives alone; /metrics says the mode."""
    import concurrent.futures

    import httpx
    import openai

    from tests.server_fixtures import RunningServer

    server = RunningServer(default_files, dict(device="cpu", deterministic=True), {})
    try:
        metrics = httpx.get(server.base_url + "/metrics").text
        assert 'llmserve:deterministic_mode{model_name="test-model"} 1.0' in metrics
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "Water boils at", "The sky is"]

        def ask(prompt):
            r = client.completions.create(model="test-model", prompt=prompt, max_tokens=16, temperature=0.8, seed=7,
                                          logprobs=2)
            return r.choices[0].text, r.choices[0].logprobs.token_logprobs

        alone = [ask(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
        assert together == alone
        server.wait_idle()
    finally:
        server.stop()
