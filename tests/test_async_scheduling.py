"""Async scheduling (`--async-scheduling`, vLLM's name): each step is scheduled and launched before the previous
step's tokens reach the host; its decode rows read them on the device. Users see the same tokens, text, logprobs and
streamed pieces as without it, under chunking, preemption, prefix-cache hits, structured output and aborts, and no
KV block leaks. On CPU nothing overlaps (the step computes in the engine's call), but every piece of bookkeeping
runs as on a GPU."""

from __future__ import annotations

import pytest

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import run_streams

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time",
           "Q: What is 2 + 2?\nA:", "Q: What is 2 + 2?\nA: 4\nQ: What is 3 + 5?\nA: 8\nQ: What is 7 + 6?\nA: 13\nQ: What is 9 + 9?\nA:"]


def requests():
    """(prompt, params): greedy and seeded sampling, stop strings and ids, logprobs and prompt logprobs, n=2,
    min_tokens, penalties, a grammar."""
    return [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[".", "\n"], logprobs=2)),
        (PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, n=2)),
        (PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, stop=["return"], include_stop_str_in_output=True)),
        (PROMPTS[3], SamplingParams(temperature=1.0, seed=3, max_tokens=16, min_tokens=8, stop_token_ids=[13])),
        (PROMPTS[4], SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, repetition_penalty=1.3,
                                    frequency_penalty=0.5)),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=20,
                                    structured_outputs=StructuredOutputsParams(choice=["Paris", "Lyon", "Nice"]))),
        (PROMPTS[5], SamplingParams(temperature=0, max_tokens=5)),  # longer than a block: cached
    ]


def run(engine, work=None):
    """Every request's final output and the text its stream delivered; checks the KV pool after every step."""
    return run_streams(engine, work or requests(), check_integrity=True)


def summary(out):
    return ([(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in out.outputs], out.prompt_logprobs)


def test_same_outputs_and_streams_as_without_it(make_engine):
    want, want_streams = run(make_engine())
    engine = make_engine(async_scheduling=True)
    got, got_streams = run(engine)
    assert [summary(o) for o in got] == [summary(o) for o in want]
    assert got_streams == want_streams
    assert got[5].outputs[0].text in ("Paris", "Lyon", "Nice")
    # the prompts again: prefix-cache hits, same outputs
    again, _ = run(engine)
    assert again[6].num_cached_tokens >= 16
    assert [summary(o) for o in again] == [summary(o) for o in want]


def test_same_outputs_under_chunking_and_preemption(make_engine):
    work = [(p, SamplingParams(temperature=0 if i % 2 else 0.7, seed=i, max_tokens=40, ignore_eos=True))
            for i, p in enumerate(PROMPTS[:5] * 2)]
    tight = dict(num_kv_blocks=14, block_size=16, max_num_batched_tokens=16, max_num_seqs=8)
    want, _ = run(make_engine(**tight), work)
    engine = make_engine(async_scheduling=True, **tight)
    got, _ = run(engine, work)
    assert engine.scheduler.num_preemptions > 0  # the pool was too small for all of them at once
    assert [summary(o) for o in got] == [summary(o) for o in want]
    assert all(len(o.outputs[0].token_ids) == 40 for o in got)


def test_tokens_arrive_one_step_later(make_engine):
    engine = make_engine(async_scheduling=True)
    rid = engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prompt is on the device; its token is not processed yet
    first = engine.step()  # the first decode step is launched, then the prompt's token processed
    assert [len(o.outputs[0].token_ids) for o in first] == [1]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == rid and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_abort_in_flight_frees_its_blocks_and_spares_the_others(make_engine):
    keep = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone, _ = run(make_engine(), [(PROMPTS[1], keep)])
    engine = make_engine(async_scheduling=True)
    doomed = engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    kept = engine.add_request(None, PROMPTS[1], keep)
    for _ in range(6):
        engine.step()
    out = engine.abort_request(doomed)
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id != doomed
            if o.finished:
                done[o.request_id] = o
    assert summary(done[kept]) == summary(alone[0])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("other, why", [
    (dict(speculative_method="ngram"), "speculative decoding"),
    (dict(tensor_parallel_size=2), "tensor parallelism"),
])
def test_refused_where_it_cannot_work(other, why):
    with pytest.raises(InvalidRequestError, match=f"async scheduling does not work with {why}"):
        EngineConfig(async_scheduling=True, **other)


def llmserve(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True, timeout=300)


def test_the_command_line(default_gguf):
    r = llmserve("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                 "--async-scheduling")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    r = llmserve("info")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("async scheduling") and "--async-scheduling" in line for line in r.stdout.splitlines())
    r = llmserve("generate", "hi", "--async-scheduling", "--speculative-method", "ngram")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        "error: async scheduling does not work with speculative decoding"]


def test_tiny_checkpoint_on_the_default_device(tmp_path):
    """The engine on whatever device this machine has (CUDA on a GPU machine: Triton attention, CUDA graphs with
    their page-locked staging, the fused kernels), in the batch-invariant mode so that the two runs compare bit for
    bit: async scheduling gives the tokens and logprobs of running without it."""
    from llmserve.engine.llm_engine import LLMEngine
    from tests.helpers import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny", 512, seed=9)
    rng = __import__("random").Random(4)
    work = [([rng.randrange(3, 512) for _ in range(rng.randrange(3, 40))],
             SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=rng.randrange(4, 30), logprobs=1,
                            ignore_eos=True)) for i in range(12)]

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(folder), dtype="float32", deterministic=True, num_kv_blocks=64,
                                      block_size=16, max_num_seqs=8, max_num_batched_tokens=64, **kw),
                         skip_tokenizer=True)

    def outcomes(e):
        done = {}
        ids = [e.add_request(None, prompt, params) for prompt, params in work]
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out
        assert e.kv.num_free_blocks == e.kv.num_blocks
        return [(done[i].outputs[0].token_ids, done[i].outputs[0].logprobs) for i in ids]

    assert outcomes(engine(async_scheduling=True)) == outcomes(engine())


# ---- the property: random workloads, each request as if alone without async scheduling --------------------------

@pytest.fixture(scope="module")
def tiny_benches(tmp_path_factory):
    from llmserve import kernels
    from tests.lora_helpers import tiny_base
    from tests.test_deterministic import Workloads

    if not kernels.load_cpu_kernels() or kernels.lowbit_linear_float32_isa() != "avx2":
        pytest.skip("the batch-invariant mode (exact comparisons) needs llmserve's AVX2 kernels")
    folder = tmp_path_factory.mktemp("tiny_async")
    tiny_base(folder, "llama", seed=5, vocab_size=256)
    return Workloads(str(folder), 256), Workloads(str(folder), 256, async_scheduling=True)


def test_property_every_request_as_if_alone(tiny_benches):
    """Random arrivals, chunk budgets, prefix caching on and off, a pool small enough to preempt, greedy and seeded
    sampling with penalties and logprobs: under async scheduling every request's tokens and logprobs are bitwise
    those of running it alone without it (the batch-invariant mode makes that comparison exact)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.test_deterministic import outcome, run, workloads

    reference, overlapped = tiny_benches

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), budget=st.sampled_from([(5, 0), (16, 0), (16, 3), (4096, 0)]), prefix_caching=st.booleans(),
           tight_kv=st.booleans())
    def check(data, budget, prefix_caching, tight_kv):
        arrivals = data.draw(workloads(256))
        done = run(overlapped.engine(budget, prefix_caching, tight_kv, False), arrivals)
        for _, rid, prompt, params in arrivals:
            assert outcome(done[rid]) == reference.reference(prompt, params), rid

    check()
