"""Where benchmark requests go: any OpenAI-compatible server over HTTP, or llmserve's engine in this process.

Both stream and stamp every chunk that carries text, so the figures mean the same thing either way.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp

from llmserve.errors import InvalidRequestError
from llmserve.http_client import TRANSPORT_ERRORS, sse_data


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the level started (perf_counter based)."""

    index: int
    session: int
    turn: int
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # each streamed chunk that carried text (thinking included)
    first_visible: float | None = None  # the first chunk with answer text or a tool call (not reasoning_content)
    done: float | None = None
    status: str = "ok"  # ok | rejected (429/503) | failed
    http_status: int | None = None
    error: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def ttfvt(self) -> float | None:
        """Time to first visible token: what a user waits for when a model thinks before it answers."""
        return self.first_visible - self.sent if self.first_visible is not None else None

    @property
    def e2e(self) -> float | None:
        return self.done - self.sent if self.done is not None else None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for a single output token."""
        if self.status != "ok" or not self.chunk_times or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


class BenchError(InvalidRequestError):
    """A benchmark that cannot start: unreachable server, unknown model."""


class HTTPBackend:
    """An OpenAI-compatible server. The client is aiohttp: at hundreds of streams httpx's CPU per chunk made the client,
    not the server, the limit of what was measured (docs/benchmarks.md, "The benchmark's client")."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None, timeout: float, extra_body: dict,
                 endpoint: str | None = None):
        """endpoint "embeddings": each prompt goes to /embeddings (an embedding server); otherwise a prompt goes to
        /completions and messages to /chat/completions."""
        self.base_url = base_url.rstrip("/")
        self.extra_body = extra_body
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no limit on a whole stream, only on connecting and on the silence between two reads
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, timeout), sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None  # made in start(), on the event loop that uses it
        self.model = model

    async def start(self) -> str:
        """Checks the server is there and serves the model; picks the first model when none is named."""
        self.session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout,
                                             connector=aiohttp.TCPConnector(limit=0))  # a connection per stream
        try:
            async with self.session.get(self.base_url + "/models") as r:
                status, body = r.status, await r.read()
        except TRANSPORT_ERRORS as e:
            raise BenchError(f"cannot reach {self.base_url}: {_reason(e)}", "base_url") from None
        if status == 401:
            raise BenchError(f"{self.base_url} refused the API key (401); pass --api-key", "api_key")
        if status != 200:
            raise BenchError(f"{self.base_url}/models answered HTTP {status}; is this an OpenAI-compatible /v1 URL?", "base_url")
        try:
            served = [m["id"] for m in json.loads(body)["data"]]
        except (ValueError, KeyError, TypeError):
            raise BenchError(f"{self.base_url}/models did not return an OpenAI model list", "base_url") from None
        if self.model is None:
            if not served:
                raise BenchError(f"{self.base_url} serves no models", "model")
            self.model = served[0]
        elif self.model not in served:
            raise BenchError(f"model {self.model!r} is not served at {self.base_url} (it serves: {', '.join(served) or 'nothing'})", "model")
        return self.model

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def spec_counters(self) -> dict | None:
        """Speculative-decoding counters from the server's Prometheus /metrics (llmserve's or vLLM's names)."""
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        try:
            async with self.session.get(root + "/metrics") as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except TRANSPORT_ERRORS:
            return None
        return parse_spec_counters(text)

    async def send(self, rec: RequestRecord, prompt: str | None, messages: list[dict] | None, max_tokens: int, clock) -> None:
        if self.endpoint == "embeddings":
            return await self._embed(rec, prompt, clock)
        body = {"model": self.model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **self.extra_body}
        if messages is not None:
            path, body["messages"] = "/chat/completions", messages
        else:
            path, body["prompt"] = "/completions", prompt
        rec.sent = clock()
        try:
            async with self.session.post(self.base_url + path, json=body) as r:
                rec.http_status = r.status
                if r.status != 200:
                    rec.status = "rejected" if r.status in (429, 503) else "failed"
                    rec.error = _error_message(r.status, await r.read())
                    rec.done = clock()
                    return
                async for data in sse_data(r.content):
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.status, rec.error = "failed", str(chunk["error"].get("message", chunk["error"]))
                        break
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        rec.input_tokens, rec.output_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
                        rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        piece = choice.get("text") if "text" in choice else delta.get("content")
                        # vLLM and llmserve send reasoning_content; some servers name it reasoning
                        thinking = delta.get("reasoning_content") or delta.get("reasoning")
                        if piece or thinking or delta.get("tool_calls"):
                            now = clock()
                            rec.chunk_times.append(now)
                            if rec.first_visible is None and (piece or delta.get("tool_calls")):
                                rec.first_visible = now
                            rec.text += piece or ""
            rec.done = clock()
            if rec.status == "ok" and not rec.chunk_times:
                rec.status, rec.error = "failed", "the stream carried no tokens"
        except TRANSPORT_ERRORS as e:
            rec.status, rec.error, rec.done = "failed", _reason(e), clock()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            rec.status, rec.error, rec.done = "failed", f"malformed stream: {e}", clock()


    async def _embed(self, rec: RequestRecord, prompt: str, clock) -> None:
        """One /embeddings request: nothing streams, so the request's one time is its end (E2E); no output tokens.
        base64, as the openai SDK asks, so that the client's JSON parsing is not what is measured."""
        rec.sent = clock()
        try:
            async with self.session.post(self.base_url + "/embeddings", json={
                    "model": self.model, "input": prompt, "encoding_format": "base64"}) as r:
                rec.http_status, raw = r.status, await r.read()
            rec.done = clock()
            if rec.http_status != 200:
                rec.status = "rejected" if rec.http_status in (429, 503) else "failed"
                rec.error = _error_message(rec.http_status, raw)
                return
            body = json.loads(raw)
            if not body["data"] or not body["data"][0]["embedding"]:
                rec.status, rec.error = "failed", "the answer carried no embedding"
            rec.input_tokens, rec.output_tokens = body["usage"]["prompt_tokens"], 0
        except TRANSPORT_ERRORS as e:
            rec.status, rec.error, rec.done = "failed", _reason(e), clock()
        except (ValueError, KeyError, TypeError, IndexError) as e:
            rec.status, rec.error, rec.done = "failed", f"malformed answer: {e}", clock()


