"""vLLM's arguments, as users copy them from vLLM's docs: `LLM(...)` keywords, `LLM.chat(chat_template=..., tools=...)`,
and `llmserve serve MODEL` flags (--gpu-memory-utilization, --seed, --chat-template, --generation-config,
--override-generation-config, --speculative-config, --enable-prefix-caching / --no-enable-prefix-caching,
--enable-auto-tool-choice, --tokenizer, --max-logprobs, --trust-remote-code, --pipeline-parallel-size 1,
--long-prefill-token-threshold, --enable-chunked-prefill, CORS's --allowed-origins, HTTPS's --ssl-*,
--served-model-name with several names, --enable-log-requests, --uvicorn-log-level, --disable-log-stats)."""

from __future__ import annotations

import json
import math
import os
import re
import time

import httpx
import numpy as np
import openai
import pytest

import llmserve
from llmserve import LLM, SamplingParams
from llmserve.errors import InvalidRequestError
from tests.server_fixtures import ServerProcess

# A template unlike the model's: what it renders shows that it, and not the model's, made the prompt.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def prompt_text(llm: LLM, output) -> str:
    return llm.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(default_gguf, dtype="float32", kv_cache_memory="64MiB", device="cpu")


def test_unknown_keywords_are_named_with_the_nearest_one():
    with pytest.raises(TypeError, match="unexpected engine argument 'gpu_memory_utilisation' \\(did you mean "
                                        "'gpu_memory_utilization'\\?\\)"):
        LLM(gpu_memory_utilisation=0.5)
    with pytest.raises(TypeError, match="unexpected engine argument 'frobnicate'$"):
        LLM(frobnicate=True)


def test_chat_with_a_template_of_its_own_and_tools(llm, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    own = llm.chat(messages, params, chat_template=TEMPLATE)[0]
    assert prompt_text(llm, own) == "[system] Be brief.\n[user] Hi\n[assistant]"
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = llm.chat(messages, params, chat_template=str(path), tools=[tool],
                          add_generation_prompt=False)[0]
    assert prompt_text(llm, with_tools) == "[system] Be brief.\n[user] Hi\ntools: get_weather\n"
    model_own = llm.chat(messages, params)[0]  # the model's template is untouched
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt_text(llm, model_own)
    with pytest.raises(InvalidRequestError, match="neither a file nor a Jinja template"):
        llm.chat(messages, params, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidRequestError, match="chat template: .*line 1"):
        llm.chat(messages, params, chat_template="{% for m in messages %}")


def test_speculative_config_as_vllm_spells_it(default_gguf, llm):
    prompt = "one two three four, one two three four, one two three four, one two"
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    spec = LLM(default_gguf, dtype="float32", kv_cache_memory="64MiB", device="cpu",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 2})
    assert spec.engine.config.speculative_method == "ngram" and spec.engine.config.ngram_max == 3
    out = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids  # exact verification, deterministic mode: the same tokens
    with pytest.raises(InvalidRequestError, match="unknown speculative_config keys: eagle_depth \\(known: method"):
        LLM(default_gguf, speculative_config={"method": "ngram", "eagle_depth": 2})


def test_seed_makes_unseeded_sampling_repeat_across_engines(make_engine):
    """vLLM's --seed: requests without a seed of their own sample from the engine's generator, so an engine started
    with the same seed gives the same text, and another seed other text."""
    params = SamplingParams(temperature=1.0, max_tokens=16)

    def sample(seed):
        engine = make_engine(seed=seed)
        engine.add_request("r", "Once upon a time", params)
        tokens = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = out.outputs[0].token_ids
        return tokens

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


