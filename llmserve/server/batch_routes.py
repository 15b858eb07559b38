"""OpenAI's Files and Batch APIs (/v1/files, /v1/batches), so that a batch pipeline written against OpenAI
(client.files.create, client.batches.create, polling, client.files.content) runs here unchanged. A batch runs in this
server, in the background, each line through the server's own route (entrypoints/run_batch.py: in-process, no
socket, with the creating request's credentials), at most BATCH_CONCURRENCY lines at a time so that interactive
requests keep their turn. Its successful answers are the output file, its failures the error file, as OpenAI's.

Files and batches are kept in memory until deleted or the server stops, each API key seeing only its own."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, Field

from llmserve.entrypoints.run_batch import BatchLine, parse_batch, run_lines
from llmserve.errors import InvalidRequestError
from llmserve.server.errors import APIError
from llmserve.server.pages import cursor_page

MAX_FILE_BYTES = 200 * 2**20  # OpenAI's limit on a batch input file
BATCH_CONCURRENCY = 32  # a batch's lines in flight at once
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOW = 24 * 3600


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


@dataclass
class StoredFile:
    meta: dict
    data: bytes
    owner: str


@dataclass
class Batch:
    meta: dict
    owner: str
    task: asyncio.Task | None = None
    lines: list[BatchLine] = field(default_factory=list)


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def install_batch_routes(app: FastAPI, cfg, check_auth, presented_key) -> None:
    files: dict[str, StoredFile] = {}
    batches: dict[str, Batch] = {}

    async def single_process() -> None:
        if cfg.api_server_count > 1:  # each process would keep its own files and batches: a poll could miss them
            raise APIError(400, "the Files and Batch APIs keep their files in the server's process: they need "
                                "--api-server-count 1")

    guards = [Depends(check_auth), Depends(single_process)]

    def owner_of(raw: Request) -> str:
        """Whose files these are: the API key's digest (every caller is one owner on a server without keys)."""
        return hashlib.sha256(presented_key(raw).encode()).hexdigest()

    def new_file(name: str, purpose: str, data: bytes, owner: str) -> dict:
        meta = {"id": f"file-{uuid.uuid4().hex}", "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": name, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None}
        files[meta["id"]] = StoredFile(meta, data, owner)
        return meta

    def own_file(file_id: str, raw: Request) -> StoredFile:
        f = files.get(file_id)
        if f is None or f.owner != owner_of(raw):
            raise APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")
        return f

    def own_batch(batch_id: str, raw: Request) -> Batch:
        b = batches.get(batch_id)
        if b is None or b.owner != owner_of(raw):
            raise APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")
        return b

    # ---- files ------------------------------------------------------------------------------------------------
    @app.post("/v1/files", dependencies=guards)
    async def upload_file(raw: Request, file: UploadFile = File(...), purpose: str = Form(...)):
        if purpose != "batch":
            raise APIError(400, f"purpose must be \"batch\" here (files feed the Batch API), got {purpose!r}",
                           param="purpose")
        data = await file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise APIError(413, f"the file is larger than {MAX_FILE_BYTES // 2**20} MB", param="file")
        return new_file(file.filename or "upload.jsonl", purpose, data, owner_of(raw))

    @app.get("/v1/files", dependencies=guards)
    async def list_files(raw: Request, purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                         order: Literal["asc", "desc"] = "desc", after: str | None = None):
        mine = [f.meta for f in files.values() if f.owner == owner_of(raw) and purpose in (None, f.meta["purpose"])]
        return cursor_page(mine if order == "asc" else mine[::-1], limit, after, "file")

    @app.get("/v1/files/{file_id}", dependencies=guards)
    async def retrieve_file(file_id: str, raw: Request):
        return own_file(file_id, raw).meta

    @app.get("/v1/files/{file_id}/content", dependencies=guards)
    async def file_content(file_id: str, raw: Request):
        return Response(own_file(file_id, raw).data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", dependencies=guards)
    async def delete_file(file_id: str, raw: Request):
        own_file(file_id, raw)
        del files[file_id]
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches ----------------------------------------------------------------------------------------------
    @app.post("/v1/batches", dependencies=guards)
    async def create_batch(req: CreateBatchRequest, raw: Request):
        if req.endpoint not in BATCH_ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {req.endpoint!r}",
                           param="endpoint")
        source = own_file(req.input_file_id, raw)
        now = int(time.time())
        meta = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": req.endpoint, "errors": None,
                "input_file_id": req.input_file_id, "completion_window": req.completion_window,
                "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
                "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW, "finalizing_at": None,
                "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
                "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
                "metadata": req.metadata}
        batch = Batch(meta, source.owner)
        batches[meta["id"]] = batch
        try:  # the file is checked whole before anything runs, as OpenAI validates it
            text = source.data.decode("utf-8")
            batch.lines = parse_batch(text, source.meta["filename"])
            wrong = next((line for line in batch.lines if line.url != req.endpoint), None)
            if wrong is not None:
                raise InvalidRequestError(f"the line of custom_id {wrong.custom_id!r}: url {wrong.url!r} is not the "
                                          f"batch's endpoint {req.endpoint}", "input_file_id")
        except (InvalidRequestError, UnicodeDecodeError) as e:
            message = e.message if isinstance(e, InvalidRequestError) else "the file is not UTF-8 text"
            meta.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [
                {"code": "invalid_request", "message": message, "param": "input_file_id", "line": None}]})
            return meta
        meta.update(status="in_progress", in_progress_at=int(time.time()))
        meta["request_counts"]["total"] = len(batch.lines)
        forwarded = {k: v for k, v in raw.headers.items() if k in credential_headers()}
        batch.task = asyncio.create_task(run(batch, forwarded))
        return meta

    def credential_headers() -> set[str]:
        """The creating request's headers each line carries: its key, and the tenant header the cache is salted by."""
        names = {"authorization", "x-api-key"}
        if cfg.prefix_cache_salt_from and cfg.prefix_cache_salt_from.startswith("header:"):
            names.add(cfg.prefix_cache_salt_from.split(":", 1)[1].lower())
        return names

    async def run(batch: Batch, headers: dict) -> None:
        meta = batch.meta
        counts = meta["request_counts"]
        answers: dict[int, dict] = {}

        def heard(index: int, answer: dict) -> None:
            answers[index] = answer
            counts["completed" if answer["error"] is None else "failed"] += 1

        failure = None
        try:
            await run_lines(app, batch.lines, BATCH_CONCURRENCY, headers=headers, on_answer=heard)
            meta.update(status="finalizing", finalizing_at=int(time.time()))
        except Exception as e:  # noqa: BLE001 - the batch says what went wrong; the server goes on
            failure = str(e) or type(e).__name__
        finally:  # finished or cancelled: what was answered is kept, in the input's order
            results = [answers[i] for i in sorted(answers)]
            done = [r for r in results if r["error"] is None]
            failed = [r for r in results if r["error"] is not None]
            if done:
                meta["output_file_id"] = new_file(f"{meta['id']}_output.jsonl", "batch_output", jsonl(done),
                                                  batch.owner)["id"]
            if failed:
                meta["error_file_id"] = new_file(f"{meta['id']}_error.jsonl", "batch_output", jsonl(failed),
                                                 batch.owner)["id"]
            ended = "cancelled" if meta["status"] == "cancelling" else "failed" if failure else "completed"
            meta.update(status=ended, **{f"{ended}_at": int(time.time())})
            if failure:
                meta["errors"] = {"object": "list", "data": [{"code": "server_error", "message": failure,
                                                              "param": None, "line": None}]}

    @app.get("/v1/batches/{batch_id}", dependencies=guards)
    async def retrieve_batch(batch_id: str, raw: Request):
        return own_batch(batch_id, raw).meta

    @app.get("/v1/batches", dependencies=guards)
    async def list_batches(raw: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None):
        mine = [b.meta for b in batches.values() if b.owner == owner_of(raw)]
        return cursor_page(mine[::-1], limit, after, "batch")  # newest first, as OpenAI lists them

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=guards)
    async def cancel_batch(batch_id: str, raw: Request):
        batch = own_batch(batch_id, raw)
        if batch.meta["status"] not in ("validating", "in_progress"):
            raise APIError(400, f"Cannot cancel a batch with status {batch.meta['status']}.",
                           param="batch_id")
        batch.meta.update(status="cancelling", cancelling_at=int(time.time()))
        if batch.task is not None:
            batch.task.cancel()  # the lines in flight end, and their engine requests with them
            try:
                await asyncio.wait_for(asyncio.shield(batch.task), timeout=10)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
        return batch.meta
