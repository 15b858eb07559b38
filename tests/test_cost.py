"""Cost tracking in the server: usage carries the cost, /metrics counts it, compute time is fully accounted."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cli import main
from llmserve.plan.pricing import PricingConfig
from tests.server_fixtures import RunningServer

PRICE = {"input": 1.0, "cached_input": 0.1, "output": 2.0}


def metric(server: RunningServer, name: str, **labels) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def priced(default_files):
    server = RunningServer(default_files, {}, {"pricing": PricingConfig.model_validate({"models": {"test-model": PRICE}})})
    yield server
    server.stop()


def test_usage_carries_the_price_table_cost(priced):
    body = {"model": "test-model", "prompt": "The capital of France is", "max_tokens": 7, "ignore_eos": True, "temperature": 0}
    r = httpx.post(priced.base_url + "/v1/completions", json=body, timeout=60).json()
    u = r["usage"]
    expected = (u["prompt_tokens"] * 1.0 + u["completion_tokens"] * 2.0) / 1e6
    assert u["cost"] == pytest.approx(expected)
    assert u["cost_details"] == {"input_cost": pytest.approx(u["prompt_tokens"] / 1e6), "cached_input_cost": 0.0,
                                 "output_cost": pytest.approx(14 / 1e6), "basis": "price_table"}
    priced.wait_idle()
    assert metric(priced, "llmserve:cost_usd_total", kind="output") == pytest.approx(14 / 1e6)
    assert metric(priced, "llmserve:cost_usd_total", kind="input") == pytest.approx(u["prompt_tokens"] / 1e6)


def test_streamed_usage_has_the_cost(priced):
    body = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", priced.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    u = chunks[-1]["usage"]
    assert u["cost"] == pytest.approx((u["prompt_tokens"] + 2 * 3) / 1e6)


def test_gpu_time_cost_accounts_for_every_step(default_files):
    """Without a price table, each request pays its share of each step's time; the shares add up to the steps."""
    server = RunningServer(default_files, {}, {"gpu_hour_price": 3600.0})  # $1 per second: cost reads as seconds
    try:
        async def go():
            async with httpx.AsyncClient(base_url=server.base_url + "/v1", timeout=120) as c:
                bodies = [{"model": "test-model", "prompt": "word " * (10 + 20 * i), "max_tokens": 5 + i, "ignore_eos": True}
                          for i in range(3)]
                return await asyncio.gather(*(c.post("/completions", json=b) for b in bodies))

        usages = [r.json()["usage"] for r in asyncio.run(go())]
        server.wait_idle()
        step_seconds = sum(s.seconds for s in server.llm.step_stats)
        assert sum(u["cost"] for u in usages) == pytest.approx(step_seconds, rel=1e-6)
        for u in usages:
            d = u["cost_details"]
            assert d["basis"] == "gpu_time" and d["input_cost"] > 0 and d["output_cost"] > 0 and d["cached_input_cost"] == 0
        assert metric(server, "llmserve:cost_usd_total") == pytest.approx(step_seconds, rel=1e-6)
    finally:
        server.stop()


def test_no_pricing_no_cost_field(default_files):
    server = RunningServer(default_files, {}, {})
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).json()
        assert "cost" not in r["usage"]
    finally:
        server.stop()


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ('{"models": {"m": {"input": -1, "output": 1}}}', "models.m.input: Input should be greater than or equal to 0"),
    ('{"models": {"m": {"input": 1, "output": 1, "cached_input": 5}}}', "cached_input price above the input price"),
    ('{"models": {"m": {"input": 1}}}', "models.m.output: Field required"),
    ('{"modles": {}}', "modles: Extra inputs are not permitted"),
])
def test_bad_pricing_file_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "prices.json"
    path.write_text(content)
    assert main(["serve", "--pricing", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: pricing file {path}") and message in err[0], err
