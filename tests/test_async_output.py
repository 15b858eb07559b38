"""Async output processing (engine `async_output_proc`, on by default on CUDA): a step's tokens are detokenized and
turned into outputs while the next step computes. Users see the same outputs as with it off, streamed in the same
pieces; stop strings still cut the text where they appear; aborts and timeouts still free every KV block.

On CPU it is off by default (the step's arithmetic runs in the engine's own call, so nothing overlaps); these tests
turn it on, on the default model, and compare with it off."""

from __future__ import annotations

import pytest

from llmserve.engine.request import RequestStatus
from llmserve.sampling_params import SamplingParams
from tests.helpers import run_streams, run_to_completion

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time"]


def requests():
    """(prompt, params): greedy and seeded sampling, with stop strings, stop ids, logprobs, n=2, min_tokens."""
    return [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[".", "\n"], logprobs=2)),
        (PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, n=2)),
        (PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, stop=["return"], include_stop_str_in_output=True)),
        (PROMPTS[3], SamplingParams(temperature=1.0, seed=3, max_tokens=16, min_tokens=8, stop_token_ids=[13])),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=5)),
    ]


def run(engine):
    """Every request's final output and the text its stream delivered."""
    return run_streams(engine, requests())


def summary(out):
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob) for c in out.outputs]


@pytest.fixture(scope="module")
def engines(make_engine):
    return make_engine(async_output_proc=False), make_engine(async_output_proc=True)


def test_async_output_processing_gives_the_same_outputs_and_streams(engines):
    sync, overlapped = engines
    assert not sync.async_output_proc and overlapped.async_output_proc
    want, want_streams = run(sync)
    got, got_streams = run(overlapped)
    assert [summary(o) for o in got] == [summary(o) for o in want]
    assert got_streams == want_streams
    for out, streams in zip(got, got_streams):
        assert [c.text for c in out.outputs] == streams  # the deltas add up to the text
    assert any(c.stop_reason == "." or c.stop_reason == "\n" for c in got[0].outputs)  # a stop string did end one


def test_outputs_lag_one_step_and_the_last_comes_after_the_queue_is_empty(engines):
    _, engine = engines
    rid = engine.add_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    first = engine.step()  # the prompt's step: its token's output waits for the next step
    assert first == []
    seen = [out for _ in range(3) for out in engine.step()]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3] and seen[-1].finished
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks
    assert seen[-1].request_id == rid


def test_an_abort_between_steps_gives_the_text_of_every_token_and_frees_the_blocks(engines):
    _, engine = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    victim = engine.add_request(None, PROMPTS[1], params)
    other = engine.add_request(None, PROMPTS[2], params)
    for _ in range(6):
        engine.step()
    final = engine.abort_request(victim)
    assert final.finished and final.outputs[0].finish_reason == RequestStatus.FINISHED_ABORTED.value
    assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids)
    rest = run_to_completion(engine)
    assert len(rest[other].outputs[0].token_ids) == 40 and victim not in rest
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_speculative_decoding_with_async_output_processing(make_engine, engines):
    sync, _ = engines
    spec = make_engine(async_output_proc=True, speculative_method="ngram", num_speculative_tokens=3)
    want, _ = run(sync)
    got, _ = run(spec)
    greedy = [0, 2, 4]  # speculation keeps greedy outputs exactly; sampled ones only in distribution
    assert [summary(got[i]) for i in greedy] == [summary(want[i]) for i in greedy]


def test_the_cli_flags_set_it():
    from llmserve.cli import build_parser
    from llmserve.engine_args import engine_config_from_args

    parser = build_parser()
    for flags, want in (([], None), (["--async-output-proc"], True), (["--no-async-output-proc"], False),
                        (["--disable-async-output-proc"], False)):
        args = parser.parse_args(["generate", "hi", *flags])
        assert engine_config_from_args(args).async_output_proc is want
