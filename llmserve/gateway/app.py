"""`llmserve gateway`: one OpenAI-compatible front for many backends. A request names a model; the model's config
says which backends may serve it (a group, load-balanced), which to fall back to, and what to do with its parameters.
The gateway tries backends in order until one starts answering, and never moves a request once its first token has
reached the client."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve.errors import InvalidRequestError
from llmserve.gateway.cache import ResponseCache, cache_key, cacheable
from llmserve.gateway.config import GatewayConfig, ModelConfig, ParamPolicy
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.routing import BackendState, Router, prompt_affinity_key
from llmserve.gateway.upstream import LAST_EVENTS, UpstreamFailure, make_upstream
from llmserve.plan.pricing import price_tokens
from llmserve.server import errors
from llmserve.server.errors import APIError
from llmserve.webui import mount_webui

logger = logging.getLogger(__name__)

# service_tier values (OpenAI's, and the tier names themselves) -> the gateway's latency tiers
SERVICE_TIERS = {"fast": "fast", "priority": "fast", "standard": "standard", "default": "standard", "auto": "standard",
                 "batch": "batch", "flex": "batch"}
TIER_HEADER = "x-llmserve-tier"
CHARS_PER_TOKEN = 4  # a rough prompt size for the context-window check before sending; a backend's own 400 backs it up


def key_id(key: str) -> str:
    """How an API key appears in metrics and cache keys: never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def apply_policy(policy: ParamPolicy, body: dict) -> dict:
    for name in policy.reject:
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported by this model", param=name, code="unsupported_parameter")
    out = {k: v for k, v in body.items() if k not in policy.drop}
    for old, new in policy.rename.items():
        if old in out:
            value = out.pop(old)
            if value is not None:
                out[new] = value
    return out


