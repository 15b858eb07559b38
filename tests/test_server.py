"""The HTTP server with the real `openai` client and raw HTTP, against a real server on 127.0.0.1."""

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import RunningServer

MODEL = "test-model"


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def metric_values(base_url: str) -> dict[tuple, float]:
    text = httpx.get(base_url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return values


def test_completion_with_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 13
    assert r.choices[0].finish_reason == "length"


def test_chat_matches_offline_engine(client, server):
    msgs = [{"role": "user", "content": "Name a primary color."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    ids = server.llm.tokenizer.encode(server.llm.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].message.refusal is None


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0)
    assert "".join(c.choices[0].delta.content for c in content) == full.choices[0].message.content


def test_completion_stream_one_chunk_per_token(client):
    stream = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert len(chunks) == 10 and chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0).choices[0].text
    stop = base[4:8]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"


def test_n_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, seed=11, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 24
    a = client.completions.create(seed=5, **kw).choices[0].text
    b = client.completions.create(seed=5, **kw).choices[0].text
    assert a == b


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("Hello world")
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == 2 + 3 and lp.text_offset[0] == 0
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy takes the top token


def test_concurrent_streams_and_disconnect(server):
    async def one(client, i):
        chunks, usage = 0, None
        async with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 8 + i % 5,
                                                                   "ignore_eos": True, "stream": True, "temperature": 0.8,
                                                                   "stream_options": {"include_usage": True}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    chunks += bool(chunk["choices"])
                    usage = chunk.get("usage") or usage
        # a chunk per token, except that a stream which fell behind gets the tokens that queued up as one chunk (as
        # vLLM's): what every stream must get is all its tokens
        assert 1 <= chunks <= usage["completion_tokens"]
        return usage["completion_tokens"]

    async def leaver(client):
        async with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Long story:", "max_tokens": 500,
                                                                   "ignore_eos": True, "stream": True}) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        return  # hang up mid-stream

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(*[one(client, i) for i in range(32)], leaver(client))

    counts = asyncio.run(main())[:32]
    assert counts == [8 + i % 5 for i in range(32)]
    server.wait_idle()  # the abandoned request's blocks are back
    assert metric_values(server.base_url)[("llmserve:kv_cache_usage_perc", ())] == 0


def test_timeout_returns_partial_output(client, server):
    r = client.completions.create(model=MODEL, prompt="Write forever:", max_tokens=3000, temperature=0,
                                  extra_body={"ignore_eos": True, "timeout": 1.0})
    assert r.choices[0].finish_reason == "timeout"
    assert 0 < r.usage.completion_tokens < 3000 and r.choices[0].text
    stream = client.completions.create(model=MODEL, prompt="Write forever:", max_tokens=3000, stream=True,
                                       extra_body={"ignore_eos": True, "timeout": 0.5})
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "timeout"
    server.wait_idle()


