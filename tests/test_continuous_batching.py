"""Continuous batching, chunked prefill and preemption must be invisible in the tokens."""

import pytest

from tests.helpers import greedy, run_to_completion

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at",
    "List of prime numbers: 2, 3, 5,",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "My favourite recipe for pancakes needs",
    "Photosynthesis is the process by which",
    "The derivative of x^2 is",
    "Dear hiring manager,\n",
    "Translate to French: good morning ->",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def solo_outputs(engine_f32):
    """Each prompt alone: the reference."""
    solo = {}
    for i, p in enumerate(PROMPTS):
        engine_f32.add_request(f"solo{i}", p, greedy(MAX_TOKENS, ignore_eos=True))
        solo[i] = run_to_completion(engine_f32)[f"solo{i}"].outputs[0].token_ids
    return solo


def run_staggered(engine):
    """Prompts join the running batch at different steps."""
    pending = list(enumerate(PROMPTS))
    done = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        # two new arrivals every third step
        if step % 3 == 0:
            for _ in range(2):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(f"r{i}", p, greedy(MAX_TOKENS, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out.outputs[0].token_ids
        step += 1
    return done


def test_staggered_arrivals_match_solo(engine_f32, solo_outputs):
    assert run_staggered(engine_f32) == solo_outputs
    engine_f32.kv.check_integrity()
    assert engine_f32.kv.num_free_blocks == engine_f32.kv.num_blocks


def test_chunked_prefill_matches_solo(make_engine, solo_outputs):
    engine = make_engine(max_num_batched_tokens=7)  # every prompt is split into chunks
    stats_before = len(engine.step_stats)
    assert run_staggered(engine) == solo_outputs
    stats = list(engine.step_stats)[stats_before:]
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in stats) <= 7
    # decodes kept running while prompts were being prefilled
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_long_prefill_token_threshold_caps_each_prompts_chunk(make_engine, solo_outputs):
    """vLLM's long_prefill_token_threshold: each prompt gets at most that many tokens of a step, so two prompts
    arriving together are both computed in the first steps (without it the first takes the whole budget), and the
    tokens are those of each prompt alone."""
    engine = make_engine(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    stats_before = len(engine.step_stats)
    assert run_staggered(engine) == solo_outputs
    stats = list(engine.step_stats)[stats_before:]
    assert stats[0].num_prefill_seqs == 2 and stats[0].num_prefill_tokens == 8  # 4 + 4, not 16 for the first
    assert all(s.num_prefill_tokens <= 4 * s.num_prefill_seqs for s in stats)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for cap, seqs in ((0, 1), (4, 2)):  # two 40-token prompts: without a cap the first takes the whole step
        other = make_engine(max_num_batched_tokens=16, long_prefill_token_threshold=cap)
        other.add_request("a", list(range(100, 140)), greedy(1))
        other.add_request("b", list(range(200, 240)), greedy(1))
        other.step()
        assert other.step_stats[-1].num_prefill_seqs == seqs
        for rid in ("a", "b"):
            other.abort_request(rid)


def test_preemption_matches_solo(make_engine, solo_outputs):
    engine = make_engine(num_kv_blocks=8, block_size=4)  # 32 token slots: far less than 16 requests need
    assert run_staggered(engine) == solo_outputs
    assert engine.scheduler.num_preemptions > 0
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_priority_preemption_picks_lowest_priority(make_engine):
    engine = make_engine(num_kv_blocks=8, block_size=4, scheduling_policy="priority")
    engine.add_request("low", "Tell me a long story about dragons", greedy(20, ignore_eos=True), priority=5)
    engine.step()
    engine.add_request("high", "Tell me a long story about knights", greedy(20, ignore_eos=True), priority=0)
    preempted = []
    while engine.has_unfinished_requests():
        sched_preemptions = engine.scheduler.num_preemptions
        engine.step()
        if engine.scheduler.num_preemptions > sched_preemptions:
            preempted.append([r.request_id for r in engine.scheduler.waiting])
    assert preempted and all("low" in ids and "high" not in ids for ids in preempted)
