"""OpenAI's Files and Batch APIs on a real server, through the openai client as a batch pipeline uses them: upload,
create, poll, read the output and error files; answers equal to the routes' own; cancel frees the engine; each API
key sees only its own files; the errors."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from tests.server_fixtures import RunningServer
from tests.test_server import metric_values

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 10,
        "temperature": 0}


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {"api_key": ["key-a", "key-b"]})
    yield s
    s.stop()


def client(server, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def wait_for(c: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def test_a_batch_through_the_openai_client(server):
    c = client(server)
    lines = [line("paris", CHAT), line("sky", {**CHAT, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                                                "max_tokens": 12}),
             line("bad", {**CHAT, "max_tokens": -1}), line("seeded", {**CHAT, "temperature": 0.9, "seed": 3})]
    uploaded = c.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.bytes == len(jsonl(lines)) and uploaded.filename == "requests.jsonl"
    assert c.files.content(uploaded.id).content == jsonl(lines)
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    batch = wait_for(c, batch.id)
    assert batch.status == "completed" and batch.completed_at is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    done = [json.loads(x) for x in c.files.content(batch.output_file_id).text.splitlines()]
    assert [d["custom_id"] for d in done] == ["paris", "sky", "seeded"]  # the input's order
    for answer, sent in zip(done, [lines[0], lines[1], lines[3]]):
        want = httpx.post(server.base_url + "/v1/chat/completions", json=sent["body"],
                          headers={"Authorization": "Bearer key-a"}, timeout=60).json()
        assert answer["response"]["status_code"] == 200 and answer["error"] is None
        assert answer["response"]["body"]["choices"] == want["choices"]
    errors = [json.loads(x) for x in c.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"] and errors[0]["response"]["status_code"] == 400
    assert errors[0]["error"]["param"] == "max_tokens"
    assert batch.id in [b.id for b in c.batches.list()]
    assert {uploaded.id, batch.output_file_id, batch.error_file_id} <= {f.id for f in c.files.list()}
    # another key sees none of it
    other = client(server, "key-b")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.output_file_id)
    assert uploaded.id not in {f.id for f in other.files.list()}
    assert c.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(uploaded.id)
    server.wait_idle()


def test_a_bad_file_fails_the_batch_and_bad_requests_are_errors(server):
    c = client(server)
    mixed = c.files.create(file=("mixed.jsonl", io.BytesIO(jsonl([line("a", CHAT), line("b", {"prompt": "hi"},
                                                                                          "/v1/completions")]))),
                           purpose="batch")
    batch = c.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and "custom_id 'b': url '/v1/completions' is not the batch's endpoint" in \
        batch.errors.data[0].message
    broken = c.files.create(file=("broken.jsonl", io.BytesIO(b'{"custom_id": "a"\n')), purpose="batch")
    batch = c.batches.create(input_file_id=broken.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and "line 1: not JSON" in batch.errors.data[0].message
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        c.batches.create(input_file_id=mixed.id, endpoint="/v1/images", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="No such File object: file-nope"):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose must be \"batch\" here"):
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).files.list()


def test_cancelling_a_batch_ends_its_requests(server):
    """Lines long enough to run for minutes: cancel ends them now (the engine holds no block after), keeps what was
    answered, and a cancelled batch cannot be cancelled again."""
    c = client(server)
    long = {"prompt": "Tell me a story.", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    upload = c.files.create(file=("long.jsonl", io.BytesIO(jsonl([line(f"s{i}", long, "/v1/completions")
                                                                  for i in range(4)]))), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.time() + 30
    while metric_values(server.base_url)[("llmserve:num_requests_running", ())] < 4 and time.time() < deadline:
        time.sleep(0.1)
    cancelled = c.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    assert wait_for(c, batch.id, timeout=30).status == "cancelled"
    server.wait_idle(timeout=15)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a batch with status cancelled"):
        c.batches.cancel(batch.id)
