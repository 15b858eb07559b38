"""Sampling controls through the whole engine on the default model."""

import math

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from tests.helpers import LogitsRecorder, greedy, run_to_completion

OTHERS = ["Once upon a time", "def main():", "The weather today", "List three fruits:", "Hello", "In physics,",
          "My name is", "Numbers: 1, 2,", "SELECT * FROM", "The ocean", "Dear Sir,", "Recipe:"]


def generate(engine, prompt, params, rid="x"):
    engine.add_request(rid, prompt, params)
    return run_to_completion(engine)[rid]


def test_seeded_request_is_independent_of_batch(engine_f32):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = generate(engine_f32, "Write a poem about the sea", params).outputs[0].token_ids
    for k in (3, 12):
        for i, p in enumerate(OTHERS[:k]):
            engine_f32.add_request(f"o{k}-{i}", p, SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True))
        engine_f32.add_request("seeded", "Write a poem about the sea", params)
        assert run_to_completion(engine_f32)["seeded"].outputs[0].token_ids == alone


def test_n_samples_differ_and_share_prompt_blocks(engine_f32):
    prompt = "Tell me a story about a robot who learns to paint. " * 3  # several full KV blocks
    n = 4
    engine_f32.add_request("n", prompt, SamplingParams(n=n, temperature=1.0, max_tokens=8, ignore_eos=True, seed=7))
    prompt_len = len(engine_f32.tokenizer.encode(prompt))
    bs = engine_f32.kv.block_size
    peak = 0
    done = None
    while engine_f32.has_unfinished_requests():
        for out in engine_f32.step():
            if out.finished:
                done = out
        peak = max(peak, engine_f32.kv.num_blocks - engine_f32.kv.num_free_blocks)
    separate = n * -(-(prompt_len + 8) // bs)
    shared_full = (prompt_len - 1) // bs
    assert peak <= separate - (n - 1) * shared_full  # the prompt's full blocks are held once, not n times
    texts = [o.token_ids for o in done.outputs]
    assert len(done.outputs) == n and len({tuple(t) for t in texts}) == n
    assert engine_f32.kv.num_free_blocks == engine_f32.kv.num_blocks


def test_n_greedy_samples_are_identical(engine_f32):
    out = generate(engine_f32, "The capital of Italy is", greedy(8, n=3))
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1
    single = generate(engine_f32, "The capital of Italy is", greedy(8), rid="single")
    assert out.outputs[0].token_ids == single.outputs[0].token_ids


def test_stop_strings_across_tokens_are_trimmed(engine_f32):
    base = generate(engine_f32, "The capital of France is", greedy(12)).outputs[0].text
    stop = base[3:9]  # a stop string that likely spans token boundaries
    out = generate(engine_f32, "The capital of France is", greedy(12, stop=[stop]), rid="s").outputs[0]
    assert out.text == base[: base.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    out = generate(engine_f32, "The capital of France is", greedy(12, stop=[stop], include_stop_str_in_output=True), rid="t").outputs[0]
    assert out.text == base[: base.index(stop) + len(stop)]


def test_streamed_deltas_add_up_and_hold_back_partial_stops(engine_f32):
    params = greedy(20, stop=["zzzz-never"])
    engine_f32.add_request("d", "Count: one, two, three,", params)
    deltas, final = [], None
    while engine_f32.has_unfinished_requests():
        for out in engine_f32.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 20


def test_stop_token_ids_and_min_tokens(engine_f32):
    base = generate(engine_f32, "The capital of France is", greedy(10, ignore_eos=True)).outputs[0].token_ids
    out = generate(engine_f32, "The capital of France is", greedy(10, stop_token_ids=[base[2]]), rid="a").outputs[0]
    assert out.token_ids == base[:3] and out.stop_reason == base[2] and out.finish_reason == "stop"
    # as in vLLM, the stop token's text is not part of the output unless include_stop_str_in_output
    tok = engine_f32.tokenizer
    assert out.text == tok.decode(base[:2]) != tok.decode(base[:3])
    kept = generate(engine_f32, "The capital of France is", greedy(10, stop_token_ids=[base[2]], include_stop_str_in_output=True),
                    rid="k").outputs[0]
    assert kept.text == tok.decode(base[:3])
    eos = engine_f32.eos_token_ids[0]
    out = generate(engine_f32, "Hi", greedy(10, logit_bias={eos: 100}, min_tokens=4), rid="b").outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    # keeping special tokens in the text keeps those the model wrote, not the EOS that ended it
    special = generate(engine_f32, "Hi", greedy(10, logit_bias={eos: 100}, min_tokens=4, skip_special_tokens=False),
                       rid="s").outputs[0]
    assert special.token_ids == out.token_ids and special.text == out.text == tok.decode(out.token_ids[:4])
    assert tok.decode([eos], skip_special_tokens=False) not in special.text


def test_sampled_logprobs_match_logits(engine_f32):
    params = SamplingParams(temperature=0.8, max_tokens=6, logprobs=3, seed=5, ignore_eos=True)
    with LogitsRecorder(engine_f32) as rec:
        out = generate(engine_f32, "The best thing about Mondays is", params, rid="lp").outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for step, (tok, lp, logits) in enumerate(zip(out.token_ids, out.logprobs, rec.logits["lp"])):
        ref = torch.log_softmax(logits.float() / 0.8, -1)
        assert lp[tok] == pytest.approx(float(ref[tok]), abs=1e-4)
        assert sum(math.exp(v) for v in lp.values()) <= 1 + 1e-6
        total += lp[tok]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_match_transformers(make_engine, hf_gguf_model):
    engine = make_engine(max_num_batched_tokens=5)  # the prompt is scored across chunks
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    out = generate(engine, prompt, greedy(1, prompt_logprobs=2), rid="pl")
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf_gguf_model(torch.tensor([prompt])).logits[0].float(), -1)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry[prompt[p]] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=2e-3)
        assert len(entry) in (2, 3)
