"""Speculative decoding: same greedy tokens on and off, the target's distribution when sampling, KV rollback,
stops inside accepted runs, rationing, metrics, bad input."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
import torch

from llmserve.cli import main
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import SamplingParams
from llmserve.spec.ngram import NgramProposer
from llmserve.spec.suffix import SuffixProposer
from tests.helpers import chi_square_pvalue, greedy, run_to_completion, save_tiny_llama
from tests.server_fixtures import RunningServer

transformers = pytest.importorskip("transformers")
ALPHA = 1e-3


def save_tiny(path, vocab: int, seed: int, layers: int = 2, head_scale: float = 1.0) -> str:
    return save_tiny_llama(path, vocab, seed, layers=layers, head_scale=head_scale)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("spec_target"), 64, seed=3)


@pytest.fixture(scope="module")
def tiny_wrong_drafter(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("spec_wrong"), 64, seed=99, layers=1)


def tiny_engine(model, **kw) -> LLMEngine:
    cfg = dict(model=model, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=20, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), skip_tokenizer=True)


REPETITIVE = [[5, 6, 7, 8, 9] * 4 + [5, 6], [10, 11, 12, 10, 11, 12, 10, 11, 12, 10], list(range(20, 40)) + list(range(20, 30)),
              [3, 4, 3, 4, 3, 4, 3]]


def run_all(engine, prompts, max_tokens=24, **kw):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(max_tokens, ignore_eos=True, **kw))
    outs = run_to_completion(engine)
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]


# ---- proposers --------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_last_match():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 9, 9, 1, 2, 3], 3) == [4, 9, 9]
    assert p.propose([1, 2, 3, 4, 5, 2, 3], 2) == [4, 5]
    assert p.propose([1, 2, 3, 4], 3) == []  # the last 2 tokens never occurred before
    assert p.propose([7, 8, 1, 7, 8, 2, 7, 8], 1) == [2]  # the most recent occurrence wins


def test_suffix_proposes_frequent_continuations_across_requests():
    s = SuffixProposer(depth=4)
    s.propose([1, 2, 3], 2, "a")
    s.release("a", [40, 41, 42, 43, 40, 41, 42, 43])
    assert s.propose([9, 9, 40, 41], 3, "b") == [42, 43, 40]  # learnt from request a's output
    assert s.propose([5, 6, 7, 5, 6], 2, "c") == [7, 5]  # from this request's own history


# ---- greedy: token for token ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft-same", "draft-wrong"])
def test_greedy_identical_with_and_without_speculation(tiny, tiny_wrong_drafter, method):
    kw = dict(speculative_method=method.split("-")[0], num_speculative_tokens=5, spec_max_tokens_per_step=200)
    if method == "draft-same":
        kw["draft_model"] = tiny
    elif method == "draft-wrong":
        kw["draft_model"] = tiny_wrong_drafter
    # a small pool and token budget: chunked prefill and preemption happen in both runs
    small = dict(num_kv_blocks=16, max_num_batched_tokens=12)
    off = run_all(tiny_engine(tiny, **small), REPETITIVE)
    engine = tiny_engine(tiny, **small, **kw)
    on = run_all(engine, REPETITIVE)
    assert on == off
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if method == "draft-same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the target drafting for itself
    assert engine.scheduler.num_preemptions > 0


def test_greedy_identical_on_the_default_model(make_engine, default_files):
    tok = default_files.tokenizer
    text = "def area(radius):\n    return 3.14159 * radius * radius\n\nprint(area(2))\n"
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "Copy this code exactly:\n" + text}]),
                          add_special_tokens=False),
               tok.encode("one two three four five six seven eight nine ten, one two three four five six")]
    off = run_all(make_engine(), prompts, max_tokens=40)
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=6)
    on = run_all(engine, prompts, max_tokens=40)
    assert on == off
    assert engine.speculator.stats.num_accepted_tokens > 10


# ---- sampling: the target's distribution, exactly --------------------------------------------------------
def exact_distribution(model_dir, prompt, steps, temperature, top_k, presence):
    """Probability of every continuation of `steps` tokens, by enumeration, with the sampler's rules."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    V = model.config.vocab_size
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=steps - 1):
            ids = torch.tensor([prompt + list(seq)])
            logits = model(ids).logits[0, -steps:].double()
            p_prefix = 1.0
            for j in range(steps - 1):
                p_prefix *= float(dist(logits[j], seq[:j], temperature, top_k, presence)[seq[j]])
            last = dist(logits[steps - 1], seq, temperature, top_k, presence)
            for t in range(V):
                probs[tuple(seq) + (t,)] = p_prefix * float(last[t])
    return probs


