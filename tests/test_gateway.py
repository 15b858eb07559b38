"""`llmserve gateway` against real local backends: llmserve replicas on the default model, a server that misbehaves on
command, and an Anthropic Messages API server (tests/fake_backends.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from llmserve.errors import InvalidRequestError
from llmserve.gateway.app import build_gateway_app
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.routing import BackendState, Router
from tests.fake_backends import FakeAnthropic, MisbehavingServer
from tests.server_fixtures import RunningServer, ServerProcess, free_port

MODEL = "SmolLM2-135M-Instruct.Q4_1"


class RunningGateway:
    def __init__(self, config: dict, api_keys: list[str] | None = None):
        self.config = GatewayConfig.from_dict(config)
        self.app = build_gateway_app(self.config, api_keys)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("gateway did not start")

    def chat(self, content="hi", key: str | None = None, headers=None, **body) -> httpx.Response:
        h = dict(headers or {})
        if key:
            h["Authorization"] = f"Bearer {key}"
        payload = {"model": "chat", "messages": [{"role": "user", "content": content}], **body}
        return httpx.post(self.base_url + "/chat/completions", json=payload, headers=h, timeout=60)

    def stream(self, content="hi", **body) -> tuple[list[dict], httpx.Response]:
        payload = {"model": "chat", "messages": [{"role": "user", "content": content}], "stream": True, **body}
        events = []
        with httpx.stream("POST", self.base_url + "/chat/completions", json=payload, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        return events, r

    def metric(self, name: str, **labels) -> float:
        total = 0.0
        for line in httpx.get(f"http://127.0.0.1:{self.port}/metrics").text.splitlines():
            m = re.match(r"^([\w:]+)(?:\{(.*)\})?\s+(\S+)$", line)
            if m and m.group(1) == name:
                have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                if all(have.get(k) == v for k, v in labels.items()):
                    total += float(m.group(3))
        return total

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def text_of(events: list[dict]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])


@pytest.fixture
def servers():
    """Starts fake backends and gateways for one test and stops them all after it."""
    started = []

    def start(obj):
        started.append(obj)
        return obj

    yield start
    for obj in reversed(started):
        obj.stop()


def two_backend_config(primary: str, fallback: str, **model) -> dict:
    return {"backends": {"primary": {"url": primary, "model": "p"}, "backup": {"url": fallback, "model": "b"}},
            "models": {"chat": {"targets": ["primary"], "fallbacks": ["backup"], **model}},
            "first_token_timeout": 1.0, "health": {"probe_interval": 0.1, "cooldown": 0.3, "failures_to_trip": 2}}


# ---- configuration --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,named", [
    ({"backends": {}, "models": {"chat": {"targets": ["a"]}}}, "unknown backend 'a'"),
    ({"backends": {"a": {"url": "ftp://x", "model": "m"}}, "models": {"chat": {"targets": ["a"]}}}, "backends.a.url"),
    ({"backends": {"a": {"url": "http://x/v1"}}, "models": {"chat": {"targets": ["a"]}}}, "backends.a.model"),
    ({"backends": {"a": {"url": "http://x/v1", "model": "m"}}, "models": {"chat": {"targets": []}}}, "models.chat.targets"),
    ({"backends": {"a": {"url": "http://x/v1", "model": "m"}}, "models": {"chat": {"targets": ["a"], "route": "random"}}},
     "models.chat.route"),
    ({"backends": {"a": {"url": "http://x/v1", "model": "m", "colour": 1}}, "models": {"chat": {"targets": ["a"]}}},
     "backends.a.colour"),
    ({"backends": {"a": {"url": "http://x/v1", "model": "m"}}, "models": {"chat": {"targets": ["a"], "params": {"drop": ["messages"]}}}},
     "models.chat.params"),
    ({"backends": {"a": {"url": "http://x/v1", "model": "m", "price": {"input": -1, "output": 1}}}, "models": {"chat": {"targets": ["a"]}}},
     "backends.a.price.input"),
])
def test_bad_config_names_the_key(config, named):
    with pytest.raises(InvalidRequestError) as e:
        GatewayConfig.from_dict(config)
    assert named in e.value.message


def test_cli_bad_config_is_one_line(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("backends:\n  a: {url: http://127.0.0.1:1/v1}\nmodels:\n  chat: {targets: [a]}\n")
    out = subprocess.run([sys.executable, "-m", "llmserve", "gateway", "--config", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: gateway config {path}: backends.a.model: Field required"]
    path.write_text("backends: [unclosed\n")
    out = subprocess.run([sys.executable, "-m", "llmserve", "gateway", "--config", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr


# ---- routing inside a group ----------------------------------------------------------------------------------

def _router(n: int, **cfg):
    config = GatewayConfig.from_dict({"backends": {f"r{i}": {"url": f"http://127.0.0.1:1/v{i}", "model": "m"} for i in range(n)},
                                      "models": {"chat": {"targets": [f"r{i}" for i in range(n)]}}, **cfg})
    states = {name: BackendState(name, b) for name, b in config.backends.items()}
    return Router(config, states), states, tuple(states)


def test_round_robin_and_least_outstanding():
    router, states, group = _router(3)
    firsts = [router.order("round-robin", group, "")[0] for _ in range(6)]
    assert firsts == ["r0", "r1", "r2", "r0", "r1", "r2"]
    states["r0"].outstanding, states["r1"].outstanding, states["r2"].outstanding = 5, 1, 3
    assert router.order("least-outstanding", group, "") == ["r1", "r2", "r0"]
    states["r1"].cool_down(60)  # a backend cooling down is not offered
    assert router.order("least-outstanding", group, "") == ["r2", "r0"]


def test_prefix_affinity_is_consistent_and_bounded():
    router, states, group = _router(4)
    keys = [f"system prompt number {i}" for i in range(200)]
    owners = {k: router.order("prefix-affinity", group, k)[0] for k in keys}
    assert owners == {k: router.order("prefix-affinity", group, k)[0] for k in keys}  # stable
    counts = {b: list(owners.values()).count(b) for b in group}
    assert min(counts.values()) >= 25, counts  # spread over the replicas
    # one replica leaving moves only its own keys
    states["r3"].cool_down(60)
    moved = [k for k in keys if owners[k] != "r3" and router.order("prefix-affinity", group, k)[0] != owners[k]]
    assert moved == []
    states["r3"].cooldown_until = 0
    # bounded load: a hot key spills over once its owner has more than its share in flight
    hot = keys[0]
    owner = owners[hot]
    states[owner].outstanding = 10
    assert router.order("prefix-affinity", group, hot)[0] != owner
    assert router.order("prefix-affinity", group, hot)[-1] == owner


# ---- fallbacks ----------------------------------------------------------------------------------------------

def test_connection_error_falls_back(servers):
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(f"http://127.0.0.1:{free_port()}/v1", backup.base_url)))
    r = gw.chat()
    assert r.status_code == 200 and r.headers["x-llmserve-backend"] == "backup"
    assert r.json()["choices"][0]["message"]["content"] == " tok tok tok" and r.json()["model"] == "chat"
    events, resp = gw.stream()
    assert resp.headers["x-llmserve-backend"] == "backup" and text_of(events) == " tok tok tok"
    assert gw.metric("llmserve_gateway:fallbacks_total", model="chat", from_backend="primary", reason="connect") >= 1
    assert gw.metric("llmserve_gateway:backend_failures_total", backend="primary", reason="connect") >= 1


def test_429_honours_retry_after(servers):
    primary = servers(MisbehavingServer("status:429", retry_after="1"))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    assert gw.chat().headers["x-llmserve-backend"] == "backup"
    assert len(primary.received) == 1
    primary.mode = "ok"
    # within Retry-After the primary is skipped
    assert gw.chat().headers["x-llmserve-backend"] == "backup" and len(primary.received) == 1
    time.sleep(1.1)
    assert gw.chat().headers["x-llmserve-backend"] == "primary"
    assert gw.metric("llmserve_gateway:cooldowns_total", backend="primary", reason="rate_limited") == 1


def test_every_backend_rate_limited_passes_429_on(servers):
    primary = servers(MisbehavingServer("status:429", retry_after="7"))
    backup = servers(MisbehavingServer("status:429", retry_after="3"))
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    r = gw.chat()
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert r.headers["retry-after"] == "3"
    r = gw.chat()  # both cooling down: nothing is sent, the client hears when to come back
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available" and int(r.headers["retry-after"]) >= 1
    assert len(primary.received) == 1 and len(backup.received) == 1


def test_5xx_trips_the_breaker_and_a_probe_brings_it_back(servers):
    primary = servers(MisbehavingServer("status:500"))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    primary.models_status = 500  # the probe fails too while it is down
    for _ in range(2):
        assert gw.chat().headers["x-llmserve-backend"] == "backup"
    assert len(primary.received) == 2
    assert gw.metric("llmserve_gateway:backend_up", backend="primary") == 0
    assert gw.metric("llmserve_gateway:cooldowns_total", backend="primary", reason="tripped") == 1
    gw.chat()
    assert len(primary.received) == 2  # tripped: skipped
    primary.mode, primary.models_status = "ok", 200
    deadline = time.time() + 5
    while gw.metric("llmserve_gateway:backend_up", backend="primary") == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert gw.chat().headers["x-llmserve-backend"] == "primary"


@pytest.mark.parametrize("mode", ["hang", "slow_first"])
def test_no_first_token_in_time_falls_back(servers, mode):
    primary = servers(MisbehavingServer(mode, delay=5.0))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    started = time.time()
    events, r = gw.stream()
    assert r.headers["x-llmserve-backend"] == "backup" and text_of(events) == " tok tok tok"
    assert time.time() - started < 4
    assert gw.metric("llmserve_gateway:backend_failures_total", backend="primary", reason="timeout") == 1


def test_a_slow_first_token_within_the_timeout_is_waited_for(servers):
    primary = servers(MisbehavingServer("slow_first", delay=0.4))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    events, r = gw.stream()
    assert r.headers["x-llmserve-backend"] == "primary" and not backup.received


def test_a_stream_broken_after_its_first_token_is_not_restarted(servers):
    primary = servers(MisbehavingServer("drop_after:2", tokens=5))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    events, r = gw.stream()
    assert r.headers["x-llmserve-backend"] == "primary"
    assert text_of(events) == " tok tok"
    assert events[-1]["error"]["code"] == "upstream_stream_broken"
    assert backup.received == []  # never silently restarted elsewhere


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_answers_fall_back(servers, stream):
    primary = servers(MisbehavingServer("malformed"))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    if stream:
        events, r = gw.stream()
        assert text_of(events) == " tok tok tok"
    else:
        r = gw.chat()
        assert r.json()["choices"][0]["message"]["content"] == " tok tok tok"
    assert r.headers["x-llmserve-backend"] == "backup"


def test_context_window_fallback(servers):
    primary = servers(MisbehavingServer())
    backup = servers(MisbehavingServer())
    config = two_backend_config(primary.base_url, backup.base_url)
    config["backends"]["primary"]["max_context"] = 64
    gw = servers(RunningGateway(config))
    assert gw.chat("short").headers["x-llmserve-backend"] == "primary"
    r = gw.chat("word " * 400)  # about 500 tokens: more than the primary takes
    assert r.headers["x-llmserve-backend"] == "backup" and len(primary.received) == 1
    # and when a backend itself says the prompt is too long
    primary.mode = "context"
    config2 = two_backend_config(primary.base_url, backup.base_url)
    gw2 = servers(RunningGateway(config2))
    assert gw2.chat("hello").headers["x-llmserve-backend"] == "backup"
    # nowhere fits: 400 context_length_exceeded
    config3 = two_backend_config(primary.base_url, backup.base_url)
    config3["backends"]["primary"]["max_context"] = 64
    config3["backends"]["backup"]["max_context"] = 64
    r = servers(RunningGateway(config3)).chat("word " * 400)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_bad_request_is_not_retried(servers):
    primary = servers(MisbehavingServer("bad_request"))
    backup = servers(MisbehavingServer())
    gw = servers(RunningGateway(two_backend_config(primary.base_url, backup.base_url)))
    r = gw.chat(temperature=-1)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "temperature must be non-negative", "type": "BadRequestError",
                                 "param": "temperature", "code": None}
    assert backup.received == []


# ---- parameters, tiers, cache, cost, auth -------------------------------------------------------------------

def test_parameter_policy(servers):
    backend = servers(MisbehavingServer())
    config = {"backends": {"a": {"url": backend.base_url, "model": "m"}},
              "models": {"chat": {"targets": ["a"], "params": {"drop": ["top_p"], "reject": ["temperature"],
                                                               "rename": {"max_tokens": "max_completion_tokens"}}}}}
    gw = servers(RunningGateway(config))
    r = gw.chat(temperature=0.5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert r.json()["error"]["code"] == "unsupported_parameter" and backend.received == []
    assert gw.chat(top_p=0.9, max_tokens=7).status_code == 200
    sent = backend.received[-1]
    assert "top_p" not in sent and "max_tokens" not in sent and sent["max_completion_tokens"] == 7
    assert sent["model"] == "m"


def test_tiers_pick_groups_and_priorities(servers):
    fast, standard, batch = servers(MisbehavingServer()), servers(MisbehavingServer()), servers(MisbehavingServer())
    config = {"backends": {"f": {"url": fast.base_url, "model": "m", "priorities": True},
                           "s": {"url": standard.base_url, "model": "m", "priorities": True},
                           "b": {"url": batch.base_url, "model": "m"}},
              "models": {"chat": {"targets": ["s"], "tiers": {"fast": ["f"], "batch": ["b"]}}}}
    gw = servers(RunningGateway(config))
    assert gw.chat(service_tier="priority").headers["x-llmserve-backend"] == "f"
    assert fast.received[-1]["priority"] == -10 and "service_tier" not in fast.received[-1]
    assert gw.chat(headers={"x-llmserve-tier": "batch"}).headers["x-llmserve-backend"] == "b"
    assert "priority" not in batch.received[-1]  # that backend takes no priority field
    assert gw.chat().headers["x-llmserve-backend"] == "s" and standard.received[-1]["priority"] == 0
    r = gw.chat(service_tier="ludicrous")
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"


def test_response_cache(servers):
    backend = servers(MisbehavingServer())
    config = {"backends": {"a": {"url": backend.base_url, "model": "m"}}, "models": {"chat": {"targets": ["a"]}},
              "cache": {"enabled": True, "ttl": 0.5, "max_entries": 2}}
    gw = servers(RunningGateway(config, api_keys=["k1", "k2"]))
    first = gw.chat("q", key="k1", temperature=0)
    again = gw.chat("q", key="k1", temperature=0)
    assert first.headers["x-llmserve-cache"] == "miss" and again.headers["x-llmserve-cache"] == "hit"
    assert again.json() == first.json() and len(backend.received) == 1
    assert gw.chat("q", key="k2", temperature=0).headers["x-llmserve-cache"] == "miss"  # per tenant
    assert "x-llmserve-cache" not in gw.chat("q", key="k1", temperature=0.7).headers  # sampled: never cached
    assert gw.chat("q", key="k1", temperature=0.7, seed=3).headers["x-llmserve-cache"] == "miss"  # seeded: cached
    assert gw.chat("q", key="k1", temperature=0.7, seed=3).headers["x-llmserve-cache"] == "hit"
    time.sleep(0.6)
    assert gw.chat("q", key="k1", temperature=0.7, seed=3).headers["x-llmserve-cache"] == "miss"  # expired
    assert gw.metric("llmserve_gateway:cache_total", result="hit") == 2


def test_cost_for_both_cached_token_conventions(servers):
    # the same request in both conventions: 1,000 prompt tokens of which 900 were cache reads, 50 out
    oa = servers(MisbehavingServer(usage={"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
                                          "prompt_tokens_details": {"cached_tokens": 900}}))
    an = servers(FakeAnthropic(usage={"input_tokens": 100, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 0,
                                      "output_tokens": 50}))
    os.environ["TEST_ANTHROPIC_KEY"] = an.api_key
    price = {"input": 3.0, "cached_input": 0.3, "output": 15.0}
    config = {"backends": {"oa": {"url": oa.base_url, "model": "m", "price": price},
                           "an": {"url": an.base_url, "model": "claude-fake", "api": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY",
                                  "price": price}},
              "models": {"chat": {"targets": ["oa"]}, "claude": {"targets": ["an"]}}}
    gw = servers(RunningGateway(config, api_keys=["team-a"]))
    expected = (100 * 3.0 + 900 * 0.3 + 50 * 15.0) / 1e6
    u1 = gw.chat(key="team-a").json()["usage"]
    r2 = httpx.post(gw.base_url + "/chat/completions", headers={"Authorization": "Bearer team-a"},
                    json={"model": "claude", "messages": [{"role": "user", "content": "hi"}]})
    u2 = r2.json()["usage"]
    assert u1["cost"] == pytest.approx(expected) and u2["cost"] == pytest.approx(expected)
    assert u2["prompt_tokens"] == 1000 and u2["prompt_tokens_details"]["cached_tokens"] == 900
    # the Messages API passed through (Anthropic's key header), in its own convention, whole and streamed
    body = {"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    u3 = httpx.post(gw.base_url + "/messages", headers={"x-api-key": "team-a"}, json=body).json()["usage"]
    assert u3["cost"] == pytest.approx(expected) and u3["cache_read_input_tokens"] == 900
    with httpx.stream("POST", gw.base_url + "/messages", headers={"x-api-key": "team-a"}, json={**body, "stream": True}) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and '"message_delta"' in line]
    assert deltas[-1]["usage"]["cost"] == pytest.approx(expected)
    assert httpx.post(gw.base_url + "/messages", headers={"x-api-key": "wrong"}, json=body).json()["error"]["type"] == \
        "authentication_error"
    key = re.search(r'api_key="(key-[0-9a-f]+)"', httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text).group(1)
    assert gw.metric("llmserve_gateway:cost_usd_total", api_key=key) == pytest.approx(4 * expected)
    assert "team-a" not in httpx.get(f"http://127.0.0.1:{gw.port}/metrics").text


def test_gateway_keys_are_its_own_and_backend_keys_never_show(servers, caplog):
    an = servers(FakeAnthropic(api_key="sk-backend-secret"))
    os.environ["TEST_ANTHROPIC_WRONG"] = "sk-wrong-secret"
    config = {"backends": {"an": {"url": an.base_url, "model": "claude-fake", "api": "anthropic",
                                  "api_key_env": "TEST_ANTHROPIC_WRONG"}},
              "models": {"chat": {"targets": ["an"]}}}
    gw = servers(RunningGateway(config, api_keys=["gw-key"]))
    assert gw.chat().status_code == 401
    assert gw.chat(key="sk-backend-secret").status_code == 401  # a backend's key is not a gateway key
    r = gw.chat(key="gw-key")
    assert r.status_code == 503
    assert "sk-wrong-secret" not in r.text and "refused the request (HTTP 401)" in r.text
    assert "sk-wrong-secret" not in caplog.text
    assert httpx.get(gw.base_url + "/models").status_code == 401
    assert [m["id"] for m in httpx.get(gw.base_url + "/models", headers={"Authorization": "Bearer gw-key"}).json()["data"]] == ["chat"]


def test_unknown_model_and_bad_bodies(servers):
    backend = servers(MisbehavingServer())
    gw = servers(RunningGateway({"backends": {"a": {"url": backend.base_url, "model": "m"}}, "models": {"chat": {"targets": ["a"]}}}))
    r = httpx.post(gw.base_url + "/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(gw.base_url + "/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    r = httpx.post(gw.base_url + "/chat/completions", json={"model": "chat", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert backend.received == []
    page = httpx.get(f"http://127.0.0.1:{gw.port}/")  # the playground, which lists the gateway's models
    assert page.status_code == 200 and "llmserve playground" in page.text


# ---- Anthropic's Messages API ---------------------------------------------------------------------------------

def test_anthropic_backend_through_the_openai_client(servers):
    an = servers(FakeAnthropic())
    os.environ["TEST_ANTHROPIC_KEY2"] = an.api_key
    config = {"backends": {"an": {"url": an.base_url, "model": "claude-fake", "api": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY2"}},
              "models": {"claude": {"targets": ["an"]}}}
    gw = servers(RunningGateway(config))
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="claude", messages=messages, max_tokens=20, temperature=0.2, stop=["\n\n"])
    assert r.choices[0].message.content == "echo: hello there" and r.choices[0].finish_reason == "stop"
    sent = an.received[-1]
    assert sent["system"] == "Be brief." and sent["max_tokens"] == 20 and sent["stop_sequences"] == ["\n\n"]
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    # streaming, with usage
    stream = client.chat.completions.create(model="claude", messages=messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: hello there"
    assert chunks[-1].usage.prompt_tokens == 100 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 90
    # tools: a forced call, streamed in pieces, reassembles; the result goes back as a tool_result
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                     "properties": {"city": {"type": "string"}}}}}]
    stream = client.chat.completions.create(model="claude", messages=messages, tools=tools, tool_choice="required", stream=True)
    args, names = "", ""
    finish = None
    for c in stream:
        for call in c.choices[0].delta.tool_calls or [] if c.choices else []:
            names += call.function.name or ""
            args += call.function.arguments or ""
        if c.choices and c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
    assert names == "get_weather" and json.loads(args) == {"city": "Paris"} and finish == "tool_calls"
    assert an.received[-1]["tool_choice"] == {"type": "any"}
    assert an.received[-1]["tools"][0]["input_schema"]["properties"] == {"city": {"type": "string"}}
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}, {"role": "user", "content": "thanks"}]
    r = client.chat.completions.create(model="claude", messages=follow, tools=tools)
    assert r.choices[0].message.content == "echo: thanks"
    turns = an.received[-1]["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"][0] == {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    assert turns[2]["content"][0] == {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    # what the Messages API cannot do is refused by name
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="claude", messages=messages, logprobs=True)
    assert "'logprobs'" in e.value.message


# ---- real llmserve replicas -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(default_files):
    servers_ = [RunningServer(default_files, {"max_num_seqs": 8}, {}) for _ in range(2)]
    yield servers_
    for s in servers_:
        s.stop()


def test_llmserve_replicas_behind_the_gateway(replicas, servers):
    config = {"backends": {f"r{i}": {"url": s.base_url + "/v1", "model": "test-model", "priorities": True}
                           for i, s in enumerate(replicas)},
              "models": {"chat": {"route": "prefix-affinity", "targets": ["r0", "r1"]}}}
    gw = servers(RunningGateway(config))
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused")
    system = "You are a helpful assistant who answers questions about geography in one sentence. " * 6
    questions = ["What is the capital of France?", "What is the capital of Spain?", "Where is Kenya?"]
    backends, answers = set(), []
    for q in questions:
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens=8,
            temperature=0)
        backends.add(raw.headers["x-llmserve-backend"])
        answers.append(raw.parse())
    assert len(backends) == 1  # the shared system prompt keeps them on one replica
    assert answers[-1].usage.prompt_tokens_details.cached_tokens > 0  # whose prefix cache served it
    # the same greedy answer as the replica gives directly
    direct = openai.OpenAI(base_url=replicas[0].base_url + "/v1", api_key="x").chat.completions.create(
        model="test-model", messages=[{"role": "system", "content": system}, {"role": "user", "content": questions[0]}],
        max_tokens=8, temperature=0)
    assert answers[0].choices[0].message.content == direct.choices[0].message.content
    stream = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    for s in replicas:
        s.wait_idle()


def test_killing_a_replica_under_load_loses_no_request_that_had_not_started(tmp_path, servers, shallow_gguf):
    replicas = [ServerProcess("--model", shallow_gguf, "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-num-seqs", "2", "--no-webui")
                for _ in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready(timeout=120)
        config = {"backends": {f"r{i}": {"url": r.url + "/v1", "model": MODEL} for i, r in enumerate(replicas)},
                  "models": {"chat": {"route": "round-robin", "targets": ["r0", "r1"]}},
                  "first_token_timeout": 60, "health": {"failures_to_trip": 1, "cooldown": 60}}
        gw = servers(RunningGateway(config))
        results = []
        r0_streaming = threading.Event()

        def one(i):
            started = False
            try:
                with httpx.stream("POST", gw.base_url + "/chat/completions", timeout=120, json={
                        "model": "chat", "messages": [{"role": "user", "content": f"Tell a story about the number {i}."}],
                        "max_tokens": 48, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            results.append(("broken", started, r.headers.get("x-llmserve-backend")))
                            return
                        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                            started = True
                            if r.headers.get("x-llmserve-backend") == "r0":
                                r0_streaming.set()
                    results.append(("ok" if r.status_code == 200 else f"http {r.status_code}", started,
                                    r.headers.get("x-llmserve-backend")))
            except httpx.HTTPError as e:
                results.append((f"error {e}", started, None))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        # kill r0 once it streams: two answers under way there, the others of its share waiting in its queue
        assert r0_streaming.wait(timeout=120)
        replicas[0].proc.kill()
        for t in threads:
            t.join(timeout=180)
        assert len(results) == 10
        failed = [r for r in results if r[0] != "ok"]
        assert failed and all(r[0] == "broken" and r[1] and r[2] == "r0" for r in failed), results  # only streams under way
        moved = gw.metric("llmserve_gateway:fallbacks_total", model="chat", from_backend="r0")
        assert moved >= 1 and len(failed) + sum(r[2] == "r1" for r in results if r[0] == "ok") == 10, results
    finally:
        for replica in replicas:
            replica.proc.kill()
            replica.proc.wait()


def test_usage_that_does_not_add_up_is_served_unpriced(servers):
    backend = servers(MisbehavingServer(usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                                               "prompt_tokens_details": {"cached_tokens": 9}}))
    config = {"backends": {"a": {"url": backend.base_url, "model": "m", "price": {"input": 1.0, "output": 1.0}}},
              "models": {"chat": {"targets": ["a"]}}}
    gw = servers(RunningGateway(config))
    r = gw.chat()
    assert r.status_code == 200 and "cost" not in r.json()["usage"]
    assert gw.metric("llmserve_gateway:backend_outstanding", backend="a") == 0


def test_the_responses_and_messages_apis_through_the_gateway(replicas, servers):
    """The gateway passes OpenAI's Responses API and Anthropic's Messages API to backends that serve them: llmserve
    replicas answer both as they would directly; a stored response is continued, read, listed and deleted at the
    replica that holds it; an Anthropic backend serves Messages as itself and is passed over for Responses."""
    import anthropic

    an = servers(FakeAnthropic())
    os.environ["TEST_ANTHROPIC_KEY3"] = an.api_key
    config = {"backends": {**{f"r{i}": {"url": s.base_url + "/v1", "model": "test-model"} for i, s in enumerate(replicas)},
                           "an": {"url": an.base_url, "model": "claude-fake", "api": "anthropic",
                                  "api_key_env": "TEST_ANTHROPIC_KEY3"}},
              "models": {"chat": {"targets": ["r0", "r1"], "route": "round-robin"},
                         "mixed": {"targets": ["an"], "fallbacks": ["r0"]},
                         "claude": {"targets": ["an"]}}}
    gw = servers(RunningGateway(config))
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
    direct = {f"r{i}": openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
              for i, s in enumerate(replicas)}

    # Responses: the replica's own answer; the continuation goes where the first turn is stored
    raw = client.responses.with_raw_response.create(model="chat", input="Name a fruit.", max_output_tokens=8,
                                                    temperature=0)
    first, holder = raw.parse(), raw.headers["x-llmserve-backend"]
    assert first.model == "chat" and first.output_text == direct[holder].responses.create(
        model="test-model", input="Name a fruit.", max_output_tokens=8, temperature=0).output_text
    for _ in range(3):  # round-robin would move a fresh request; a continuation stays
        raw = client.responses.with_raw_response.create(model="chat", input="And a vegetable?", max_output_tokens=8,
                                                        temperature=0, previous_response_id=first.id)
        assert raw.headers["x-llmserve-backend"] == holder
    second = raw.parse()
    assert second.output_text == direct[holder].responses.create(
        model="test-model", input="And a vegetable?", max_output_tokens=8, temperature=0,
        previous_response_id=first.id).output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["And a vegetable?"]
    with client.responses.stream(model="chat", input="Name a fruit.", max_output_tokens=8, temperature=0) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="chat", input="Hi", previous_response_id="resp_unknown")
    assert err.value.body["code"] == "previous_response_not_found"
    # an Anthropic backend has no Responses API: passed over for the fallback, or a 400 where it is the only one
    raw = client.responses.with_raw_response.create(model="mixed", input="Hi", max_output_tokens=4, temperature=0)
    assert raw.headers["x-llmserve-backend"] == "r0"
    with pytest.raises(openai.BadRequestError, match="no Responses API"):
        client.responses.create(model="claude", input="Hi")

    # Messages: llmserve replicas and the Anthropic backend, with Anthropic's client
    claude = anthropic.Anthropic(base_url=gw.base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    turn = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    m = claude.messages.create(model="chat", max_tokens=8, messages=turn, extra_body={"temperature": 0})
    mine = anthropic.Anthropic(base_url=replicas[0].base_url, api_key="x", max_retries=0).messages.create(
        model="test-model", max_tokens=8, messages=turn, extra_body={"temperature": 0})
    assert m.model == "chat" and m.content[0].text == mine.content[0].text
    with claude.messages.stream(model="chat", max_tokens=8, messages=turn, extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content[0].text == mine.content[0].text
    echoed = claude.messages.create(model="claude", max_tokens=8, messages=turn)
    assert echoed.content[0].text == "echo: Name a color." and echoed.model == "claude"
    assert an.received[-1]["model"] == "claude-fake"
    with claude.messages.stream(model="claude", max_tokens=8, messages=turn) as stream:
        assert "".join(stream.text_stream) == "echo: Name a color."
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="nope", max_tokens=8, messages=turn)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    for s in replicas:
        s.wait_idle()