class EngineBackend:
    """llmserve's engine in this process, no HTTP: what the engine alone delivers."""

    def __init__(self, engine_config, ignore_eos: bool, temperature: float):
        from llmserve.engine.llm_engine import LLMEngine
        from llmserve.server.async_engine import AsyncEngine

        self.engine = AsyncEngine(lambda: LLMEngine(engine_config))  # loaded in the thread that steps it
        self.llm = self.engine.engine
        self.ignore_eos, self.temperature = ignore_eos, temperature
        self.model = self.llm.model_name
        self._n = 0

    async def start(self) -> str:
        return self.model

    async def close(self) -> None:
        self.engine.shutdown()

    async def spec_counters(self) -> dict | None:
        spec = self.llm.speculator.stats if self.llm.speculator is not None else None
        if spec is None:
            return None
        return {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens, "accepted": spec.num_accepted_tokens,
                "per_position": {str(i): v for i, v in enumerate(spec.accepted_per_position)}}

    async def send(self, rec: RequestRecord, prompt: str | None, messages: list[dict] | None, max_tokens: int, clock) -> None:
        from llmserve.errors import LLMServeError
        from llmserve.sampling_params import SamplingParams

        tok = self.llm.tokenizer
        rec.sent = clock()
        try:
            if messages is not None:
                ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
            else:
                ids = tok.encode(prompt)
            if self.llm.runner == "pooling":  # an embedding engine: one output, the vector
                from llmserve.pooling_params import PoolingParams

                self._n += 1
                async for out in self.engine.generate(f"bench-{self._n}", ids, PoolingParams()):
                    pass
                rec.input_tokens, rec.output_tokens, rec.cached_tokens = len(ids), 0, out.num_cached_tokens
                rec.done = clock()
                return
            params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, ignore_eos=self.ignore_eos)
            self._n += 1
            seen = 0
            async for out in self.engine.generate(f"bench-{self._n}", ids, params):
                c = out.outputs[0]
                if len(c.token_ids) > seen:
                    seen = len(c.token_ids)
                    rec.chunk_times.append(clock())
                    rec.first_visible = rec.first_visible or rec.chunk_times[-1]  # no reasoning parser in-process
                    rec.text += c.delta_text
            rec.input_tokens, rec.output_tokens = len(ids), seen
            rec.cached_tokens = out.num_cached_tokens
        except LLMServeError as e:
            rec.status, rec.error, rec.http_status = ("rejected" if e.status_code in (429, 503) else "failed"), e.message, e.status_code
        rec.done = clock()


def parse_spec_counters(text: str) -> dict | None:
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
    seen = False
    for line in text.splitlines():
        if line.startswith("#") or ":spec_decode_num_" not in line:
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split(":spec_decode_num_", 1)[1]
        try:
            v = float(value)
        except ValueError:
            continue
        seen = True
        if metric.startswith("drafts_total"):
            out["drafts"] += v
        elif metric.startswith("draft_tokens_total"):
            out["draft_tokens"] += v
        elif metric.startswith("accepted_tokens_per_pos_total"):
            pos = metric.split('position="', 1)[1].split('"', 1)[0]
            out["per_position"][pos] = out["per_position"].get(pos, 0.0) + v
        elif metric.startswith("accepted_tokens_total"):
            out["accepted"] += v
    return out if seen else None


def _reason(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return (f"its TLS certificate is not trusted ({e.certificate_error.reason or e.certificate_error}); for a "
                "private CA set SSL_CERT_FILE to its certificate")
    if isinstance(e, aiohttp.ClientSSLError):
        return f"the TLS handshake failed ({e})"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "connection refused or host unreachable"
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timed out"
    return str(e) or type(e).__name__


def _error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"
