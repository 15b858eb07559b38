"""Beam search (vLLM's LLM.beam_search, and use_beam_search on the text APIs): the beams transformers' beam search
finds, with their cumulative logprobs; beams ending at EOS; ranking by length_penalty; the same beams whatever else
shares the steps; through the server and the openai client, streamed or not; the errors; no KV block left behind."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from llmserve import LLM, BeamSearchParams
from llmserve.errors import InvalidRequestError
from tests.server_fixtures import RunningServer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(default_gguf):
    llm = LLM(default_gguf, dtype="float32")
    yield llm
    llm.engine.shutdown()


def score(seq, prompt_len: int, eos: set[int], length_penalty: float) -> float:
    """vLLM's ranking: cumulative logprob over the length (prompt included, a final EOS not) ** length_penalty."""
    length = len(seq.tokens) - (seq.tokens[-1] in eos)
    return seq.cum_logprob / length ** length_penalty


def test_beams_match_transformers_beam_search(llm, hf_gguf_model, hf_gguf_tokenizer):
    """Without EOS (ignore_eos) every beam has the same length, so the search is transformers' num_beams search:
    the same sequences, best first, and its scores (length_penalty 0: the cumulative logprobs)."""
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_gguf_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_gguf_model.generate(ids, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=6,
                                         length_penalty=0.0, eos_token_id=None, pad_token_id=0,
                                         output_scores=True, return_dict_in_generate=True, early_stopping=True)
        assert [s.tokens[ids.shape[1]:] for s in out.sequences] == [r[ids.shape[1]:].tolist() for r in ref.sequences]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
        for s in out.sequences:
            assert s.text == hf_gguf_tokenizer.decode(s.tokens[ids.shape[1]:], skip_special_tokens=True)
            assert s.finish_reason == "length" and len(s.logprobs) == 6
            assert sum(lp[t] for t, lp in zip(s.tokens[ids.shape[1]:], s.logprobs)) == pytest.approx(s.cum_logprob)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_eos_ends_a_beam_and_answers_are_ranked_by_length_penalty(llm, length_penalty):
    """A beam that draws EOS is set aside as finished ("stop"); the answer is the best beam_width of the finished and
    the live ones by vLLM's score, best first."""
    eos = set(llm.engine.eos_token_ids)
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=length_penalty))[0]
    plen = len(llm.get_tokenizer().encode(PROMPTS[0]))
    assert len(out.sequences) == 4
    scores = [score(s, plen, eos, length_penalty) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    reasons = {s.finish_reason for s in out.sequences}
    # " Paris." then EOS is among the best while length counts little; a penalty of 2 favours the long beams
    assert ("stop" in reasons) == (length_penalty <= 1.0)
    for s in out.sequences:
        generated = s.tokens[plen:]
        if s.finish_reason == "stop":
            assert generated[-1] in eos and s.stop_reason == generated[-1] and not eos & set(generated[:-1])
        else:
            assert len(generated) == 12 and not eos & set(generated)


def test_beams_do_not_depend_on_what_shares_the_steps(llm):
    """Searched together (their beams in one engine batch per step) or one by one: the same beams and logprobs."""
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    together = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.beam_search(prompt, params)[0]
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in out.sequences]
        assert [s.cum_logprob for s in alone.sequences] == pytest.approx([s.cum_logprob for s in out.sequences],
                                                                         abs=1e-5)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_beam_search_errors(llm):
    with pytest.raises(InvalidRequestError, match="beam_width must be an integer of at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="width of at most 10"):
        llm.beam_search("hi", BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="leaves no room for the completion"):
        llm.beam_search([[1] * llm.engine.max_model_len], BeamSearchParams(beam_width=2, max_tokens=4))


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {})
    yield s
    s.stop()


def test_use_beam_search_through_the_openai_client(server, llm):
    """vLLM's use_beam_search: n beams as n choices, best first, the offline search's texts; streamed, the same
    texts; chat too; usage counts every beam's tokens; afterwards no request runs and no KV block is held."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    ref = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=8))
    r = client.completions.create(model="test-model", prompt=PROMPTS[:2], max_tokens=8, n=3, logprobs=2,
                                  extra_body={"use_beam_search": True})
    assert [c.text for c in r.choices] == [s.text for out in ref for s in out.sequences]
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for out in ref for s in out.sequences]
    assert r.usage.completion_tokens == sum(len(s.logprobs) for out in ref for s in out.sequences)  # one per token
    best = r.choices[0].logprobs
    assert all(len(top) <= 3 for top in best.top_logprobs)  # its own token and the top 2
    assert sum(best.token_logprobs) == pytest.approx(ref[0].sequences[0].cum_logprob, abs=1e-4)
    stream = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=8, n=3, stream=True,
                                       extra_body={"use_beam_search": True})
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [s.text for s in ref[0].sequences]
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model="test-model", messages=messages, max_tokens=6, n=2,
                                          extra_body={"use_beam_search": True, "length_penalty": 0.5})
    ids = llm.get_tokenizer().encode(llm.get_tokenizer().apply_chat_template(messages), add_special_tokens=False)
    ref_chat = llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5))[0]
    assert [c.message.content for c in chat.choices] == [s.text for s in ref_chat.sequences]
    server.wait_idle()


@pytest.mark.parametrize("body, param, message", [
    ({"stop": ["."]}, "stop", "use_beam_search does not take stop"),
    ({"presence_penalty": 0.5}, "presence_penalty", "does not take presence_penalty"),
    ({"n": 11}, "n", "use a width of at most 10"),
    ({"response_format": {"type": "json_object"}}, "structured_outputs", "does not take structured_outputs"),
])
def test_use_beam_search_errors(server, body, param, message):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "n": 2,
                                                              "use_beam_search": True, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert message in r.json()["error"]["message"]


def test_a_timeout_ends_the_search_with_the_beams_it_has(server):
    """The request's timeout covers every step: when it passes, the best beams so far are the answer, their
    finish_reason "timeout"; nothing keeps running."""
    r = httpx.post(server.base_url + "/v1/completions", json={
        "prompt": "Write a long story about a dragon.", "max_tokens": 400, "n": 4, "use_beam_search": True,
        "ignore_eos": True, "timeout": 0.3}, timeout=60).json()
    assert {c["finish_reason"] for c in r["choices"]} == {"timeout"} and 1 <= len(r["choices"]) <= 4
    assert r["usage"]["completion_tokens"] < 4 * 400
    server.wait_idle()
