"""Backends for the gateway's tests that llmserve cannot be made to be: an OpenAI-style server that misbehaves on
command (429 with Retry-After, 500, a hang, a slow first token, a stream dropped mid-way, a malformed body, a context
error), and an Anthropic Messages API server (the real one is not reachable from here). Both record what they get."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tests.server_fixtures import free_port


class _Thread:
    def _start(self, app: FastAPI, probe: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                   timeout_graceful_shutdown=1))  # a hung request ends the test at once
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                httpx.get(self.base_url + probe, timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("test backend did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class MisbehavingServer(_Thread):
    """`mode` says what the next requests get:
    ok, status:429 (Retry-After: `retry_after`), status:500, context (400 context_length_exceeded), bad_request (400),
    hang, slow_first (first token after `delay` s), drop_after:N (N tokens then the connection closes), malformed
    (a 200 whose body is not JSON, or a stream event that is not). `tokens` per answer, each " tok"."""

    def __init__(self, mode: str = "ok", tokens: int = 3, delay: float = 0.0, retry_after: str | None = "1",
                 usage: dict | None = None):
        self.mode, self.tokens, self.delay, self.retry_after = mode, tokens, delay, retry_after
        self.usage = usage
        self.received: list[dict] = []
        self.models_status = 200
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            if self.models_status != 200:
                return JSONResponse({"error": {"message": "down"}}, status_code=self.models_status)
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        async def respond(request: Request, chat: bool):
            body = await request.json()
            self.received.append(body)
            mode = self.mode
            if mode.startswith("status:"):
                status = int(mode.split(":")[1])
                headers = {"Retry-After": self.retry_after} if status == 429 and self.retry_after else None
                return JSONResponse({"error": {"message": f"scripted {status}", "type": "x", "param": None, "code": None}},
                                    status_code=status, headers=headers)
            if mode == "context":
                return JSONResponse({"error": {"message": "This model's maximum context length is 100 tokens.",
                                               "type": "BadRequestError", "param": "messages", "code": "context_length_exceeded"}},
                                    status_code=400)
            if mode == "bad_request":
                return JSONResponse({"error": {"message": "temperature must be non-negative", "type": "BadRequestError",
                                               "param": "temperature", "code": None}}, status_code=400)
            if mode == "hang":
                await asyncio.sleep(3600)
            stream = bool(body.get("stream"))
            usage = self.usage or {"prompt_tokens": 11, "completion_tokens": self.tokens, "total_tokens": 11 + self.tokens,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
            if mode == "malformed":
                return PlainTextResponse("data: {not json\n\n" if stream else "<html>oops</html>", status_code=200,
                                         media_type="text/event-stream" if stream else "text/html")
            if not stream:
                await asyncio.sleep(self.delay)
                text = " tok" * self.tokens
                message = {"role": "assistant", "content": text}
                choice = {"index": 0, "message": message, "finish_reason": "stop"} if chat else \
                    {"index": 0, "text": text, "finish_reason": "stop"}
                return {"id": "fake-1", "object": "chat.completion", "created": 0, "model": body.get("model"),
                        "choices": [choice], "usage": usage}
            drop_after = int(mode.split(":")[1]) if mode.startswith("drop_after:") else None

            async def events():
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None}]})}\n\n"
                if mode == "slow_first":
                    await asyncio.sleep(self.delay)
                for i in range(self.tokens):
                    if drop_after is not None and i == drop_after:
                        raise RuntimeError("scripted drop")  # uvicorn cuts the connection mid-body
                    choice = {"index": 0, "delta": {"content": " tok"}, "finish_reason": None} if chat else \
                        {"index": 0, "text": " tok", "finish_reason": None}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    await asyncio.sleep(0.01)
                last = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else {"index": 0, "text": "", "finish_reason": "stop"}
                yield f"data: {json.dumps({'choices': [last]})}\n\n"
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await respond(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await respond(request, False)

        self._start(app, "/models")


class FakeAnthropic(_Thread):
    """Anthropic's Messages API, answering "echo: <last user text>", or a tool_use of the first tool when tool_choice
    is `any` or names a tool. `usage` is what it reports (cache reads apart from input_tokens)."""

    def __init__(self, usage: dict | None = None, api_key: str = "anthropic-secret"):
        self.usage = usage or {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 90,
                               "cache_creation_input_tokens": 0}
        self.api_key = api_key
        self.received: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"data": [{"id": "claude-fake", "type": "model"}]}

        @app.post("/v1/messages")
        async def messages(request: Request):
            if request.headers.get("x-api-key") != self.api_key or not request.headers.get("anthropic-version"):
                return JSONResponse({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}},
                                    status_code=401)
            body = await request.json()
            self.received.append(body)
            last = body["messages"][-1]
            text = "".join(b.get("text", "") for b in last["content"] if b.get("type") == "text")
            choice = body.get("tool_choice") or {}
            tool = None
            if body.get("tools") and choice.get("type") in ("any", "tool"):
                tool = next(t for t in body["tools"] if choice.get("type") == "any" or t["name"] == choice.get("name"))
            if tool:
                content = [{"type": "tool_use", "id": "toolu_1", "name": tool["name"], "input": {"city": "Paris"}}]
                stop = "tool_use"
            else:
                content = [{"type": "text", "text": f"echo: {text}"}]
                stop = "end_turn"
            if not body.get("stream"):
                return {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"], "content": content,
                        "stop_reason": stop, "usage": self.usage}

            async def events():
                def ev(kind, data):
                    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
                start_usage = {k: v for k, v in self.usage.items() if k != "output_tokens"} | {"output_tokens": 1}
                yield ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                                       "usage": start_usage}})
                yield ev("ping", {})
                block = content[0]
                if block["type"] == "text":
                    yield ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    for piece in (block["text"][: len(block["text"]) // 2], block["text"][len(block["text"]) // 2:]):
                        yield ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
                else:
                    yield ev("content_block_start", {"index": 0, "content_block": {"type": "tool_use", "id": block["id"],
                                                                                   "name": block["name"], "input": {}}})
                    args = json.dumps(block["input"])
                    for piece in (args[:5], args[5:]):
                        yield ev("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta", "partial_json": piece}})
                yield ev("content_block_stop", {"index": 0})
                yield ev("message_delta", {"delta": {"stop_reason": stop}, "usage": {"output_tokens": self.usage["output_tokens"]}})
                yield ev("message_stop", {})

            return StreamingResponse(events(), media_type="text/event-stream")

        self._start(app, "/models")