def carries_token(chunk: dict) -> bool:
    """Whether a chunk shows the client part of the answer (after which the request can no longer move)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
        if choice.get("finish_reason") is not None:
            return True
    return False


def estimated_prompt_tokens(body: dict) -> int:
    if "messages" in body:
        chars = 0
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            chars += len(content or "") + 8
        return math.ceil(chars / CHARS_PER_TOKEN)
    prompt = body.get("prompt") or ""
    if isinstance(prompt, str):
        return math.ceil(len(prompt) / CHARS_PER_TOKEN)
    if all(isinstance(p, str) for p in prompt):  # several prompts: the longest decides
        return math.ceil(max(map(len, prompt)) / CHARS_PER_TOKEN)
    if all(isinstance(p, list) for p in prompt):  # token ids, several prompts
        return max(map(len, prompt))
    return len(prompt)  # token ids


# the first events of a Responses or Messages stream that show the client part of the answer
TOKEN_EVENTS = ("response.output_text.delta", "response.function_call_arguments.delta",
                "response.reasoning_text.delta", "content_block_delta", *LAST_EVENTS)
STORED_RESPONSE_IDS = 100_000  # the stored responses whose backend the gateway remembers (oldest forgotten first)


def chat_view(api: str, body: dict) -> dict:
    """A Responses, Messages or pooling (embeddings, classify, score, rerank) request as chat messages: what routing reads (prefix affinity, the context
    check)."""
    if api in ("embeddings", "classify", "score", "rerank"):
        given = next((body[k] for k in ("input", "messages", "text_1", "query") if body.get(k) is not None), None)
        return {"messages": [{"role": "user", "content": given if isinstance(given, str) else json.dumps(given)}],
                "max_tokens": 1}
    if api == "messages":
        system = body.get("system")
        head = [{"role": "system", "content": system if isinstance(system, str) else json.dumps(system)}] if system else []
        return {"messages": head + list(body.get("messages") or []), "max_tokens": body.get("max_tokens")}
    given = body.get("input")
    head = [{"role": "system", "content": body["instructions"]}] if isinstance(body.get("instructions"), str) else []
    return {"messages": head + [{"role": "user", "content": given if isinstance(given, str) else json.dumps(given)}],
            "max_tokens": body.get("max_output_tokens")}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_counts(api: str, usage: dict) -> tuple[int, int, int]:
    """(prompt tokens with the cached ones, cached tokens, completion tokens) from an API's usage object."""
    if api == "responses":
        return (usage.get("input_tokens") or 0, (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0,
                usage.get("output_tokens") or 0)
    if api == "messages":
        cached = usage.get("cache_read_input_tokens") or 0
        return (usage.get("input_tokens") or 0) + cached, cached, usage.get("output_tokens") or 0
    # (rerank answers count total_tokens only: all of them are read, none written)
    return (usage.get("prompt_tokens", usage.get("total_tokens")) or 0,
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            usage.get("completion_tokens") or 0)


class Gateway:
    def __init__(self, config: GatewayConfig, api_keys: list[str]):
        self.config, self.api_keys = config, api_keys
        self.metrics = GatewayMetrics()
        self.states = {name: BackendState(name, b) for name, b in config.backends.items()}
        self.router = Router(config, self.states)
        self.cache = ResponseCache(config.cache)
        self.upstreams = {name: make_upstream(name, b, config.request_timeout) for name, b in config.backends.items()}
        self.session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        # stored responses (Responses API): id -> (backend that holds it, the model name the client used)
        self.response_owners: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()

    def remember(self, response: dict, model: str, backend: str) -> None:
        if response.get("store", True) and isinstance(response.get("id"), str):
            self.response_owners[response["id"]] = (backend, model)
            self.response_owners.move_to_end(response["id"])
            while len(self.response_owners) > STORED_RESPONSE_IDS:
                self.response_owners.popitem(last=False)

    def passed_through(self, api: str, data: dict, model: str, backend: str, tenant: str) -> None:
        """A Responses or Messages answer on its way back: the client's model name, its price, its owner."""
        data["model"] = model
        self.price(backend, data.get("usage"), tenant, api)
        if api == "responses":
            self.remember(data, model, backend)

    # ---- health -------------------------------------------------------------------------------------
    def failed(self, backend: str, failure: UpstreamFailure) -> None:
        state = self.states[backend]
        self.metrics.failures.labels(backend, failure.reason).inc()
        if failure.reason == "rate_limited":
            wait = failure.retry_after if failure.retry_after is not None else self.config.health.default_retry_after
            state.cool_down(wait)
            self.metrics.cooldowns.labels(backend, "rate_limited").inc()
        elif failure.reason in ("connect", "timeout", "server_error", "dropped", "malformed"):
            if state.record_failure(self.config.health.failures_to_trip, self.config.health.cooldown):
                self.metrics.cooldowns.labels(backend, "tripped").inc()
                logger.warning("backend %s tripped after %d failures; cooling down %.0f s", backend, state.failures,
                               self.config.health.cooldown)

    async def probe_loop(self) -> None:
        """Tripped backends whose cooldown is over are probed; one that answers is used again."""
        while True:
            await asyncio.sleep(self.config.health.probe_interval)
            now = time.monotonic()
            due = [s for s in self.states.values() if s.tripped and now >= s.cooldown_until and not s.probing]
            for state in due:
                state.probing = True
            results = await asyncio.gather(*(self.upstreams[s.name].probe() for s in due))
            for state, alive in zip(due, results):
                state.probing = False
                if alive:
                    logger.info("backend %s answers again", state.name)
                    state.record_success()
                else:
                    state.cool_down(self.config.health.cooldown)

    def refresh_gauges(self) -> None:
        now = time.monotonic()
        for name, state in self.states.items():
            self.metrics.up.labels(name).set(1 if state.available(now) else 0)
            self.metrics.outstanding.labels(name).set(state.outstanding)

    # ---- a request ------------------------------------------------------------------------------------
    def candidates(self, model: str, mcfg: ModelConfig, tier: str, body: dict, skipped: list):
        """Backends in the order to try: the tier's group (or the targets), then each fallback group; inside a group,
        the route's order over backends that are not cooling down. Each backend at most once."""
        tried: set[str] = set()
        affinity = prompt_affinity_key(body, self.config.affinity_chars) if mcfg.route == "prefix-affinity" else ""
        needed = estimated_prompt_tokens(body) + int(body.get("max_completion_tokens") or body.get("max_tokens") or 0)
        for group in mcfg.groups(tier):
            for backend in self.router.order(mcfg.route, group, affinity):
                if backend in tried:
                    continue
                tried.add(backend)
                limit = self.config.backends[backend].max_context
                if limit is not None and needed > limit:
                    skipped.append((backend, "context_length"))
                    self.metrics.fallbacks.labels(model, backend, "context_length").inc()
                    continue
                yield backend

    def upstream_body(self, backend: str, mcfg: ModelConfig, tier: str, body: dict, stream: bool) -> dict:
        bcfg = self.config.backends[backend]
        out = apply_policy(bcfg.params, body) if not bcfg.params.empty else dict(body)
        out["model"] = bcfg.model
        if stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}  # the gateway prices every request
        if bcfg.priorities and "priority" not in out:
            out["priority"] = self.config.tier_priorities.get(tier, 0)
        return out

    def price(self, backend: str, usage: dict | None, tenant: str, api: str = "chat") -> None:
        """Adds the cost to a response's usage and to the per-backend, per-key counter. The usage is in the API's
        own terms: chat's and Responses' count cached tokens inside the prompt's, Messages' apart."""
        price = self.config.backends[backend].price
        if not usage:
            return
        if price is not None:
            prompt, cached, completion = usage_counts(api, usage)
            try:
                cost = price_tokens(price.model_copy(update={"convention": "openai"}), prompt, cached, completion)
            except InvalidRequestError:  # a backend whose usage does not add up: the answer stands, unpriced
                logger.warning("backend %s reported more cached than prompt tokens; not priced", backend)
                return
            usage["cost"] = cost.total
            usage["cost_details"] = {**cost.as_usage_details(), "basis": "price_table"}
        if isinstance(usage.get("cost"), (int, float)):
            self.metrics.cost.labels(backend, tenant).inc(usage["cost"])


