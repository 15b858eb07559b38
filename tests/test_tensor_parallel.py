"""Tensor parallelism on this machine: two ranks over gloo, each a process with its own core.

The split model must give what one rank gives: greedy tokens equal and logits within 1e-4 (the row-parallel sums
add the two ranks' halves in another order), on the default model (its 3 KV heads split 2 + 1) and on tiny Llama,
Qwen2 and Qwen3 checkpoints in float32 (test_tensor_parallel_tiny.py: torch allows one process group per process,
so those engines run after this module's). A rank that dies must fail its requests with 503 and end the server, never
hang it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.sampling_params import SamplingParams
from tests.helpers import assert_same_generation, generate_with_logits as generate, greedy
from tests.server_fixtures import ServerProcess, free_port

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours: red,", "Once upon a time"]


@pytest.fixture(scope="module")
def tp2(make_engine, engine_f32, shallow_engine):
    """The default model over two ranks, with a pool small enough to spill prefix blocks to the host tier. The
    single-rank engines this module compares with are built first: while it lives, this process's tensor-parallel
    state is its (a single-rank engine is refused, test_a_second_engine_is_refused_while_two_ranks_run)."""
    engine = make_engine(tensor_parallel_size=2, num_kv_blocks=40, kv_offload_memory="64MiB")
    yield engine
    engine.shutdown()


def test_a_second_engine_is_refused_while_two_ranks_run(tp2, make_engine):
    with pytest.raises(InvalidRequestError, match="an engine with tensor_parallel_size 2 is running in this process"):
        make_engine()
    outs, _ = generate(tp2, PROMPTS[:1], [greedy(4)])  # the running engine is unharmed
    assert len(outs[0].outputs[0].token_ids) == 4


def test_default_model_on_two_ranks_matches_one(tp2, engine_f32):
    assert tp2.executor.info.tensor_parallel_size == 2
    params = [greedy(24, logprobs=3) for _ in PROMPTS]
    outs, logits = generate(tp2, PROMPTS, params)
    ref_outs, ref_logits = generate(engine_f32, PROMPTS, params)
    assert_same_generation(outs, logits, ref_outs, ref_logits)
    for out, ref in zip(outs, ref_outs):
        for lp, ref_lp in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert lp.keys() == ref_lp.keys()
            for tok in lp:
                assert abs(lp[tok] - ref_lp[tok]) < 1e-4
    assert tp2.kv.num_free_blocks == tp2.kv.num_blocks
    tp2.kv.check_integrity()


def test_two_ranks_are_batch_invariant(tp2):
    """Deterministic mode holds across ranks: two ranks' partial sums add the same way whatever the batch."""
    assert tp2.executor.info.deterministic
    seeded = SamplingParams(max_tokens=16, logprobs=2, temperature=0.8, seed=7)
    alone, alone_logits = generate(tp2, PROMPTS[:1], [seeded])
    batch, batch_logits = generate(tp2, PROMPTS, [seeded] + [greedy(20)] * 3)
    assert batch[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert torch.equal(batch_logits[0], alone_logits[0])


def test_spilled_prefix_blocks_come_back_whole_across_ranks(tp2, engine_f32):
    """Blocks evicted to the host tier hold every rank's KV heads; loaded back, each rank gets its own again."""
    long_prompt = "Here is a list of fruits: apple, banana, cherry, apple, banana, cherry, apple, banana, " * 3
    first, _ = generate(tp2, [long_prompt], [greedy(16)])
    hits_before = tp2.kv.stats.hits["host"]
    fillers = [f"Story number {i}: the {w} fox jumped over the lazy dog and ran far away. " * 8
               for i, w in enumerate(["red", "blue", "green", "grey", "brown", "white"])]
    for pair in (fillers[:2], fillers[2:4], fillers[4:]):  # ~50 blocks through a pool of 40: the long prompt's go
        generate(tp2, pair, [greedy(4)] * 2)
    again, again_logits = generate(tp2, [long_prompt], [greedy(16)])
    assert tp2.kv.stats.hits["host"] > hits_before
    assert again[0].num_cached_tokens > 0
    ref, ref_logits = generate(engine_f32, [long_prompt], [greedy(16)])
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    # the spilled blocks themselves are what rank 0 gathered: bit for bit what the ranks wrote
    assert_same_generation(again, again_logits, ref, ref_logits)
    assert tp2.kv.num_free_blocks == tp2.kv.num_blocks
    tp2.kv.check_integrity()


def test_sizes_that_do_not_split_are_refused(make_engine):
    with pytest.raises(InvalidRequestError, match="3 KV heads, fewer than --tensor-parallel-size 4") as e:
        make_engine(tensor_parallel_size=4)
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(tensor_parallel_size=2, compile=True)
    assert e.value.param == "compile"
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    assert e.value.param == "enable_lora"
    with pytest.raises(InvalidRequestError) as e:
        make_engine(tensor_parallel_size=3, deterministic=True)
    assert e.value.param == "tensor_parallel_size"


def test_one_tensor_parallel_engine_per_process(tp2, make_engine):
    with pytest.raises(InvalidRequestError, match="already runs a tensor-parallel engine") as e:
        make_engine(tensor_parallel_size=2)
    assert e.value.param == "tensor_parallel_size"


def test_cli_reports_a_bad_split_in_one_line_and_info_lists_the_good_ones():
    run = subprocess.run([sys.executable, "-m", "llmserve", "generate", "hi", "--tensor-parallel-size", "4"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: the model has 3 KV heads, fewer than --tensor-parallel-size 4: each rank needs at least one"]
    info = subprocess.run([sys.executable, "-m", "llmserve", "info"], capture_output=True, text=True, timeout=120)
    row = next(line for line in info.stdout.splitlines() if "--tensor-parallel-size" in line)
    assert row.split("--tensor-parallel-size", 1)[1].strip() == "1, 2 (KV heads 2+1), 3"


def test_torchrun_ranks_serve_one_engine(shallow_gguf, shallow_engine):
    """Ranks that torchrun starts (as it would on several machines) instead of the engine's own spawn."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "llmserve", "generate", PROMPTS[0], "--model", shallow_gguf, "--max-tokens", "12", "--temperature", "0",
           "--tensor-parallel-size", "2", "--dtype", "float32"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    ref, _ = generate(shallow_engine, [PROMPTS[0]], [greedy(12)])
    assert run.stdout.strip() == ref[0].outputs[0].text.strip()


def _rank_processes(pid: int) -> list[int]:
    """Child processes of `pid` that run a tensor-parallel rank."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"llmserve.executor.rank_process" in c.read():
                        found.append(int(child))
    return found


def test_a_rank_that_dies_fails_its_requests_with_503_and_ends_the_server(shallow_gguf):
    server = ServerProcess("--model", shallow_gguf, "--tensor-parallel-size", "2", "--kv-cache-memory", "64MiB", "--served-model-name", "tp-test")
    base = server.url
    try:
        server.wait_ready(timeout=180)
        ranks = _rank_processes(server.proc.pid)
        assert len(ranks) == 1
        body = {"model": "tp-test", "prompt": "Count: one, two,", "max_tokens": 4000, "ignore_eos": True}
        ok = httpx.post(base + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200, ok.text
        result = {}
        long = threading.Thread(target=lambda: result.update(r=httpx.post(base + "/v1/completions", json=body,
                                                                          timeout=120)))
        long.start()
        time.sleep(2.0)  # decoding by now
        os.kill(ranks[0], signal.SIGKILL)
        long.join(timeout=60)
        assert not long.is_alive(), "the request hung"
        r = result["r"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError"
        assert "tensor-parallel rank 1" in err["message"] and "signal 9" in err["message"]
        assert server.proc.wait(timeout=30) == 1
    finally:
        server.stop()
    output = server.output()
    assert "tensor-parallel rank 1" in output and "shutting down" in output
    assert "Traceback" not in output.split("shutting down")[-1]