BAD = [
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "hi", "model": "gpt-nope"}, 404, "model"),
    ({"prompt": "hi " * 9000, "max_tokens": 10}, 400, "max_tokens"),
    ({"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 999999], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "timeout": 0}, 400, "timeout"),
    # malformed token ids anywhere get 400 naming the field, never a 500 from decoding them
    ({"prompt": [-5]}, 400, "prompt"),
    ({"prompt": [99999999999999999999999]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3, -1]]}, 400, "prompt"),
    ({"prompt": "hi", "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"99999999999999999999999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"ten": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "stop_token_ids": [99999999999999999999999]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [10**30]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "n": 100000}, 400, "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # beyond --max-logprobs (20, as vLLM's)
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion_requests(server, body, status, param):
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "Traceback" not in r.text
    assert err["code"] is None or isinstance(err["code"], str)  # OpenAI's schema: string or null


def test_web_pages_of_any_origin_may_call_the_api_by_default(server):
    """CORS as vLLM's defaults: any origin, method and header (--allowed-origins narrows it)."""
    preflight = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    listed = httpx.get(server.base_url + "/v1/models", headers={"Origin": "https://app.example"})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"


def test_null_fields_mean_their_defaults(client):
    """The SDK and other clients send null for unset nullable fields (n, penalties, …), as OpenAI's schema allows."""
    r = httpx.post(str(client.base_url) + "completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": None,
                                                                 "presence_penalty": None, "frequency_penalty": None,
                                                                 "stream": None, "echo": None, "logprobs": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_non_stream_disconnect_is_a_clean_abort(server, caplog):
    """A client that hangs up on a non-streaming request: the request is aborted, its blocks freed, nothing logged as
    an ASGI error (it used to log "aclose(): asynchronous generator is already running")."""
    import logging

    with caplog.at_level(logging.ERROR):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/chat/completions", timeout=1.0,
                       json={"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000, "ignore_eos": True})
        server.wait_idle(30)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_bad_chat_and_malformed_json(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.base_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    long_chat = {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 5}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=long_chat)
    assert r.status_code == 400 and "maximum context length is 8192 tokens" in r.json()["error"]["message"]


def test_unknown_fields_are_ignored(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"some_future_field": 1})
    assert r.usage.completion_tokens == 2


def test_tokenize_detokenize_models_health(server):
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["max_model_len"] == 8192
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/ready").status_code == 200


def test_metrics_agree_with_requests(client, server):
    server.wait_idle()
    before = metric_values(server.base_url)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="One two", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    time.sleep(0.2)
    after = metric_values(server.base_url)
    key = ("llmserve:request_success_total", (("finished_reason", "length"),))
    assert after[key] - before.get(key, 0) == 3
    assert after[("llmserve:generation_tokens_total", ())] - before[("llmserve:generation_tokens_total", ())] == 12
    assert after[("llmserve:time_to_first_token_seconds_count", ())] - before[("llmserve:time_to_first_token_seconds_count", ())] == 3
    assert after[("llmserve:inter_token_latency_seconds_count", ())] - before[("llmserve:inter_token_latency_seconds_count", ())] == 9


def test_api_key(default_files):
    s = RunningServer(default_files, {"kv_cache_memory": "32MiB"}, {"api_key": "sekret"})
    try:
        bad = openai.OpenAI(base_url=s.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(s.base_url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=s.base_url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(s.base_url + "/health").status_code == 200  # liveness needs no key
    finally:
        s.stop()


def test_overload_gets_fast_429(default_files):
    s = RunningServer(default_files, {"kv_cache_memory": "64MiB", "max_num_seqs": 2}, {"max_queued_requests": 4})

    async def one(client, i):
        t = time.perf_counter()
        r = await client.post("/v1/completions", json={"prompt": f"Item {i}", "max_tokens": 16, "ignore_eos": True})
        return r.status_code, time.perf_counter() - t, r

    async def main():
        async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as client:
            return await asyncio.gather(*[one(client, i) for i in range(50)])

    try:
        results = asyncio.run(main())
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(ok) + len(refused) == 50 and refused and ok
        assert all(r[2].json()["usage"]["completion_tokens"] == 16 for r in ok)
        assert all(r[2].headers.get("retry-after") and r[2].json()["error"]["type"] == "RateLimitError" for r in refused)
        assert statistics.median(r[1] for r in refused) < statistics.median(r[1] for r in ok)
        s.wait_idle()
    finally:
        s.stop()


def test_rejected_requests_give_back_their_queue_place(default_files):
    # One place in the queue: a request refused after it was admitted (a bad prompt or parameter) must hand its
    # place back, or every later request would get 429.
    s = RunningServer(default_files, {"kv_cache_memory": "64MiB", "max_num_seqs": 2}, {"max_queued_requests": 1})
    bad = [("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt"),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens"),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}},
            "logit_bias")]
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as client:
            for _ in range(2):
                for path, body, param in bad:
                    r = client.post(path, json=body)
                    assert r.status_code == 400, (path, body, r.text)
                    assert r.json()["error"]["param"] == param
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        s.wait_idle()
    finally:
        s.stop()


def test_priority_lowers_ttft(default_files):
    # Ordering, not wall-clock medians: on a fast machine a fixed sleep let the low flood drain before the
    # high-priority requests arrived. Wait until the engine itself reports a backed-up queue instead.
    s = RunningServer(default_files, {"kv_cache_memory": "64MiB", "max_num_seqs": 2, "scheduling_policy": "priority"}, {})

    async def one(client, i, priority):
        async with client.stream("POST", "/v1/completions", json={"prompt": f"Task {i}:", "max_tokens": 32, "ignore_eos": True,
                                                                   "stream": True, "priority": priority}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return priority, time.perf_counter()

    async def main():
        async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as client:
            low = [asyncio.create_task(one(client, i, 10)) for i in range(16)]
            deadline = time.perf_counter() + 60
            while s.llm.num_waiting < 10:
                assert time.perf_counter() < deadline, "the low-priority flood never queued up"
                await asyncio.sleep(0.005)
            waiting_low = s.llm.num_waiting
            high = [asyncio.create_task(one(client, 100 + i, 0)) for i in range(4)]
            return waiting_low, await asyncio.gather(*low, *high)

    try:
        waiting_low, results = asyncio.run(main())
        last_high = max(t for p, t in results if p == 0)
        low_after_high = sum(1 for p, t in results if p == 10 and t > last_high)
        # Under FCFS every queued low request would start before the high ones (0 after); under priority nearly
        # all of those still waiting start after them. A few may slip in while the high requests are in flight.
        assert low_after_high >= waiting_low - 4, (low_after_high, waiting_low)
        s.wait_idle()
    finally:
        s.stop()


def test_continue_final_message_and_generation_prompt(server):
    msgs = [{"role": "user", "content": "Finish my sentence."}, {"role": "assistant", "content": "The sky is"}]
    r = httpx.post(server.base_url + "/tokenize", json={"messages": msgs[:1], "add_generation_prompt": True}).json()
    text = server.llm.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200
    expected_prompt = server.llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    cut = expected_prompt.rfind("The sky is") + len("The sky is")
    assert r.json()["usage"]["prompt_tokens"] == len(server.llm.tokenizer.encode(expected_prompt[:cut], add_special_tokens=False))
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_return_token_ids(server):
    """vLLM's return_token_ids: the prompt's and the output's token ids, whole and streamed (the streamed pieces add up
    to the whole), in completions and chat; /tokenize's return_token_strs."""
    tok = server.llm.tokenizer
    url = server.base_url + "/v1"
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    whole = httpx.post(url + "/completions", json=body).json()["choices"][0]
    assert whole["prompt_token_ids"] == tok.encode("The capital of France is")
    assert len(whole["token_ids"]) == 6 and tok.decode(whole["token_ids"]) == whole["text"]
    pieces = [c["choices"][0] for c in sse_chunks(url + "/completions", {**body, "stream": True})]
    assert pieces[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert sum((p["token_ids"] for p in pieces), []) == whole["token_ids"]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    reply = httpx.post(url + "/chat/completions", json=chat).json()
    rendered = httpx.post(server.base_url + "/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    assert reply["prompt_token_ids"] == rendered
    assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"]
    chunks = sse_chunks(url + "/chat/completions", {**chat, "stream": True})
    assert chunks[0]["prompt_token_ids"] == rendered
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks if c["choices"]), []) == \
           reply["choices"][0]["token_ids"]
    plain = httpx.post(url + "/chat/completions", json={**chat, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    strs = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == [tok.id_to_token(t) for t in strs["tokens"]] and len(strs["token_strs"]) == strs["count"]


def sse_chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_best_of_returns_the_most_likely_samples(client, server):
    """OpenAI's best_of: best_of samples drawn, the n with the highest log probability per token returned, best
    first; every sample counts in usage; the samples are the ones n=best_of with the same seed gives."""
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0, seed=11)
    every = client.completions.create(n=5, logprobs=0, **kw)
    best = client.completions.create(n=2, extra_body={"best_of": 5}, **kw)

    def per_token(c):
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    ranked = sorted(every.choices, key=per_token, reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens
    with_lp = client.completions.create(n=1, logprobs=1, extra_body={"best_of": 5}, **kw)
    assert with_lp.choices[0].text == ranked[0].text and len(with_lp.choices[0].logprobs.tokens) > 0
    for body, message in (({"best_of": 1, "n": 2}, "best_of must be greater than or equal to n"),
                          ({"best_of": 3, "stream": True}, "best_of cannot be used with stream")):
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "best_of"
    server.wait_idle()


def test_prompt_logprobs_field(server):
    """vLLM's prompt_logprobs: per prompt token (the first null) its logprob and the top k with ranks and text, the
    same values echo with logprobs gives; on chat at the top level; refused with stream."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "prompt_logprobs": 2}).json()
    echo = httpx.post(server.base_url + "/v1/completions", json={**body, "echo": True, "logprobs": 2}).json()
    field = r["choices"][0]["prompt_logprobs"]
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    assert field[0] is None and len(field) == len(ids)
    echoed = echo["choices"][0]["logprobs"]
    for i, (token, entry) in enumerate(zip(ids[1:], field[1:]), 1):
        assert entry[str(token)]["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-5)
        ranked = sorted(((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None))
        assert [rank for rank, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert sorted(v["logprob"] for v in entry.values()) == \
            pytest.approx(sorted(echoed["top_logprobs"][i].values()), abs=1e-5)  # its own and the top 2, as echo's
        assert entry[str(token)]["decoded_token"] == echoed["tokens"][i]
    chat = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    bad = httpx.post(server.base_url + "/v1/completions", json={**body, "prompt_logprobs": 1, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    server.wait_idle()


def test_continuous_usage_stats_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the counts so far,
    growing to the final usage chunk's."""
    for route, body in (("/v1/completions", {"prompt": "Count: one, two,", "n": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}]})):
        with httpx.stream("POST", server.base_url + route, json={
                **body, "model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"] is not None for c in chunks) and counts == sorted(counts)
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6 * body.get("n", 1)
        assert counts[-2] == counts[-1] and chunks[0]["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"]
    server.wait_idle()


def test_chat_echo_prepends_a_continued_message(server):
    """vLLM's chat echo: continuing an assistant message, the answer comes back whole (the message's text, then the
    continuation), streamed or not; a last message of another role is not echoed."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    url = server.base_url + "/v1/chat/completions"
    plain = httpx.post(url, json=body).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(url, json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + plain
    with httpx.stream("POST", url, json={**body, "echo": True, "stream": True}, timeout=60) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                  for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(deltas) == echoed
    asked = {"model": MODEL, "messages": messages[:1], "max_tokens": 4, "temperature": 0}
    assert httpx.post(url, json={**asked, "echo": True}).json()["choices"][0]["message"]["content"] == \
        httpx.post(url, json=asked).json()["choices"][0]["message"]["content"]
    server.wait_idle()
