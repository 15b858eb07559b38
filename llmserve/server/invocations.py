"""SageMaker's serving contract, as vLLM serves it: `GET /ping` (the container's health check; POST too) and `POST
/invocations` (every inference request, whatever its kind). An invocation goes to the route that answers a body of
its shape, with its headers (credentials included) and its body as sent, streaming as that route streams: it is the
same request at another path. An ASGI wrapper, so that nothing about the target route changes."""

from __future__ import annotations

import json

from llmserve.server import errors

SHAPES = ("messages (chat completions, or embeddings on a pooling model), prompt (completions), query with documents "
          "(rerank), text_1/queries (score), input (responses, or embeddings / classify on a pooling model)")


def invocation_route(body: dict, task: str) -> str | None:
    """The route for an invocation's body on an engine of this task ("generate", "embed", "classify")."""
    if "messages" in body:
        return "/v1/chat/completions" if task == "generate" else "/v1/embeddings"
    if "prompt" in body:
        return "/v1/completions"
    if "query" in body and "documents" in body:
        return "/rerank"
    if "text_1" in body or "queries" in body:
        return "/score"
    if "input" in body:
        return {"generate": "/v1/responses", "embed": "/v1/embeddings", "classify": "/classify"}[task]
    return None


class SageMakerRoutes:
    def __init__(self, app, task: str):
        self.app, self.task = app, task

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        root, path = scope.get("root_path", ""), scope["path"]
        if root and path.startswith(root):  # behind --root-path: routes match what follows it
            path = path[len(root):]
        if path == "/ping":
            await self.app(at(scope, "/health", method="GET"), receive, send)
            return
        if path != "/invocations" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None
        target = invocation_route(fields, self.task) if isinstance(fields, dict) else None
        if target is None:
            what = "a JSON object" if not isinstance(fields, dict) else "a body of a known shape"
            response = errors.error_response(400, f"/invocations takes {what}: one with {SHAPES}")
            await response(scope, receive, send)
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, as the target route would see it

        await self.app(at(scope, target), replay, send)


def at(scope: dict, route: str, **changes) -> dict:
    """The request's scope at another route (under the same root path, where its path carries one)."""
    root = scope.get("root_path", "")
    path = root + route if root and scope["path"].startswith(root) else route
    return {**scope, "path": path, "raw_path": path.encode(), **changes}
