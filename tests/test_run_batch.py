"""`llmserve run-batch` (vLLM's): an OpenAI Batch API file through the server's routes, as a user runs it (a real
subprocess, the default model, a real HTTP server for URL input and output); the answers are what the server gives
for the same requests; a bad file is a one-line error before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.server_fixtures import RunningServer

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 10,
        "temperature": 0}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "two", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": ["1, 2, 3,", "The sky is"], "max_tokens": 6, "temperature": 0}},
    {"custom_id": "seeded", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "seed": 7}},
    {"custom_id": "bad-max", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": -1}},
    {"custom_id": "no-model", "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, "model": "nope"}},
    {"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, "stream": True}},
]


class FileHost(BaseHTTPRequestHandler):
    """A bucket on 127.0.0.1: GET gives the stored file, PUT stores one (as a presigned URL would)."""

    files: dict[str, bytes] = {}

    def do_GET(self):
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self):
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def llmserve(*args, **kw):
    return subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True, timeout=300, **kw)


def test_a_batch_file_runs_and_answers_as_the_server_does(tmp_path, shallow_gguf, shallow_files):
    host = ThreadingHTTPServer(("127.0.0.1", 0), FileHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{host.server_address[1]}"
    FileHost.files["/in.jsonl"] = "".join(json.dumps(line) + "\n\n" for line in LINES).encode()
    try:
        r = llmserve("run-batch", "-i", url + "/in.jsonl", "-o", url + "/out.jsonl", "--model", shallow_gguf, "--dtype", "float32",
                     "--served-model-name", "test-model", "--kv-cache-memory", "256MiB")
        assert r.returncode == 0, r.stderr
        assert f"llmserve: 6 requests, 3 failed; answers in {url}/out.jsonl" in r.stderr
        answers = [json.loads(line) for line in FileHost.files["/out.jsonl"].decode().splitlines()]
    finally:
        host.shutdown()
    assert [a["custom_id"] for a in answers] == [line["custom_id"] for line in LINES]
    assert len({a["id"] for a in answers}) == 6
    server = RunningServer(shallow_files, {}, {})
    try:
        for line, got in zip(LINES[:3], answers[:3]):
            want = httpx.post(server.base_url + line["url"], json=line["body"], timeout=60).json()
            body = got["response"]["body"]
            assert got["response"]["status_code"] == 200 and got["error"] is None
            assert got["response"]["request_id"] == body["id"]
            assert body["choices"] == want["choices"] and body["usage"] == want["usage"]
            assert body["model"] == "test-model"
    finally:
        server.stop()
    failed = {a["custom_id"]: (a["response"]["status_code"], a["response"]["body"], a["error"]) for a in answers[3:]}
    assert failed["bad-max"][:2] == (400, None) and failed["bad-max"][2]["param"] == "max_tokens"
    assert failed["no-model"][:2] == (404, None) and failed["no-model"][2]["code"] == "model_not_found"
    assert failed["streamed"][0] == 400 and "stream is not supported in a batch" in failed["streamed"][2]["message"]


@pytest.mark.parametrize("content, message", [
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n{"custom_id": ', "line 2: not JSON"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {}}', "line 1: method: Field required"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/models", "body": {}}', "line 1: method must be POST"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/images", "body": {}}', "line 1: url '/v1/images' is not run here"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
     '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}', "line 2: custom_id 'a' is repeated"),
    ("\n\n", "has no requests"),
])
def test_a_bad_batch_file_is_one_line_before_the_model_loads(tmp_path, capsys, content, message):
    from llmserve.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text(content)
    # a model path that does not exist: the file's error must come first
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", "/nowhere.gguf"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out.jsonl").exists()


def test_an_unreadable_input_is_one_line(tmp_path, capsys):
    from llmserve.cli import main

    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", "-"]) == 2
    assert "error: cannot read" in capsys.readouterr().err