def build_gateway_app(config: GatewayConfig, api_keys: list[str] | None = None, webui: bool = True) -> FastAPI:
    gw = Gateway(config, list(api_keys or []))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # one connection pool for every backend, made in the server's event loop
        gw.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        for upstream in gw.upstreams.values():
            upstream.session = gw.session
        gw._prober = asyncio.create_task(gw.probe_loop())
        try:
            yield
        finally:
            gw._prober.cancel()
            await gw.session.close()

    app = FastAPI(title="llmserve gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gw
    errors.install(app)

    def tenant_of(raw: Request) -> str:
        if not gw.api_keys:
            return "anonymous"
        header = raw.headers.get("authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else raw.headers.get("x-api-key", "")
        for key in gw.api_keys:  # OpenAI's clients send Authorization: Bearer, Anthropic's x-api-key
            if hmac.compare_digest(given.encode(), key.encode()):
                return key_id(key)
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    async def json_body(raw: Request) -> dict:
        try:
            body = json.loads(await raw.body())
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def resolve(body: dict, kind: str) -> tuple[str, ModelConfig]:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise APIError(400, "model is required", param="model")
        mcfg = config.models.get(name)
        if mcfg is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        if kind == "chat" and not (isinstance(body.get("messages"), list) and body["messages"]):
            raise APIError(400, "messages must be a non-empty list", param="messages")
        if kind == "completions" and not body.get("prompt"):
            raise APIError(400, "prompt must not be empty", param="prompt")
        if kind == "messages" and not (isinstance(body.get("messages"), list) and body["messages"]):
            raise APIError(400, "messages must be a non-empty list", param="messages")
        if kind == "responses" and not body.get("input"):
            raise APIError(400, "input must not be empty", param="input")
        if kind in ("embeddings", "classify") and not (body.get("input") or body.get("messages")):
            raise APIError(400, "input must not be empty", param="input")
        for field in {"score": ("text_1", "text_2"), "rerank": ("query", "documents")}.get(kind, ()):
            if not body.get(field):
                raise APIError(400, f"{field} must not be empty", param=field)
        return name, mcfg

    def tier_of(body: dict, raw: Request) -> str:
        asked = body.pop("service_tier", None) or raw.headers.get(TIER_HEADER)
        if asked is None:
            return "standard"
        tier = SERVICE_TIERS.get(str(asked))
        if tier is None:
            raise APIError(400, f"service_tier must be one of {sorted(SERVICE_TIERS)}, got {asked!r}", param="service_tier")
        return tier

    def answer_error(raw: Request, e: APIError) -> Response:
        """An error of the gateway's own making (not counted as the client's), in the shape of the route's API."""
        return errors.respond(raw, e.status, e.message, e.param, e.code, e.headers)

    def exhausted(model: str, last: UpstreamFailure | None, skipped: list) -> APIError:
        """Every backend failed or was skipped: why, with the status that fits the last failure."""
        if last is None and skipped and all(reason == "context_length" for _, reason in skipped):
            return APIError(400, f"the prompt is longer than any backend of model `{model}` accepts", "messages",
                            "context_length_exceeded")
        if last is not None and last.reason == "context_length":
            return APIError(400, last.message, last.param, "context_length_exceeded")
        if last is not None and last.reason == "unsupported":
            return APIError(400, last.message, last.param)
        if last is not None and last.reason == "rate_limited":
            wait = math.ceil(last.retry_after if last.retry_after is not None else config.health.default_retry_after)
            return APIError(429, f"every backend of model `{model}` is rate limited; retry later", None, "rate_limited",
                            headers={"Retry-After": str(max(1, wait))})
        if last is None:
            waits = [s.cooldown_until - time.monotonic() for s in gw.states.values()]
            wait = max(1, math.ceil(min([w for w in waits if w > 0], default=1)))
            return APIError(503, f"no backend of model `{model}` is available now", None, "no_backend_available",
                            headers={"Retry-After": str(wait)})
        return APIError(503, f"no backend of model `{model}` could serve the request (last: {last.message})", None,
                        "backends_failed")

    async def handle(raw: Request, kind: str):
        tenant = tenant_of(raw)
        body = await json_body(raw)
        model, mcfg = resolve(body, kind)
        body = apply_policy(mcfg.params, body)
        tier = tier_of(body, raw)
        stream = bool(body.get("stream"))
        include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))

        key = None
        if config.cache.enabled and cacheable(body):
            key = cache_key(tenant, model, kind, body)
            hit = gw.cache.get(key)
            gw.metrics.cache.labels("hit" if hit is not None else "miss").inc()
            if hit is not None:
                return JSONResponse(hit, headers={"x-llmserve-cache": "hit"})

        skipped: list = []
        last: UpstreamFailure | None = None
        previous: str | None = None
        for backend in gw.candidates(model, mcfg, tier, body, skipped):
            if previous is not None and last is not None:
                gw.metrics.fallbacks.labels(model, previous, last.reason).inc()
            previous = backend
            state = gw.states[backend]
            upstream = gw.upstreams[backend]
            payload = gw.upstream_body(backend, mcfg, tier, body, stream)
            state.outstanding += 1
            started = time.perf_counter()
            try:
                if not stream:
                    response = await upstream.complete(kind, payload)
                    state.record_success()
                    elapsed = time.perf_counter() - started
                    gw.metrics.first_token.labels(backend).observe(elapsed)
                    gw.metrics.request_seconds.labels(backend).observe(elapsed)
                    gw.metrics.requests.labels(model, backend, "ok").inc()
                    response["model"] = model
                    gw.price(backend, response.get("usage"), tenant)
                    headers = {"x-llmserve-backend": backend}
                    if key is not None:
                        gw.cache.put(key, response)
                        headers["x-llmserve-cache"] = "miss"
                    state.outstanding -= 1
                    return JSONResponse(response, headers=headers)
                first = await first_chunks(upstream.stream(kind, payload), backend)
            except UpstreamFailure as failure:
                state.outstanding -= 1
                gw.failed(backend, failure)
                gw.metrics.requests.labels(model, backend, "error").inc()
                if not failure.retryable:
                    return answer_error(raw, APIError(failure.status, failure.message, failure.param, failure.code))
                logger.info("model %s: backend %s failed (%s); trying the next", model, backend, failure.reason)
                last = failure
                continue
            except BaseException:
                state.outstanding -= 1
                raise
            gw.metrics.first_token.labels(backend).observe(time.perf_counter() - started)
            return StreamingResponse(relay(first, model, backend, tenant, include_usage, started),
                                     media_type="text/event-stream", headers={"x-llmserve-backend": backend})
        return answer_error(raw, exhausted(model, last, skipped))

    async def first_chunks(agen, backend: str, carries=carries_token):
        """Reads a backend's opened stream (chat chunks, or the named events of the Responses and Messages APIs) up
        to its first token, within the first-token timeout. Nothing has reached the client yet, so a failure here
        lets the request move on."""
        buffered: list[dict] = []
        timeout = gw.config.backends[backend].first_token_timeout or config.first_token_timeout
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(agen.__anext__(), max(0.0, deadline - time.monotonic()))
                except StopAsyncIteration:
                    break
                buffered.append(chunk)
                if carries(chunk):
                    break
        except asyncio.TimeoutError:
            await agen.aclose()
            raise UpstreamFailure("timeout", f"backend {backend} sent no token within {timeout:g} s", 504) from None
        except BaseException:
            await agen.aclose()
            raise
        return buffered, agen

    async def relay(first, model: str, backend: str, tenant: str, include_usage: bool, started: float) -> AsyncIterator[str]:
        """The committed stream: what was read before the first token, then the rest. A failure from here on ends
        the stream with an error event; the request is not restarted elsewhere."""
        buffered, agen = first
        state = gw.states[backend]
        outcome = "ok"

        def shown(chunk: dict) -> dict | None:
            chunk["model"] = model
            if chunk.get("usage"):
                gw.price(backend, chunk["usage"], tenant)
            if not include_usage:
                chunk.pop("usage", None)
                if not chunk.get("choices"):
                    return None
            return chunk

        try:
            for chunk in buffered:
                if (c := shown(chunk)) is not None:
                    yield sse(c)
            async for chunk in agen:
                if (c := shown(chunk)) is not None:
                    yield sse(c)
            state.record_success()
        except UpstreamFailure as failure:
            outcome = "error"
            gw.failed(backend, failure)
            yield sse(errors.error_body(502, f"{failure.message}; the answer is incomplete", None, "upstream_stream_broken"))
        finally:
            state.outstanding -= 1
            gw.metrics.request_seconds.labels(backend).observe(time.perf_counter() - started)
            gw.metrics.requests.labels(model, backend, outcome).inc()
            await agen.aclose()
        yield "data: [DONE]\n\n"

    # ---- OpenAI's Responses and embeddings APIs, Anthropic's Messages API: passed through as they are ------------
    async def handle_passthrough(raw: Request, api: str):
        """A Responses, Messages or embeddings request goes to a backend that serves that API, with the same routing,
        fallbacks before the first token, tiers and pricing as chat. A stored response's continuation (previous_response_id)
        goes to the backend that holds it."""
        tenant = tenant_of(raw)
        body = await json_body(raw)
        model, mcfg = resolve(body, api)
        body = apply_policy(mcfg.params, body)
        tier = tier_of(body, raw)
        stream = bool(body.get("stream"))
        skipped: list = []
        if api == "responses" and body.get("previous_response_id") is not None:
            owner = gw.response_owners.get(body["previous_response_id"])
            if owner is None:
                raise APIError(404, f"Previous response with id '{body['previous_response_id']}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            order = iter([owner[0]])
        else:
            order = gw.candidates(model, mcfg, tier, chat_view(api, body), skipped)
        last: UpstreamFailure | None = None
        for backend in order:
            state, upstream = gw.states[backend], gw.upstreams[backend]
            payload = gw.upstream_body(backend, mcfg, tier, body, False)
            if api in ("responses", "messages"):  # (the others do not stream)
                payload["stream"] = stream
            started = time.perf_counter()
            state.outstanding += 1
            try:
                path = upstream.api_path(api)
                if not stream:
                    data = await upstream.forward("POST", path, payload)
                    state.outstanding -= 1
                    state.record_success()
                    elapsed = time.perf_counter() - started
                    gw.metrics.first_token.labels(backend).observe(elapsed)
                    gw.metrics.request_seconds.labels(backend).observe(elapsed)
                    gw.metrics.requests.labels(model, backend, "ok").inc()
                    gw.passed_through(api, data, model, backend, tenant)
                    return JSONResponse(data, headers={"x-llmserve-backend": backend})
                first = await first_chunks(upstream.forward_stream(path, payload), backend,
                                           lambda event: event.get("type") in TOKEN_EVENTS)
            except UpstreamFailure as failure:
                state.outstanding -= 1
                if failure.reason != "unsupported":
                    gw.failed(backend, failure)
                    gw.metrics.requests.labels(model, backend, "error").inc()
                if not failure.retryable:
                    return answer_error(raw, APIError(failure.status, failure.message, failure.param, failure.code))
                last = failure
                continue
            except BaseException:
                state.outstanding -= 1
                raise
            gw.metrics.first_token.labels(backend).observe(time.perf_counter() - started)
            return StreamingResponse(relay_events(first, api, model, backend, tenant, started),
                                     media_type="text/event-stream", headers={"x-llmserve-backend": backend})
        return answer_error(raw, exhausted(model, last, skipped))

    async def relay_events(first, api: str, model: str, backend: str, tenant: str, started: float) -> AsyncIterator[str]:
        """The committed stream, event by event, its model named as the client named it; a failure from here on ends
        it with an error event of the API's own shape."""
        buffered, agen = first
        state = gw.states[backend]
        outcome = "ok"
        usage: dict = {}

        def shown(event: dict) -> str:
            kind = event.get("type")
            if isinstance(event.get("response"), dict):  # Responses' lifecycle events carry the whole response
                if kind in ("response.completed", "response.incomplete", "response.failed"):
                    gw.passed_through(api, event["response"], model, backend, tenant)
                else:
                    event["response"]["model"] = model
                    gw.remember(event["response"], model, backend)
            elif kind == "message_start" and isinstance(event.get("message"), dict):
                event["message"]["model"] = model
                usage.update(event["message"].get("usage") or {})
            elif kind == "message_delta" and isinstance(event.get("usage"), dict):
                usage.update(event["usage"])
                event["usage"] = usage
                gw.price(backend, usage, tenant, api)
            return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        try:
            for event in buffered:
                yield shown(event)
            async for event in agen:
                yield shown(event)
            state.record_success()
        except UpstreamFailure as failure:
            outcome = "error"
            gw.failed(backend, failure)
            message = f"{failure.message}; the answer is incomplete"
            error = (errors.anthropic_error_body(502, message) if api == "messages" else
                     {"type": "error", "code": "upstream_stream_broken", "message": message, "param": None})
            yield f"event: error\ndata: {json.dumps(error)}\n\n"
        finally:
            state.outstanding -= 1
            gw.metrics.request_seconds.labels(backend).observe(time.perf_counter() - started)
            gw.metrics.requests.labels(model, backend, outcome).inc()
            await agen.aclose()

    # the APIs passed through as they are, each at /v1/<its name>
    PASSTHROUGH_APIS = ("responses", "messages", "embeddings", "classify", "score", "rerank")

    def passthrough_route(api: str):
        async def route(raw: Request):
            return await handle_passthrough(raw, api)
        return route

    for api in PASSTHROUGH_APIS:
        app.post(f"/v1/{api}", name=api)(passthrough_route(api))

    async def stored(raw: Request, response_id: str, method: str, suffix: str = ""):
        """A stored response's routes, at the backend that made it."""
        tenant_of(raw)
        owner = gw.response_owners.get(response_id)
        if owner is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        model, backend = owner[1], owner[0]
        query = f"?{raw.url.query}" if raw.url.query else ""
        try:
            data = await gw.upstreams[backend].forward(method, f"/responses/{response_id}{suffix}{query}")
        except UpstreamFailure as failure:
            return answer_error(raw, APIError(failure.status, failure.message, failure.param, failure.code))
        if data.get("object") == "response":
            data["model"] = model
        if method == "DELETE":
            gw.response_owners.pop(response_id, None)
        return JSONResponse(data, headers={"x-llmserve-backend": backend})

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(raw: Request, response_id: str):
        return await stored(raw, response_id, "GET")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(raw: Request, response_id: str):
        return await stored(raw, response_id, "DELETE")

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(raw: Request, response_id: str):
        return await stored(raw, response_id, "GET", "/input_items")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(raw: Request, response_id: str):
        return await stored(raw, response_id, "POST", "/cancel")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await handle(raw, "chat")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await handle(raw, "completions")

    @app.get("/v1/models")
    async def models(raw: Request):
        tenant_of(raw)
        now = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": now, "owned_by": "llmserve-gateway"}
                                           for name in config.models]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        gw.refresh_gauges()
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        gw.metrics.client_errors.labels(str(e.status)).inc()
        return errors.respond(request, e.status, e.message, e.param, e.code, e.headers)

    if webui:
        mount_webui(app)
    return app

