"""The loop that drives an engine for the server (server/engine_loop.py), with a real engine on the default model:
grammars that arrive uncompiled (as they do from a server in another process) are compiled off the loop, so that
other requests keep stepping; an abort meanwhile, and a grammar that fails there, leave nothing behind."""

from __future__ import annotations

import re
import threading
import time

from llmserve.errors import LLMServeError
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.engine_loop import AbortRequest, AddRequest, EngineLoop, StopLoop

PHONE = r"\(\d{3}\) \d{3}-\d{4}"


class Collected:
    """An EngineSink that keeps what the loop gives it, with the step each output came in."""

    def __init__(self):
        self.steps: list[list] = []
        self.errors: dict[str, LLMServeError] = {}
        self.dropped: list[str] = []
        self.failed: str | None = None
        self.done = threading.Event()
        self.wanted: set[str] = set()

    def on_outputs(self, outputs):
        self.steps.append(outputs)
        for out in outputs:
            if out.finished:
                self.wanted.discard(out.request_id)
        if not self.wanted:
            self.done.set()

    def on_stats(self, stats):
        pass

    def on_request_error(self, request_id, error):
        self.errors[request_id] = error
        self.wanted.discard(request_id)
        if not self.wanted:
            self.done.set()

    def on_request_dropped(self, request_id):
        self.dropped.append(request_id)
        self.wanted.discard(request_id)
        if not self.wanted:
            self.done.set()

    def on_engine_failed(self, reason):
        self.failed = reason
        self.done.set()

    def first_step(self, request_id: str) -> int:
        return next(i for i, outs in enumerate(self.steps) if any(o.request_id == request_id for o in outs))

    def final(self, request_id: str):
        return next(o for outs in self.steps for o in outs if o.request_id == request_id and o.finished)


def run_loop(engine, commands: list, wanted: set[str]) -> Collected:
    """Posts the commands before the loop starts (so that it drains them together), runs it until every wanted
    request has finished, failed or been dropped, then stops it."""
    sink = Collected()
    sink.wanted = set(wanted)
    loop = EngineLoop(engine, sink)
    for cmd in commands:
        loop.post(cmd)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    finished = sink.done.wait(timeout=120)
    loop.post(StopLoop())
    thread.join(timeout=60)
    assert finished and not thread.is_alive() and sink.failed is None, sink.failed
    return sink


def uncompiled(**kw) -> StructuredOutputsParams:
    spec = StructuredOutputsParams(**kw)
    assert spec.compiled is None  # as a server in another process sends it
    return spec


def assert_idle(engine):
    deadline = time.time() + 10
    while engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks


def test_steps_do_not_wait_for_a_grammar(make_engine):
    """A fresh engine has not yet indexed its tokenizer for grammars (~0.5 s). A plain request sent after a
    structured one gets its first token before the structured one joins the batch, and both finish correctly."""
    engine = make_engine()
    grammar = SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured_outputs=uncompiled(regex=PHONE))
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = engine.tokenizer.encode("Phone number?")
    sink = run_loop(engine, [AddRequest("g", prompt, grammar), AddRequest("p", prompt, plain)], {"g", "p"})
    assert sink.first_step("p") < sink.first_step("g")
    assert re.fullmatch(PHONE, sink.final("g").outputs[0].text)
    assert len(sink.final("p").outputs[0].token_ids) == 6
    assert_idle(engine)


def test_an_abort_while_compiling_drops_the_request(make_engine):
    """The request never runs, and the sink hears once that nothing will come for it (the server's process then
    forgets what it kept for the request)."""
    engine = make_engine()
    spec = uncompiled(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    prompt = engine.tokenizer.encode("JSON:")
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    sink = run_loop(engine, [AddRequest("g", prompt, SamplingParams(max_tokens=30, structured_outputs=spec)),
                             AbortRequest("g"), AddRequest("p", prompt, plain)], {"g", "p"})
    assert not any(o.request_id == "g" for outs in sink.steps for o in outs) and "g" not in sink.errors
    assert sink.dropped == ["g"]
    assert_idle(engine)


def test_a_grammar_refused_in_the_loop_fails_only_its_request(make_engine):
    """A bad grammar that reaches the loop (the server normally refuses it first) is its request's 400, naming the
    parameter; the request beside it finishes."""
    engine = make_engine()
    prompt = engine.tokenizer.encode("Hello")
    bad = SamplingParams(max_tokens=5, structured_outputs=uncompiled(json='{"type": "object"'))
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    sink = run_loop(engine, [AddRequest("bad", prompt, bad), AddRequest("p", prompt, plain)], {"bad", "p"})
    error = sink.errors["bad"]
    assert error.status_code == 400 and error.param == "structured_outputs"
    assert "not valid JSON" in error.message
    assert sink.final("p").finished
    assert_idle(engine)


def test_a_deadline_passed_while_compiling_times_out_once_added(make_engine):
    """The deadline counts from when the server sent the request: one that passed during the compile ends the request
    at once, as a timeout with what it has (nothing)."""
    engine = make_engine()
    prompt = engine.tokenizer.encode("Phone number?")
    params = SamplingParams(max_tokens=50, structured_outputs=uncompiled(regex=PHONE))
    sink = run_loop(engine, [AddRequest("g", prompt, params, deadline=time.monotonic())], {"g"})
    out = sink.final("g")
    assert out.outputs[0].finish_reason == "timeout" and out.outputs[0].token_ids == []
    assert_idle(engine)
