"""Talking to one backend: an OpenAI-compatible server (llmserve, vLLM, llama-server, hosted APIs) or Anthropic's
Messages API, both seen by the gateway as OpenAI-shaped responses and chunks. Every way a backend can fail becomes
an UpstreamFailure that says whether another backend may be tried. Messages never carry the backend's URL or key.

The client is aiohttp rather than httpx: on the gateway's path it costs 0.4-0.5 ms of CPU per request against httpx's
2-5 ms (measured on this project's 2-core CI machine, docs/benchmarks.md), and that CPU is the gateway's latency."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import AsyncIterator

import aiohttp

from llmserve.gateway import anthropic
from llmserve.gateway.config import BackendConfig
from llmserve.http_client import TRANSPORT_ERRORS, sse_data, sse_events


class UpstreamFailure(Exception):
    """reason: connect, timeout, rate_limited, server_error, context_length, malformed, dropped, unsupported or
    client_error. A retryable one sends the request on to the next backend (only before its first token)."""

    def __init__(self, reason: str, message: str, status: int = 502, retryable: bool = True, retry_after: float | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.reason, self.message, self.status, self.retryable = reason, message, status, retryable
        self.retry_after, self.param, self.code = retry_after, param, code


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # an HTTP date
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _error_fields(status: int, raw: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) from an OpenAI or Anthropic error body, or a plain description."""
    try:
        body = json.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            code = err.get("code")
            if body.get("type") == "error":  # Anthropic's envelope: the error's type is its code
                code = err.get("type")
            return (str(err.get("message") or err.get("type") or status), err.get("param"),
                    code if isinstance(code, str) else None)
    except ValueError:
        pass
    return f"HTTP {status}", None, None


def classify(name: str, status: int, headers, raw: bytes) -> UpstreamFailure:
    message, param, code = _error_fields(status, raw)
    if status == 429:
        return UpstreamFailure("rate_limited", f"backend {name} is rate limited: {message}", 429,
                               retry_after=_retry_after(headers.get("retry-after")))
    if status >= 500:
        return UpstreamFailure("server_error", f"backend {name} failed (HTTP {status}): {message}", 502)
    lowered = message.lower()
    if code == "context_length_exceeded" or "context length" in lowered or "prompt is too long" in lowered:
        return UpstreamFailure("context_length", message, 400, param=param or "messages", code="context_length_exceeded")
    if status == 404 and code in ("response_not_found", "previous_response_not_found"):  # the client's id, not set-up
        return UpstreamFailure("client_error", message, 404, retryable=False, param=param, code=code)
    if status in (401, 403, 404):  # the gateway's own set-up is wrong for this backend (its key, its model name)
        return UpstreamFailure("server_error", f"backend {name} refused the request (HTTP {status}): {message}", 502)
    # the request itself is wrong: the client gets the backend's words, and no other backend is tried
    return UpstreamFailure("client_error", message, status, retryable=False, param=param, code=code)


def _transport(name: str, e: BaseException, before_response: bool) -> UpstreamFailure:
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamFailure("timeout", f"backend {name} timed out", 504)
    if before_response and isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamFailure("connect", f"cannot connect to backend {name}", 502)
    return UpstreamFailure("dropped" if not before_response else "connect",
                           f"backend {name} closed the connection ({type(e).__name__})", 502)


