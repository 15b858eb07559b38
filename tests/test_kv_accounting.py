"""Property test: after any mix of finished, aborted and preempted requests, every KV block is free."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import SamplingParams
from tests.helpers import save_tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), 128, seed=0, layers=1, heads=2, kv_heads=1, max_positions=256)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, blocks=st.integers(4, 12), budget=st.integers(2, 32), policy=st.sampled_from(["fcfs", "priority"]))
def test_every_block_free_after_any_workload(tiny_model_dir, ops, blocks, budget, policy):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_kv_blocks=blocks, block_size=4,
                                    max_num_batched_tokens=budget, max_num_seqs=6, scheduling_policy=policy), skip_tokenizer=True)
    n = 0
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, sampled = op
            if engine.kv.blocks_needed(length + 1) > blocks:
                continue
            params = SamplingParams(temperature=0.8 if sampled else 0.0, max_tokens=max_tokens, ignore_eos=True, seed=n)
            engine.add_request(str(n), [(n * 7 + j) % 128 for j in range(length)], params, priority=n % 3)
            n += 1
        elif op[0] == "abort":
            engine.abort_request(str(op[1]))
        else:
            for _ in range(op[1]):
                engine.step()
        engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == blocks
    assert not engine.kv.block_tables