def dist(logits, previous, temperature, top_k, presence):
    logits = logits.clone()
    for t in set(previous):
        logits[t] -= presence
    logits = logits / temperature
    kth = logits.topk(top_k).values[-1]
    logits[logits < kth] = float("-inf")
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("method", ["ngram", "draft-wrong", "draft-same"])
def test_sampled_sequences_follow_the_target_distribution(tmp_path_factory, method):
    target = save_tiny(tmp_path_factory.mktemp("spec_small_vocab"), 8, seed=5)
    wrong = save_tiny(tmp_path_factory.mktemp("spec_small_vocab_wrong"), 8, seed=6, layers=1, head_scale=30.0)
    prompt, steps = list(range(8)) * 2, 3  # every token occurs in the prompt: n-gram lookup (n = 1) always proposes
    temperature, top_k, presence = 0.9, 6, 0.4
    kw = dict(speculative_method=method.split("-")[0], num_speculative_tokens=2, spec_max_tokens_per_step=100_000, ngram_min=1)
    if method != "ngram":
        kw["draft_model"] = wrong if method == "draft-wrong" else target
    engine = tiny_engine(target, num_kv_blocks=2048, max_num_seqs=256, max_num_batched_tokens=4096, seed=11, **kw)
    n = 6000
    params = SamplingParams(temperature=temperature, top_k=top_k, presence_penalty=presence, max_tokens=steps, ignore_eos=True)
    for i in range(n):
        engine.add_request(str(i), prompt, params)
    outs = run_to_completion(engine)
    assert engine.speculator.stats.num_draft_tokens > n // 2  # speculation really ran
    exact = exact_distribution(target, prompt, steps, temperature, top_k, presence)
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys), dtype=torch.float64)
    for o in outs.values():
        counts[index[tuple(o.outputs[0].token_ids)]] += 1
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    # pool the rare sequences so that every bin expects at least 5
    rare = probs * n < 5
    counts = torch.cat([counts[~rare], counts[rare].sum().unsqueeze(0)])
    probs = torch.cat([probs[~rare], probs[rare].sum().unsqueeze(0)])
    assert chi_square_pvalue(counts, probs / probs.sum()) > ALPHA