@pytest.mark.parametrize("args, message", [
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-fraction", "0.5"], "both size the KV cache; give one"),
    (["--speculative-config", "{method: ngram}"], "--speculative-config is not JSON"),
    (["--speculative-config", '{"method": "ngram"}', "--speculative-method", "ngram"], "not both"),
    (["--speculative-config", '["ngram"]'], "--speculative-config must be a JSON object"),
    (["--chat-template", "templates/none.jinja"], "is neither a file nor a Jinja template"),
    (["a.gguf"], "two models given: a.gguf and --model /nowhere/model.gguf"),
    (["--max-logprobs", "-2"], "max_logprobs must be -1 (the whole vocabulary) or at least 0"),
    (["--pipeline-parallel-size", "2"], "pipeline parallelism is not supported"),
    (["--override-generation-config", '{"temp": 0.5}'], "unknown override_generation_config keys: temp"),
    (["--override-generation-config", "0.5"], "--override-generation-config must be a JSON object"),
    (["--tokenizer", "/nowhere/tokenizer"], "tokenizer not found: /nowhere/tokenizer"),
    (["--allowed-origins", "https://app.example"], "--allowed-origins takes a JSON list of strings"),
    (["--ssl-certfile", "cert.pem"], "HTTPS needs both --ssl-certfile and --ssl-keyfile"),
    (["--ssl-certfile", "/nowhere/cert.pem", "--ssl-keyfile", "/nowhere/key.pem"],
     "cannot load the certificate /nowhere/cert.pem with the key /nowhere/key.pem"),
    (["--ssl-cert-reqs", "2"], "--ssl-ca-certs and --ssl-cert-reqs need HTTPS"),
    (["--long-prefill-token-threshold", "-1"], "long_prefill_token_threshold must not be negative"),
    (["--hf-overrides", '["architectures"]'], "--hf-overrides must be a JSON object"),
    (["--convert", "classify", "--runner", "generate"], "--convert classify makes a pooling model"),
])
def test_bad_vllm_flags_are_one_line_errors(args, message, capsys):
    """Each refused before anything loads (a flag let through would meet the missing model file instead)."""
    from llmserve.cli import main

    assert main(["serve", "--port", "0", "--model", "/nowhere/model.gguf", *args]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors


def test_a_vllm_command_line_serves(shallow_gguf, shallow_files, tmp_path):
    """`llmserve serve MODEL` with the flags of a vLLM command line: the chat template from a file makes the prompts,
    prefix caching is off (a repeated prompt finds nothing cached), ngram speculation gives the offline engine's
    greedy tokens, tools are parsed with hermes, and --gpu-memory-utilization is said to be ignored on this CPU."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(shallow_gguf, "--dtype", "float32", "--device", "cpu", "--no-webui", "--seed", "7",
                           "--chat-template", str(template), "--no-enable-prefix-caching",
                           "--gpu-memory-utilization", "0.9", "--enable-auto-tool-choice", "--tool-call-parser",
                           "hermes", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                           "--disable-log-stats", env={**os.environ, "LLMSERVE_LOG_STATS_INTERVAL": "0.2"})
    try:
        server.wait_ready()
        messages = [{"role": "user", "content": "Count: one two three, one two three, one two"}]
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
        text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "[user] Count: one two three, one two three, one two\n[assistant]"
        client = server.client()
        model = client.models.list().data[0].id
        replies = [client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
                   for _ in range(2)]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0]
        offline = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory="64MiB"), files=shallow_files)
        offline.add_request("r", ids, SamplingParams(temperature=0, max_tokens=12))
        while offline.has_unfinished_requests():
            for out in offline.step():
                expected = out.outputs[0].text
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content == expected
        metrics = httpx.get(server.url + "/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("llmserve:spec_decode_num_draft_tokens_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0  # speculation ran
    finally:
        server.stop()
    assert "--gpu-memory-utilization applies to GPUs; on cpu the KV cache is --kv-cache-fraction 0.1" in server.output()
    assert "Avg prompt throughput" not in server.output()  # --disable-log-stats


def test_flags_reach_the_engine_config():
    from llmserve.cli import build_parser
    from llmserve.engine_args import engine_config_from_args

    args = build_parser().parse_args(["serve", "--seed", "11", "--gpu-memory-utilization", "0.8",
                                      "--no-enable-prefix-caching", "--speculative-config",
                                      json.dumps({"model": "draft.gguf", "num_speculative_tokens": 2})])
    config = engine_config_from_args(args)
    assert (config.seed, config.gpu_memory_utilization, config.enable_prefix_caching) == (11, 0.8, False)
    assert (config.speculative_method, config.draft_model, config.num_speculative_tokens) == ("draft", "draft.gguf", 2)
    assert engine_config_from_args(build_parser().parse_args(["serve", "--enable-prefix-caching"])).enable_prefix_caching
    assert engine_config_from_args(build_parser().parse_args(["serve"])).seed == 0
    args = build_parser().parse_args(["serve", "--tokenizer", ".", "--max-logprobs", "-1", "--trust-remote-code", "-pp",
                                      "1", "--override-generation-config", '{"top_p": 0.9}',
                                      "--long-prefill-token-threshold", "64", "--enable-chunked-prefill"])
    config = engine_config_from_args(args)
    assert (config.tokenizer, config.max_logprobs, config.trust_remote_code) == (".", -1, True)
    assert (config.pipeline_parallel_size, config.override_generation_config) == (1, {"top_p": 0.9})
    assert config.long_prefill_token_threshold == 64
    args = build_parser().parse_args(["serve", "--task", "score", "--convert", "classify", "--hf-overrides",
                                      '{"classifier_from_token": ["yes"]}'])
    config = engine_config_from_args(args)
    assert (config.runner, config.convert, config.hf_overrides) == ("pooling", "classify",
                                                                    {"classifier_from_token": ["yes"]})


# ---- the model's generation_config.json (vLLM's --generation-config) ------------------------------------------
@pytest.fixture(scope="module")
def tuned_model(tmp_path_factory, default_files):
    """A tiny random-weight Llama with the default model's tokenizer, whose generation_config.json asks for greedy
    decoding (top_k 1, temperature 0.7) and at most 5 new tokens."""
    from tests.helpers import save_tiny_llama

    folder = tmp_path_factory.mktemp("tuned") / "model"
    save_tiny_llama(folder, 49152, seed=5)
    tok = default_files.tokenizer
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    path = folder / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**generation, "temperature": 0.7, "top_k": 1, "max_new_tokens": 5}))
    return folder


def test_the_models_generation_config_sets_what_a_request_leaves_unset(tuned_model):
    kw = dict(dtype="float32", kv_cache_memory="32MiB", device="cpu")
    llm = LLM(str(tuned_model), **kw)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
    prompt = [1, 50, 900, 4000]
    unset = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert unset.token_ids == greedy.token_ids and len(unset.token_ids) == 5
    plain = LLM(str(tuned_model), generation_config="vllm", **kw).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)


def test_the_server_applies_the_models_sampling_defaults(tuned_model):
    from llmserve.loader import load_model_files
    from tests.server_fixtures import RunningServer

    server = RunningServer(load_model_files(str(tuned_model)), {"kv_cache_memory": "32MiB", "device": "cpu"}, {})
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Hello there"}]
        unset = client.chat.completions.create(model="test-model", messages=messages)
        greedy = client.chat.completions.create(model="test-model", messages=messages, temperature=0, max_tokens=5)
        assert unset.usage.completion_tokens == 5 and unset.choices[0].finish_reason == "length"
        assert unset.choices[0].message.content == greedy.choices[0].message.content
        shorter = client.chat.completions.create(model="test-model", messages=messages, max_tokens=3)
        assert shorter.usage.completion_tokens == 3
        sampled = [client.chat.completions.create(model="test-model", messages=messages, seed=s,
                                                  extra_body={"top_k": 0}).choices[0].message.content for s in (1, 2)]
        assert greedy.choices[0].message.content not in sampled  # the request's top_k wins over the model's
        completion = client.completions.create(model="test-model", prompt="Hello")  # OpenAI's 16 yields to the model's 5
        assert completion.usage.completion_tokens == 5
    finally:
        server.stop()


def test_a_bad_generation_config_is_refused_at_start(tuned_model, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tuned_model, broken)
    (broken / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(InvalidRequestError, match="the model's generation_config.json: temperature.*"
                                                  "--generation-config vllm"):
        LLM(str(broken), dtype="float32", kv_cache_memory="32MiB", device="cpu")
    LLM(str(broken), dtype="float32", kv_cache_memory="32MiB", device="cpu", generation_config="vllm")
    with pytest.raises(InvalidRequestError, match="generation_config must be auto, vllm or a folder"):
        LLM(str(tuned_model), generation_config=str(tmp_path / "nowhere"))


# ---- --tokenizer, --max-logprobs, --override-generation-config, --trust-remote-code, CORS, logs ---------------
@pytest.fixture(scope="module")
def weights_only(tuned_model, tmp_path_factory):
    """tuned_model's weights in a folder without tokenizer files, and its tokenizer in a folder of its own (as a
    Hugging Face tokenizer repository is)."""
    import shutil

    root = tmp_path_factory.mktemp("split")
    weights, tokenizer = root / "weights", root / "tokenizer"
    weights.mkdir()
    tokenizer.mkdir()
    for f in tuned_model.iterdir():
        shutil.copy(f, (tokenizer if f.name.startswith("tokenizer") else weights) / f.name)
    return weights, tokenizer


def test_a_model_without_a_tokenizer_takes_one_from_tokenizer(weights_only, tuned_model, default_gguf):
    """vLLM's --tokenizer: a weights-only folder serves text with a tokenizer folder's (or a GGUF file's) tokenizer,
    exactly as the folder that holds both; without one, text prompts are refused naming the flag."""
    weights, tokenizer = weights_only
    kw = dict(dtype="float32", kv_cache_memory="32MiB", device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=6)
    with pytest.raises(InvalidRequestError, match="has no tokenizer.*--tokenizer"):
        LLM(str(weights), **kw).generate("Hello there", greedy, use_tqdm=False)
    expected = LLM(str(tuned_model), **kw).chat([{"role": "user", "content": "Hello there"}], greedy, use_tqdm=False)[0]
    split = LLM(str(weights), tokenizer=str(tokenizer), **kw)
    got = split.chat([{"role": "user", "content": "Hello there"}], greedy, use_tqdm=False)[0]
    assert got.prompt_token_ids == expected.prompt_token_ids  # the tokenizer folder's chat template made the prompt
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids and got.outputs[0].text == expected.outputs[0].text
    from_gguf = LLM(str(weights), tokenizer=default_gguf, **kw).generate("Hello there", greedy, use_tqdm=False)[0]
    assert from_gguf.outputs[0].text == split.generate("Hello there", greedy, use_tqdm=False)[0].outputs[0].text


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, weights_only):
    from tests.helpers import save_tiny_llama

    small = save_tiny_llama(tmp_path / "small", 320, seed=1)
    with pytest.raises(Exception, match="has 49152 tokens, more than the model's vocabulary of 320"):
        LLM(small, tokenizer=str(weights_only[1]), dtype="float32", kv_cache_memory="32MiB", device="cpu")
    with pytest.raises(Exception, match="has no tokenizer.json"):
        LLM(small, tokenizer=str(tmp_path), dtype="float32", kv_cache_memory="32MiB", device="cpu")


def test_max_logprobs_bounds_what_a_request_may_ask(tuned_model):
    kw = dict(dtype="float32", kv_cache_memory="32MiB", device="cpu")
    default = LLM(str(tuned_model), **kw)
    assert len(default.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)[0]
               .outputs[0].logprobs[0]) >= 20
    with pytest.raises(InvalidRequestError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        default.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="Requested prompt logprobs of 21"):
        default.generate([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=21), use_tqdm=False)
    whole = LLM(str(tuned_model), max_logprobs=-1, **kw)  # -1: the whole vocabulary
    entry = whole.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=49152), use_tqdm=False)[0].outputs[0].logprobs[0]
    assert len(entry) == 49152 and abs(sum(math.exp(v) for v in entry.values()) - 1) < 1e-3


def test_override_generation_config_lays_defaults_over_the_models(tuned_model):
    kw = dict(dtype="float32", kv_cache_memory="32MiB", device="cpu")
    over = LLM(str(tuned_model), override_generation_config={"max_new_tokens": 3, "temperature": 0.5}, **kw)
    defaults = over.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.5, 1, 3)  # top_k still the model's
    plain = LLM(str(tuned_model), generation_config="vllm", override_generation_config={"top_p": 0.5}, **kw)
    assert (plain.get_default_sampling_params().top_p, plain.get_default_sampling_params().top_k) == (0.5, 0)
    with pytest.raises(InvalidRequestError, match="--override-generation-config.*temperature must be non-negative"):
        LLM(str(tuned_model), override_generation_config={"temperature": -1}, **kw)


def test_a_vllm_serve_command_with_tokenizer_logprobs_cors_names_and_logs(weights_only):
    """`llmserve serve WEIGHTS --tokenizer TOKENIZER --max-logprobs 30 --allowed-origins ... --enable-log-requests
    --uvicorn-log-level info --trust-remote-code -pp 1 --override-generation-config ... --served-model-name A B` with
    the real openai client: text served through the other folder's tokenizer, 25 logprobs given and 31 refused with
    vLLM's message, the override's max_new_tokens applied, CORS answered for the allowed origin only, the base model
    served under both names (GET /v1/models/{model} too), and the log
    has each request, uvicorn's access lines, the periodic stats line and the note that remote code changes
    nothing."""
    weights, tokenizer = weights_only
    server = ServerProcess(str(weights), "--tokenizer", str(tokenizer), "--dtype", "float32", "--device", "cpu",
                           "--no-webui", "--kv-cache-memory", "32MiB", "--max-logprobs", "30",
                           "--allowed-origins", '["https://app.example"]', "--enable-log-requests",
                           "--uvicorn-log-level", "info", "--trust-remote-code", "-pp", "1",
                           "--override-generation-config", '{"max_new_tokens": 4}',
                           "--served-model-name", "weights", "assistant-v2",
                           env={**os.environ, "LLMSERVE_LOG_STATS_INTERVAL": "0.2"})
    try:
        server.wait_ready()
        client = server.client()
        messages = [{"role": "user", "content": "Hello there"}]
        reply = client.chat.completions.create(model="weights", messages=messages, logprobs=True, top_logprobs=25)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content  # the override's 4
        assert all(len(t.top_logprobs) == 25 for t in reply.choices[0].logprobs.content)
        with pytest.raises(openai.BadRequestError, match="Requested sample logprobs of 31, which is greater than max "
                                                         "allowed: 30") as refused:
            client.chat.completions.create(model="weights", messages=messages, logprobs=True, top_logprobs=31)
        assert refused.value.status_code == 400 and refused.value.body["param"] == "logprobs"
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        allowed = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        listed = httpx.get(server.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert listed.headers["access-control-allow-origin"] == "https://app.example"
        # --served-model-name with two names: either serves the base model, responses name the first
        assert [m.id for m in client.models.list().data] == ["weights", "assistant-v2"]
        aliased = client.chat.completions.create(model="assistant-v2", messages=messages, temperature=0)
        assert aliased.model == "weights" and aliased.usage.completion_tokens == 4
        assert client.models.retrieve("assistant-v2").id == "assistant-v2"  # OpenAI's GET /v1/models/{model}
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
        assert httpx.get(server.url + "/version").json()["version"] == llmserve.__version__
        time.sleep(0.5)  # the stats line after the last interval with activity
    finally:
        server.stop()
    log = server.output()
    assert "--trust-remote-code changes nothing here" in log
    assert log.count("prompt tokens, adapter None, SamplingParams(") == 2  # the two that ran; the refused one is not
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log and '"POST /v1/chat/completions HTTP/1.1" 400' in log
    stats = [line for line in log.splitlines() if "Avg prompt throughput" in line]
    assert stats and all(re.search(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ "
                                   r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix "
                                   r"cache hit rate: [\d.]+%", line) for line in stats), stats
    assert any("Avg generation throughput: 0.0 " not in line for line in stats)  # the request's 4 tokens
    assert "Running: 0 reqs" in stats[-1]  # the line after the burst shows it ended


def test_serve_refuses_a_model_without_a_tokenizer(weights_only, capsys):
    from llmserve.cli import main

    assert main(["serve", str(weights_only[0]), "--port", "0", "--device", "cpu", "--kv-cache-memory", "32MiB"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has no tokenizer" in errors[0] and "--tokenizer" in errors[0], errors


def test_https_with_client_certificates(weights_only, tmp_path):
    """vLLM's --ssl-certfile/--ssl-keyfile serve HTTPS: the openai client trusting the server's CA gets its answer;
    with --ssl-ca-certs and --ssl-cert-reqs 2 a client must also present a certificate from that CA; plain HTTP to
    the port gets nothing."""
    import ssl

    import trustme

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    cert, key, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    server_cert.cert_chain_pems[0].write_to_path(str(cert))
    for blob in server_cert.cert_chain_pems[1:]:
        blob.write_to_path(str(cert), append=True)
    server_cert.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    with_client_cert = ssl.create_default_context(cafile=str(ca_file))
    ca.issue_cert("client@example").configure_cert(with_client_cert)
    weights, tokenizer = weights_only
    server = ServerProcess(str(weights), "--tokenizer", str(tokenizer), "--dtype", "float32", "--device", "cpu",
                           "--no-webui", "--kv-cache-memory", "32MiB", "--ssl-certfile", str(cert), "--ssl-keyfile",
                           str(key), "--ssl-ca-certs", str(ca_file), "--ssl-cert-reqs", "2", verify=with_client_cert)
    try:
        server.wait_ready()
        assert server.url.startswith("https://")
        reply = server.client().completions.create(model="weights", prompt="Hello", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3
        without_client_cert = ssl.create_default_context(cafile=str(ca_file))
        with pytest.raises(httpx.HTTPError):  # the handshake fails: no client certificate
            httpx.get(server.url + "/v1/models", verify=without_client_cert, timeout=10).raise_for_status()
        with pytest.raises(httpx.HTTPError):  # an unknown server certificate is not trusted
            httpx.get(server.url + "/v1/models", timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/v1/models", timeout=10).raise_for_status()
    finally:
        server.stop()
    assert f"serving weights on https://127.0.0.1:{server.port}/v1" in server.output()


# ---- --load-format (dummy weights), --tokenizer-mode, and vLLM's smaller server flags ----------------------------
def test_load_format_dummy_runs_a_folder_without_weights(tuned_model, tmp_path, default_gguf):
    """--load-format dummy: random weights in the shape of config.json; the folder's own weights (if any) are not
    read, the same seed gives the same model, and the answers differ from the real weights'."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tuned_model / name, bare / name)
    kw = dict(dtype="float32", kv_cache_memory="32MiB", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with pytest.raises(Exception, match="has no \\*.safetensors weights.*--load-format dummy"):
        LLM(str(bare), **kw)
    dummy = LLM(str(bare), load_format="dummy", **kw)
    out = dummy.generate("Hello there", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    again = LLM(str(tuned_model), load_format="dummy", **kw).generate("Hello there", params, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids and again.logprobs == out.logprobs  # the files' weights were not read
    real = LLM(str(tuned_model), **kw).generate("Hello there", params, use_tqdm=False)[0].outputs[0]
    assert real.logprobs[0] != out.logprobs[0]
    assert dummy.llm_engine.model_config.num_parameters == real_parameters(tuned_model)
    import subprocess
    import sys

    info = subprocess.run([sys.executable, "-m", "llmserve", "info", str(bare), "--load-format", "dummy"],
                          capture_output=True, text=True)
    assert info.returncode == 0 and re.search(r"layers / hidden / FFN\s+2 / 32 / 64", info.stdout), info.stderr


def real_parameters(folder) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


@pytest.mark.parametrize("kw, message", [
    ({"load_format": "dummy"}, "--load-format dummy takes a Hugging Face folder"),
    ({"load_format": "safetensors"}, "--load-format safetensors takes a Hugging Face folder"),
    ({"load_format": "pt"}, "load_format must be one of auto, safetensors, gguf, dummy"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode must be auto, hf or slow"),
])
def test_load_format_and_tokenizer_mode_errors(default_gguf, kw, message):
    with pytest.raises(Exception, match=message):
        LLM(default_gguf, kv_cache_memory="32MiB", device="cpu", **kw)


def test_load_format_gguf_on_a_folder_is_refused(tuned_model):
    with pytest.raises(Exception, match="--load-format gguf takes a GGUF file"):
        LLM(str(tuned_model), load_format="gguf", kv_cache_memory="32MiB", device="cpu")


def test_vllms_smaller_server_flags(tuned_model):
    """--response-role, --return-tokens-as-token-ids, --enable-request-id-headers, --root-path,
    --enable-force-include-usage, --disable-uvicorn-access-log, --disable-fastapi-docs, and the flags accepted for
    vLLM's command lines (--enable-prompt-tokens-details, --max-log-len, --tokenizer-mode, --load-format)."""
    server = ServerProcess(str(tuned_model), "--dtype", "float32", "--device", "cpu", "--no-webui",
                           "--kv-cache-memory", "32MiB", "--response-role", "bot", "--return-tokens-as-token-ids",
                           "--enable-request-id-headers", "--root-path", "/llm", "--enable-force-include-usage",
                           "--uvicorn-log-level", "info", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
                           "--enable-prompt-tokens-details", "--max-log-len", "100", "--tokenizer-mode", "hf",
                           "--load-format", "safetensors")
    try:
        server.wait_ready()
        client = server.client()
        messages = [{"role": "user", "content": "Hello there"}]
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        assert reply.choices[0].message.role == "bot"
        ids = client.completions.create(model=reply.model, prompt="Hello there", max_tokens=4, temperature=0,
                                        logprobs=1)
        tokens = ids.choices[0].logprobs.tokens
        assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens) and len(tokens) == 4
        assert [t.token for t in reply.choices[0].logprobs.content][0].startswith("token_id:")
        chunks = list(client.chat.completions.create(model=reply.model, messages=messages, max_tokens=3, stream=True))
        assert chunks[0].choices[0].delta.role == "bot"
        assert chunks[-1].usage.completion_tokens == 3  # no stream_options asked for it
        # X-Request-Id: the client's back, else one of the server's
        sent = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "trace-42"})
        assert sent.headers["x-request-id"] == "trace-42"
        assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(server.url + "/v1/models").headers["x-request-id"])
        # behind a proxy's prefix, with or without it
        assert httpx.get(server.url + "/llm/v1/models").status_code == 200
        refused = httpx.post(server.url + "/llm/v1/messages", json={"model": reply.model, "messages": []})
        assert refused.status_code == 400 and refused.json()["type"] == "error"  # Anthropic's error object there too
        assert httpx.get(server.url + "/openapi.json").status_code == 404
    finally:
        server.stop()
    log = server.output()
    assert '"GET /v1/models HTTP/1.1" 200' not in log  # no access log, though uvicorn logs at info


def test_skip_tokenizer_init_generates_from_token_ids(shallow_gguf):
    """vLLM's LLM(skip_tokenizer_init=True): no tokenizer is loaded; token-id prompts give the tokens (and logprobs)
    of an engine with one, their text empty; what needs the tokenizer is refused in one line naming why."""
    from llmserve.beam_search import BeamSearchParams

    with_tokenizer = LLM(shallow_gguf, dtype="float32", kv_cache_memory="32MiB", device="cpu")
    ids = with_tokenizer.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    want = with_tokenizer.generate([ids], params, use_tqdm=False)[0].outputs[0]
    del with_tokenizer
    llm = LLM(shallow_gguf, dtype="float32", kv_cache_memory="32MiB", device="cpu", skip_tokenizer_init=True)
    got = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.token_ids and got.outputs[0].logprobs == want.logprobs
    assert got.outputs[0].text == "" and want.text
    beams = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(beams[0].sequences[0].tokens) == len(ids) + 3 and beams[0].sequences[0].text == ""
    why = "the engine was started with skip_tokenizer_init"
    with pytest.raises(InvalidRequestError, match=f"^{why}: pass token ids$"):
        llm.generate("The capital of France is", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=f"^stop needs the tokenizer, and {why}"):
        llm.generate([ids], SamplingParams(stop=["."]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="^structured_outputs needs the tokenizer"):
        llm.generate([ids], SamplingParams(structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)
    for call in (llm.get_tokenizer, lambda: llm.chat([{"role": "user", "content": "Hi"}])):
        with pytest.raises(ValueError, match=f"^there is no tokenizer: {why}$"):
            call()
    assert llm.generate([ids], SamplingParams(max_tokens=2, stop_token_ids=[13]), use_tqdm=False)[0].outputs[0].token_ids
