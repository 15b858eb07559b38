"""SamplingParams.output_kind, as vLLM's RequestOutputKind: CUMULATIVE (the default: every step, the whole output so
far plus what is new), DELTA (every step, only what is new) and FINAL_ONLY (one output, when the request has
finished; what LLM.generate asks for, so the engine builds no output per step). Whatever the kind, a request's
tokens, text, logprobs and finish reason are the same."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve import LLM, RequestOutputKind, SamplingParams
from llmserve.errors import InvalidRequestError

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):"]


def requests(kind: RequestOutputKind):
    """(prompt, params): greedy with a stop string and logprobs, seeded sampling with n=2, a short greedy one."""
    return [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[".", "\n"], logprobs=2, output_kind=kind)),
        (PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, n=2, output_kind=kind)),
        (PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, stop=["return"], include_stop_str_in_output=True,
                                    output_kind=kind)),
    ]


def run(engine, kind: RequestOutputKind) -> tuple[list[str], dict[str, list]]:
    """The request ids, and every output the engine gave for each, in order."""
    ids = [engine.add_request(None, p, params) for p, params in requests(kind)]
    seen: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return ids, seen


def final(out):
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
            for c in out.outputs]


@pytest.fixture(scope="module")
def cumulative(make_engine):
    engine = make_engine()
    ids, seen = run(engine, RequestOutputKind.CUMULATIVE)
    return engine, [seen[i] for i in ids]


def test_final_only_gives_one_output_per_request_equal_to_the_cumulative_final(cumulative):
    engine, want = cumulative
    ids, seen = run(engine, RequestOutputKind.FINAL_ONLY)
    for rid, outs in zip(ids, want):
        got = seen[rid]
        assert len(got) == 1 and got[0].finished  # nothing while it ran, n=2 included
        assert final(got[0]) == final(outs[-1])
        for c in got[0].outputs:  # the one output is all new
            assert c.delta_text == c.text and c.delta_token_ids == c.token_ids
    assert len(want[0]) > 1  # the cumulative run did give outputs per step


def test_delta_outputs_add_up_to_the_cumulative_final(cumulative):
    engine, want = cumulative
    ids, seen = run(engine, RequestOutputKind.DELTA)
    for rid, outs in zip(ids, want):
        got = seen[rid]
        assert got[-1].finished and not any(o.finished for o in got[:-1])
        expected = {c.index: c for c in outs[-1].outputs}
        for index, c in expected.items():
            parts = [o.outputs[index] for o in got]
            assert all(p.text == p.delta_text and p.token_ids == p.delta_token_ids for p in parts)
            assert "".join(p.text for p in parts) == c.text  # stop strings cut the same way
            assert [t for p in parts for t in p.token_ids] == c.token_ids
            if c.logprobs is not None:
                assert [lp for p in parts for lp in p.logprobs] == c.logprobs
                assert parts[-1].cumulative_logprob == c.cumulative_logprob
            assert parts[-1].finish_reason == c.finish_reason and parts[-1].stop_reason == c.stop_reason
        # the cumulative run's per-step deltas are the delta run's outputs
        assert [[c.delta_text for c in o.outputs] for o in outs] == [[c.text for c in o.outputs] for o in got]


def test_abort_of_a_final_only_request_returns_its_output(make_engine):
    engine = make_engine()
    rid = engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                              output_kind=RequestOutputKind.FINAL_ONLY))
    for _ in range(6):
        assert engine.step() == []  # prefill, then decode steps: nothing to say yet
    out = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) >= 4 and out.outputs[0].text
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_llm_generate_leaves_the_callers_params_alone(default_gguf, make_engine):
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(default_gguf, dtype="float32", kv_cache_memory="64MiB", device="cpu")
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    engine = make_engine()
    ids = [engine.add_request(None, p, dataclasses.replace(params)) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [o.outputs[0].token_ids for o in outs] == [done[i].outputs[0].token_ids for i in ids]
    assert [o.outputs[0].text for o in outs] == [done[i].outputs[0].text for i in ids]


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(InvalidRequestError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_cumulative_outputs_are_snapshots(make_engine):
    """An output keeps what it held when it was given, while the request goes on (its token ids and logprobs are
    views of the request's growing lists, taken in O(1)), and reads like a list."""
    import pickle

    engine = make_engine()
    engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen.append((c, list(c.token_ids), list(c.logprobs)))
    assert [len(held) for _, held, _ in seen] == list(range(1, 13))
    for c, ids, lps in seen:  # unchanged by the steps after it
        assert c.token_ids == ids and list(c.token_ids) == ids and len(c.token_ids) == len(ids)
        assert c.logprobs == lps and c.token_ids[-1] == ids[-1] and c.token_ids[1:] == ids[1:]
        assert c.token_ids + [7] == ids + [7] and pickle.loads(pickle.dumps(c.token_ids)) == ids
    with pytest.raises(IndexError):
        seen[0][0].token_ids[1]