# ---- KV rollback --------------------------------------------------------------------------------------------
def test_rejected_drafts_leave_blocks_and_kv_as_without_speculation(tiny, tiny_wrong_drafter):
    def run(**kw):
        engine = tiny_engine(tiny, num_kv_blocks=64, max_num_batched_tokens=64, **kw)
        engine.add_request("r", REPETITIVE[0], greedy(40, ignore_eos=True))
        while engine.scheduler.requests["r"].num_output_tokens < 25:
            engine.step()
        return engine, engine.scheduler.requests["r"]

    off_engine, off_req = run()
    on_engine, on_req = run(speculative_method="draft", draft_model=tiny_wrong_drafter, num_speculative_tokens=4,
                            spec_max_tokens_per_step=100)
    stats = on_engine.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # drafts were rejected and rolled back
    for engine, req in ((on_engine, on_req), (off_engine, off_req)):
        table = engine.kv.block_tables["r"]
        assert len(table) == engine.kv.blocks_needed(req.num_computed_tokens)
        engine.kv.check_integrity()
    n = min(on_req.num_computed_tokens, off_req.num_computed_tokens)
    assert on_req.all_token_ids[:n] == off_req.all_token_ids[:n]
    bs = 4
    for p in range(n):  # each computed position's K and V in every layer, read through the executor
        kv_on = on_engine.executor.read_block(on_engine.kv.block_tables["r"][p // bs])[:, :, p % bs]
        kv_off = off_engine.executor.read_block(off_engine.kv.block_tables["r"][p // bs])[:, :, p % bs]
        torch.testing.assert_close(kv_on, kv_off, atol=1e-5, rtol=1e-5)


# ---- stops inside an accepted run ----------------------------------------------------------------------------
def test_stop_string_and_max_tokens_inside_accepted_runs(make_engine, default_files):
    tok = default_files.tokenizer
    prompt = tok.encode("alpha beta gamma delta epsilon zeta eta theta, alpha beta gamma delta epsilon zeta eta theta, alpha beta")
    cases = [SamplingParams(temperature=0, max_tokens=30, stop=["zeta"]),
             SamplingParams(temperature=0, max_tokens=7, logprobs=2),
             SamplingParams(temperature=0, max_tokens=30, stop=[" eta"], include_stop_str_in_output=True)]

    def run(engine):
        for i, p in enumerate(cases):
            engine.add_request(str(i), prompt, p)
        return run_to_completion(engine)

    off = run(make_engine())
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=8)
    on = run(engine)
    assert engine.speculator.stats.num_accepted_tokens > 0
    for i in range(len(cases)):
        a, b = on[str(i)].outputs[0], off[str(i)].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason, b.stop_reason)
    assert len(on["1"].outputs[0].token_ids) == 7 and len(on["1"].outputs[0].logprobs) == 7
    for x, y in zip(on["1"].outputs[0].logprobs, off["1"].outputs[0].logprobs):
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)


# ---- rationing ------------------------------------------------------------------------------------------------
def test_busy_batches_get_no_drafts(tiny):
    engine = tiny_engine(tiny, speculative_method="ngram", num_speculative_tokens=4, spec_max_tokens_per_step=8, max_num_seqs=8,
                         max_num_batched_tokens=200)
    prompts = [REPETITIVE[i % 4] for i in range(8)]
    run_all(engine, prompts, max_tokens=16)
    busy = engine.speculator.stats.num_draft_tokens
    assert busy == 0  # eight decoding sequences already fill the 8-token step
    engine = tiny_engine(tiny, speculative_method="ngram", num_speculative_tokens=4, spec_max_tokens_per_step=8)
    run_all(engine, prompts[:1], max_tokens=16)
    assert engine.speculator.stats.num_draft_tokens > 0


def test_acceptance_drives_each_requests_draft_count(tiny):
    engine = tiny_engine(tiny, speculative_method="ngram", num_speculative_tokens=6)
    spec = engine.speculator
    good, bad = type("R", (), {})(), type("R", (), {})()
    for r, a, rid in ((good, 0.95, "g"), (bad, 0.3, "b")):
        r.spec_acceptance, r.request_id, r.num_output_tokens, r.num_tokens = a, rid, 0, 10
        r.params = SamplingParams(max_tokens=100)
    ks = spec.plan([good, bad], 512)
    assert ks["g"] == 6 and ks.get("b", 0) == 2  # 0.3 ** 3 < 0.05: a third draft is not worth a slot


# ---- visible in /metrics and llmserve bench ------------------------------------------------------------------
def test_server_metrics_and_bench_report_acceptance(default_files, tmp_path):
    server = RunningServer(default_files, {"speculative_method": "ngram", "num_speculative_tokens": 5}, {})
    try:
        data = tmp_path / "rep.jsonl"
        line = "count: one two three four five six seven eight, one two three four five six seven eight, one two"
        data.write_text("\n".join(json.dumps({"prompt": line, "max_tokens": 24}) for _ in range(3)) + "\n")
        out = tmp_path / "r.json"
        assert main(["bench", "--quiet", "--no-plots", "--base-url", server.base_url + "/v1", "--dataset", str(data),
                     "--concurrency", "1", "--warmup", "0", "--result", str(out)]) == 0
        s = json.loads(out.read_text())["levels"][0]["summary"]
        assert s["spec_draft_tokens"] > 0 and 0 < s["spec_acceptance_rate"] <= 1
        assert s["spec_mean_accepted_length"] > 1
        metrics = httpx.get(server.base_url + "/metrics").text
        assert "llmserve:spec_decode_num_accepted_tokens_per_pos_total" in metrics
        server.wait_idle()
    finally:
        server.stop()


# ---- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be between 1 and 16, got 0"),
    (dict(speculative_method="ngram", num_speculative_tokens=17), "num_speculative_tokens must be between 1 and 16, got 17"),
    (dict(speculative_method="draft"), "needs a draft model"),
    (dict(speculative_method="medusa"), "speculative_method must be one of ngram, suffix, draft"),
    (dict(draft_model="x.gguf"), "speculation is off"),
])
def test_bad_speculative_settings(kw, message):
    with pytest.raises(Exception, match=message):
        EngineConfig(**kw)


def test_draft_with_another_tokenizer_is_refused(tmp_path, default_gguf):
    from tokenizers import Tokenizer, models

    folder = save_tiny(tmp_path / "other", 49152, seed=1, layers=1)
    vocab = {f"tok{i}": i for i in range(49152)}
    Tokenizer(models.WordLevel(vocab, unk_token="tok0")).save(str(tmp_path / "other" / "tokenizer.json"))
    with pytest.raises(Exception, match="has a different tokenizer"):
        LLMEngine(EngineConfig(model=default_gguf, speculative_method="draft", draft_model=folder, kv_cache_memory="64MiB"))


def test_cli_bad_speculation_one_line(capsys):
    assert main(["generate", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: num_speculative_tokens must be between 1 and 16, got 0"]


def test_vllm_style_speculative_config(default_gguf):
    from llmserve import LLM

    llm = LLM(default_gguf, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
              dtype="float32", kv_cache_memory="64MiB")
    assert (llm.engine.config.speculative_method, llm.engine.config.num_speculative_tokens, llm.engine.config.ngram_max) == ("ngram", 3, 4)
    out = llm.generate("one two three one two three one two", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(Exception, match="unknown speculative_config keys: bogus"):
        LLM(default_gguf, speculative_config={"bogus": 1})
