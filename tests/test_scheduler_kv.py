"""The scheduler and the KV-cache manager without a model (as vLLM's tests/v1/core): a stand-in for the executor
emits a token for each request that samples, so every step is plain arithmetic on counters and block tables."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.config import EngineConfig
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams

EOS = 2


def make(num_blocks=16, block_size=4, budget=32, max_num_seqs=8, policy="fcfs", prefix_caching=True):
    config = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          scheduling_policy=policy, enable_prefix_caching=prefix_caching)
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(config, kv, max_model_len=1024), kv


def request(rid, prompt, max_tokens=4, priority=0):
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), [EOS],
                   priority=priority)


def step(sched: Scheduler):
    """One step: the scheduler's decision, then a token (the request's length, mod 100) for each sampling row.
    Returns the decision and its rows as (request id, new tokens, samples), read before the counters move."""
    out = sched.schedule()
    rows = [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]
    sampled = {s.request.request_id: [s.request.num_tokens % 100 + 3] for s in out.scheduled if s.samples}
    sched.update_from_output(out, sampled)
    return out, rows


def test_prompts_are_chunked_under_the_token_budget_and_decodes_go_first():
    sched, kv = make(budget=8)
    sched.add_request(request("a", list(range(10, 30)), max_tokens=3))  # 20 prompt tokens
    _, rows = step(sched)
    assert rows == [("a", 8, False)]
    sched.add_request(request("b", list(range(40, 45))))
    _, rows = step(sched)  # the running request's next chunk takes the whole budget: b waits
    assert rows == [("a", 8, False)]
    _, rows = step(sched)  # a's last 4 prompt tokens (it samples), then b's 5-token prompt in what is left
    assert rows == [("a", 4, True), ("b", 4, False)]
    while sched.has_unfinished():
        out, _ = step(sched)
        assert out.total_tokens <= 8
        kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables


def test_a_full_pool_preempts_the_newest_and_recomputes_it_later():
    sched, kv = make(num_blocks=6, block_size=4, budget=64)
    a, b = request("a", list(range(10, 18)), max_tokens=12), request("b", list(range(20, 28)), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.has_unfinished():
        out, _ = step(sched)
        preempted += [r.request_id for r in out.preempted]
        kv.check_integrity()
    assert preempted and set(preempted) == {"b"}  # the newest gives way; a never does
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 12 and b.num_preemptions >= 1
    assert kv.num_free_blocks == kv.num_blocks


def test_priority_policy_preempts_the_worst_priority():
    sched, kv = make(num_blocks=6, block_size=4, budget=64, policy="priority")
    sched.add_request(request("urgent", list(range(10, 18)), max_tokens=12, priority=0))
    sched.add_request(request("later", list(range(20, 28)), max_tokens=12, priority=5))
    preempted = []
    while sched.has_unfinished():
        out, _ = step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"later"}


def test_a_second_request_with_the_same_prefix_starts_from_the_cached_blocks():
    sched, kv = make(num_blocks=32, block_size=4)
    prefix = list(range(50, 62))  # three full blocks
    first = request("first", prefix + [70, 71])
    sched.add_request(first)
    while sched.has_unfinished():
        step(sched)
    second = request("second", prefix + [80, 81, 82])
    sched.add_request(second)
    _, rows = step(sched)
    assert second.num_cached_tokens == 12 and rows == [("second", 3, True)]  # only the new tokens computed
    while sched.has_unfinished():
        step(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_the_last_prompt_token_is_always_computed():
    sched, _ = make(num_blocks=32, block_size=4)
    prompt = list(range(50, 58))  # exactly two full blocks
    for rid in ("one", "two"):
        sched.add_request(request(rid, prompt))
        _, rows = step(sched)
        assert rows[0][2] and rows[0][1] >= 1
        while sched.has_unfinished():
            step(sched)
    assert sched.requests == {}


def test_a_sequence_outgrowing_the_whole_pool_ends_with_length():
    sched, kv = make(num_blocks=3, block_size=4, budget=64)
    long = request("long", list(range(10, 16)), max_tokens=20)  # 6 + 20 tokens would need 7 blocks
    sched.add_request(long)
    ended = []
    while sched.has_unfinished():
        out, _ = step(sched)
        ended += out.finished
    assert ended == [long] and long.status == RequestStatus.FINISHED_LENGTH
    assert long.num_tokens == 12 + 1  # three full blocks computed, then the token sampled after them
    assert kv.num_free_blocks == kv.num_blocks


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 10), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 5)),
), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, blocks=st.integers(3, 16), budget=st.integers(1, 40), seqs=st.integers(1, 6),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans())
def test_any_workload_keeps_the_budget_and_frees_every_block(ops, blocks, budget, seqs, policy, caching):
    sched, kv = make(num_blocks=blocks, block_size=4, budget=budget, max_num_seqs=seqs, policy=policy,
                     prefix_caching=caching)
    added = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, priority = op
            if kv.blocks_needed(length + 1) > blocks:  # the engine refuses such a prompt before it is queued
                continue
            rid = str(len(added))
            # shared starts, so that prefix hits and evictions happen
            req = request(rid, [(j * 5 + length % 3) % 90 + 3 for j in range(length)], max_tokens, priority)
            added.append(req)
            sched.add_request(req)
        elif op[0] == "abort":
            sched.abort(str(op[1]))
        else:
            for _ in range(op[1]):
                out, _ = step(sched)
                assert out.total_tokens <= budget and len(sched.running) <= seqs
                kv.check_integrity()
    for _ in range(10_000):  # every request finishes: no step leaves the queue stuck
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        assert out.total_tokens <= budget
        kv.check_integrity()
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == blocks and not kv.block_tables
    for req in added:
        assert req.is_finished
        if req.status is RequestStatus.FINISHED_LENGTH and kv.blocks_needed(req.num_prompt_tokens + req.params.max_tokens) <= blocks:
            assert req.num_output_tokens == req.params.max_tokens
