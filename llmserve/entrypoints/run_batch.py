"""`llmserve run-batch`, as vLLM's `vllm run-batch`: a file of requests in OpenAI's Batch API format through the
server's own routes, in this process and without a socket, and a file of their answers in the same format.

    llmserve run-batch -i requests.jsonl -o results.jsonl [engine flags]

Each input line is {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}. Every line is
sent at once (up to --max-concurrency in flight), so the engine batches them as it batches a server's clients; each
answer is {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}, in the input's order. A
request the API refuses is an answer with its status and the OpenAI error object in `error`; a file that is not a
batch (bad JSON, a missing field, a repeated custom_id, a route not run here) is refused before the model loads."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from llmserve.errors import InvalidRequestError

# the routes a batch line may name: OpenAI's batch endpoints, and the pooling routes vLLM's run-batch takes
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank",
              "/score", "/rerank", "/v1/classify", "/classify", "/v1/messages")


class BatchLine(BaseModel):
    """One line of an OpenAI batch input file."""

    model_config = ConfigDict(extra="forbid")
    custom_id: str
    method: str
    url: str
    body: dict


def read_text(source: str) -> str:
    """A local path, "-" (standard input), or an http(s) URL (e.g. a presigned one), as vLLM's -i takes."""
    if source == "-":
        return sys.stdin.read()
    if source.startswith(("http://", "https://")):
        try:
            r = httpx.get(source, timeout=60, follow_redirects=True)
        except httpx.HTTPError as e:
            raise InvalidRequestError(f"cannot read {source}: {e}", "input_file") from None
        if r.status_code != 200:
            raise InvalidRequestError(f"cannot read {source}: HTTP {r.status_code}", "input_file")
        return r.text
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidRequestError(f"cannot read {source}: {e.strerror}", "input_file") from None


def write_text(target: str, text: str) -> None:
    """A local path, "-" (standard output), or an http(s) URL that takes a PUT (a presigned upload URL)."""
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if target.startswith(("http://", "https://")):
        try:
            r = httpx.put(target, content=text.encode(), timeout=60)
        except httpx.HTTPError as e:
            raise InvalidRequestError(f"cannot write {target}: {e}", "output_file") from None
        if r.status_code >= 300:
            raise InvalidRequestError(f"cannot write {target}: HTTP {r.status_code}", "output_file")
        return
    try:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise InvalidRequestError(f"cannot write {target}: {e.strerror}", "output_file") from None


def parse_batch(text: str, source: str) -> list[BatchLine]:
    """Every line checked before anything runs, each error naming its line (as OpenAI validates a batch's file)."""
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{source} line {number}"
        try:
            line = BatchLine.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "the line"
            what = "not JSON" if first["type"] == "json_invalid" else f"{field}: {first['msg']}"
            raise InvalidRequestError(f"{where}: {what} (a line is {{\"custom_id\", \"method\": \"POST\", \"url\", "
                                      "\"body\"}})", "input_file") from None
        if line.method.upper() != "POST":
            raise InvalidRequestError(f"{where}: method must be POST, got {line.method!r}", "input_file")
        if line.url not in BATCH_URLS:
            raise InvalidRequestError(f"{where}: url {line.url!r} is not run here; run-batch runs "
                                      f"{', '.join(BATCH_URLS)}", "input_file")
        if line.custom_id in seen:
            raise InvalidRequestError(f"{where}: custom_id {line.custom_id!r} is repeated; each line's must be "
                                      "unique", "input_file")
        seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise InvalidRequestError(f"{source} has no requests", "input_file")
    return lines


def answer(line: BatchLine, status: int, body) -> dict:
    """OpenAI's batch output line: the body on success; on an error, the status and the error object."""
    ok = status == 200
    request_id = body["id"] if ok and isinstance(body, dict) and isinstance(body.get("id"), str) else \
        f"req_{uuid.uuid4().hex}"  # the API's own id for its answer, where it gave one
    error = None if ok else (body.get("error") if isinstance(body, dict) and "error" in body else
                             {"message": str(body), "type": "server_error", "param": None, "code": None})
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body if ok else None},
            "error": error}


async def run_lines(app, lines: list[BatchLine], concurrency: int, headers: dict | None = None,
                    on_answer=None) -> list[dict]:
    """Each line through the app's route, in this process (headers: the credentials each carries); answers in the
    lines' order. on_answer(index, answer) hears of each as it comes."""
    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None,
                                 headers=headers) as client:
        async def one(index: int, line: BatchLine) -> dict:
            async with gate:
                if line.body.get("stream"):
                    out = answer(line, 400, {"error": {"message": "stream is not supported in a batch: its answer "
                                                       "is written whole", "type": "BadRequestError",
                                                       "param": "stream", "code": None}})
                else:
                    r = await client.post(line.url, json=line.body)
                    try:
                        body = r.json()
                    except ValueError:
                        body = r.text
                    out = answer(line, r.status_code, body)
            if on_answer is not None:
                on_answer(index, out)
            return out

        return list(await asyncio.gather(*(one(i, line) for i, line in enumerate(lines))))


def run_batch(engine_config, server_config, input_file: str, output_file: str, concurrency: int) -> tuple[int, int]:
    """Runs the file; returns (requests, failed)."""
    from tqdm import tqdm

    from llmserve.server.app import create_server

    lines = parse_batch(read_text(input_file), input_file)  # a bad file is refused before the model loads
    app, engine = create_server(engine_config, server_config)
    try:
        with tqdm(total=len(lines), desc="Running batch", unit="req", file=sys.stderr,
                  disable=not sys.stderr.isatty()) as bar:
            results = asyncio.run(run_lines(app, lines, concurrency, on_answer=lambda i, a: bar.update(1)))
    finally:
        engine.shutdown()
    write_text(output_file, "".join(json.dumps(r) + "\n" for r in results))
    return len(results), sum(r["error"] is not None for r in results)
