"""An OpenAI-style streaming server whose timing is scripted by the prompt, to check benchmark figures by hand.

The prompt (or the last user message) is a script: "ttft=0.2 gap=0.05 tokens=5", or "status=429",
"status=500", "usage=0" (no usage chunk), "error_after=2" (an SSE error event after two tokens), "think=3" (the
first three chat tokens are reasoning_content, as a thinking model's).
Each token's text is " tok", one token with the default tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.server_fixtures import free_port

MODEL = "scripted"


def parse_script(text: str) -> dict:
    script = {"ttft": 0.0, "gap": 0.0, "tokens": 1, "status": 200, "usage": 1, "error_after": -1, "think": 0}
    for part in text.split():
        key, _, value = part.partition("=")
        if key in script:
            script[key] = type(script[key])(float(value)) if key in ("ttft", "gap") else int(value)
    return script


def build_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def respond(request: Request, chat: bool):
        body = await request.json()
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        script = parse_script(text.split("\n")[-1] if chat else text)
        state["requests"] += 1
        if script["status"] != 200:
            return JSONResponse({"error": {"message": "scripted refusal", "type": "x", "param": None, "code": None}},
                                status_code=script["status"], headers={"Retry-After": "1"})

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                start = time.perf_counter()
                for i in range(script["tokens"]):
                    # absolute schedule: sleeps do not accumulate drift
                    target = start + script["ttft"] + i * script["gap"]
                    await asyncio.sleep(max(0.0, target - time.perf_counter()))
                    if i == script["error_after"]:
                        yield f"data: {json.dumps({'error': {'message': 'scripted failure'}})}\n\n"
                        return
                    key = "reasoning_content" if i < script["think"] else "content"
                    choice = {"index": 0, "delta": {key: " tok"}} if chat else {"index": 0, "text": " tok"}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if script["usage"]:
                    usage = {"prompt_tokens": 7, "completion_tokens": script["tokens"], "total_tokens": 7 + script["tokens"]}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await respond(request, chat=True)

    return app


class ScriptedServer:
    def __init__(self, tls: dict | None = None, verify=True):
        """tls: uvicorn's ssl_certfile and ssl_keyfile, for HTTPS; verify: what the readiness check trusts."""
        self.state = {"requests": 0, "in_flight": 0, "max_in_flight": 0}
        self.port = free_port()
        self.base_url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port,
                                                    log_level="warning", **(tls or {})))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if httpx.get(self.base_url + "/models", timeout=1, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("scripted server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