class Upstream:
    """An OpenAI-compatible backend; AnthropicUpstream overrides the request, response and stream shapes."""

    def __init__(self, name: str, config: BackendConfig, timeout: float):
        self.name, self.config = name, config
        self.session: aiohttp.ClientSession | None = None  # the gateway's, set when it starts
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(10.0, timeout))
        # a stream has no total limit, only one on the silence between two reads
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, timeout), sock_read=timeout)

    def headers(self) -> dict:
        key = self.config.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def request(self, kind: str, body: dict) -> tuple[str, dict]:
        """The path and body to send for a gateway request of `kind` (chat or completions)."""
        return ("/chat/completions" if kind == "chat" else "/completions"), body

    def response(self, data: dict) -> dict:
        return data

    def translator(self):
        return None

    async def probe(self) -> bool:
        """Alive: it answers its model list (any answer short of a 5xx or a 429 proves the server is up)."""
        try:
            async with self.session.get(self.config.url + "/models", headers=self.headers(),
                                        timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status < 500 and r.status != 429
        except TRANSPORT_ERRORS:
            return False

    async def complete(self, kind: str, body: dict) -> dict:
        path, payload = self.request(kind, body)
        data = await self.forward("POST", path, payload)
        try:
            if "error" in data:
                raise ValueError("not a completion")
            return self.response(data)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UpstreamFailure("malformed", f"backend {self.name} sent a malformed response", 502) from None

    async def _open_stream(self, path: str, body: dict) -> aiohttp.ClientResponse:
        """The backend's streamed answer, its status checked (the caller closes it)."""
        try:
            response = await self.session.post(self.config.url + path, json=body, headers=self.headers(),
                                               timeout=self.stream_timeout)
        except TRANSPORT_ERRORS as e:
            raise _transport(self.name, e, True) from None
        if response.status != 200:
            try:
                raise classify(self.name, response.status, response.headers, await response.read())
            finally:
                response.close()
        return response

    async def stream(self, kind: str, body: dict) -> AsyncIterator[dict]:
        """The backend's stream as OpenAI chunk objects, ending with a usage chunk when the backend sends one."""
        path, payload = self.request(kind, body)
        response = await self._open_stream(path, payload)
        translator = self.translator()
        finished = False
        try:
            async for data in sse_data(response.content):
                if data == b"[DONE]":
                    finished = True
                    break
                try:
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise ValueError
                except ValueError:
                    raise UpstreamFailure("malformed", f"backend {self.name} sent a malformed stream event", 502) from None
                if translator is None:
                    if "error" in event:
                        err = event["error"] if isinstance(event["error"], dict) else {}
                        raise UpstreamFailure("server_error", f"backend {self.name} failed mid-stream: "
                                                              f"{err.get('message', 'error event')}", 502)
                    yield event
                else:
                    try:
                        chunks = translator.feed(event)
                    except anthropic.StreamError as e:
                        raise UpstreamFailure("server_error", f"backend {self.name} failed mid-stream: {e}", 502) from None
                    for chunk in chunks:
                        yield chunk
                    if event.get("type") == "message_stop":
                        finished = True
                        break
            if not finished:
                raise UpstreamFailure("dropped", f"backend {self.name} ended the stream early", 502)
        except TRANSPORT_ERRORS as e:
            raise _transport(self.name, e, False) from None
        finally:
            response.close()


    # ---- the Responses and Messages APIs, passed through as they are ------------------------------------------
    def api_path(self, api: str) -> str:
        """Where this backend serves `api` (responses, messages, embeddings, classify, score or rerank): OpenAI-compatible
        servers may serve them all (llmserve and vLLM do; a backend that answers 404 is passed over)."""
        return f"/{api}"

    async def forward(self, method: str, path: str, body: dict | None = None) -> dict:
        """One request passed through (POST with a body, or GET/DELETE of a stored response): the backend's JSON."""
        try:
            async with self.session.request(method, self.config.url + path, json=body, headers=self.headers(),
                                            timeout=self.timeout) as r:
                raw = await r.read()
                status, headers = r.status, r.headers
        except TRANSPORT_ERRORS as e:
            raise _transport(self.name, e, True) from None
        if status != 200:
            raise classify(self.name, status, headers, raw)
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError
            return data
        except ValueError:
            raise UpstreamFailure("malformed", f"backend {self.name} sent a malformed response", 502) from None

    async def forward_stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """A stream passed through: each event's data (whose `type` names it, in both APIs). It ends at the API's
        last event; a stream that stops before it has been cut."""
        response = await self._open_stream(path, body)
        finished = False
        try:
            async for name, data in sse_events(response.content):
                try:
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise ValueError
                except ValueError:
                    raise UpstreamFailure("malformed", f"backend {self.name} sent a malformed stream event", 502) from None
                event.setdefault("type", name)
                if event["type"] == "error":
                    err = event.get("error") if isinstance(event.get("error"), dict) else {}
                    raise UpstreamFailure("server_error", f"backend {self.name} failed mid-stream: "
                                                          f"{err.get('message', 'error event')}", 502)
                yield event
                if event["type"] in LAST_EVENTS:
                    finished = True
                    break
            if not finished:
                raise UpstreamFailure("dropped", f"backend {self.name} ended the stream early", 502)
        except TRANSPORT_ERRORS as e:
            raise _transport(self.name, e, False) from None
        finally:
            response.close()


# the events that end a Responses or a Messages stream
LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed", "message_stop")


class AnthropicUpstream(Upstream):
    VERSION = "2023-06-01"

    def headers(self) -> dict:
        key = self.config.api_key()
        h = {"anthropic-version": self.VERSION}
        if key:
            h["x-api-key"] = key
        return h

    def request(self, kind: str, body: dict) -> tuple[str, dict]:
        if kind != "chat":
            raise UpstreamFailure("unsupported", "the Anthropic Messages API has no text completions; use /v1/chat/completions",
                                  400, param="prompt")
        try:
            return "/messages", anthropic.chat_request(body, self.config.model, self.config.max_tokens_default)
        except anthropic.Untranslatable as e:
            raise UpstreamFailure("unsupported", str(e), 400, param=e.param) from None

    def response(self, data: dict) -> dict:
        if data.get("type") != "message":
            raise ValueError("not a message")
        return anthropic.chat_response(data, self.config.model)

    def translator(self):
        return anthropic.StreamTranslator(self.config.model)

    def api_path(self, api: str) -> str:
        if api != "messages":
            what = {"responses": "Responses API", "embeddings": "embeddings API"}.get(api, f"{api} API")
            raise UpstreamFailure("unsupported", f"an Anthropic backend has no {what}", 400, param="input")
        return "/messages"


def make_upstream(name: str, config: BackendConfig, timeout: float) -> Upstream:
    return (AnthropicUpstream if config.api == "anthropic" else Upstream)(name, config, timeout)
