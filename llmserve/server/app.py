"""OpenAI-compatible HTTP server: a thin FastAPI layer over AsyncEngine."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve.errors import InvalidRequestError
from llmserve.metrics import Metrics
from llmserve.sampling_params import SamplingParams
from llmserve.server import errors
from llmserve.plan.pricing import PricingConfig
from llmserve.server.async_engine import AsyncEngine
from llmserve.server.cost import RequestPricer
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | list[str] | None = None  # one key, or several (one per tenant)
    prefix_cache_salt_from: str | None = None  # "api-key" or "header:NAME": the server, not the client, picks the tenant
    max_queued_requests: int = 256
    max_queued_tokens: int = 1 << 20
    request_timeout: float | None = None
    pricing: PricingConfig | None = None  # per-model token prices (--pricing FILE)
    gpu_hour_price: float | None = None  # else: cost = compute time used x this price

    def __post_init__(self):
        source = self.prefix_cache_salt_from
        if source is None:
            return
        if source == "api-key":
            if not self.api_key:
                raise InvalidRequestError("--prefix-cache-salt-from api-key needs --api-key (one per tenant)", "prefix_cache_salt_from")
        elif not (source.startswith("header:") and len(source) > len("header:")):
            raise InvalidRequestError(f"--prefix-cache-salt-from must be api-key or header:NAME, got {source!r}", "prefix_cache_salt_from")


class Admission:
    """Bounded queue: a slot is taken before any tokenization or template work, so a flood is
    refused at the door (429) instead of piling up. A request leaves the queue at its first output."""

    def __init__(self, cfg: ServerConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.requests = 0
        self.tokens = 0

    def reserve(self) -> "Slot":
        if self.requests >= self.cfg.max_queued_requests:
            self.metrics.rejected.labels(self.metrics.model_name, "queue_full").inc()
            raise APIError(429, f"the server is at its limit of {self.cfg.max_queued_requests} queued requests; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.requests += 1
        return Slot(self)


class Slot:
    def __init__(self, admission: Admission):
        self.admission, self.tokens, self.held = admission, 0, True

    def add_tokens(self, n: int) -> None:
        a = self.admission
        if a.tokens + n > a.cfg.max_queued_tokens:
            a.metrics.rejected.labels(a.metrics.model_name, "token_limit").inc()
            self.release()
            raise APIError(429, f"the server is at its limit of {a.cfg.max_queued_tokens} queued prompt tokens; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        a.tokens += n
        self.tokens += n

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.requests -= 1
            self.admission.tokens -= self.tokens


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def build_app(engine: AsyncEngine, cfg: ServerConfig, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="llmserve", docs_url=None, redoc_url=None)
    errors.install(app)
    llm = engine.engine
    tok = llm.tokenizer
    admission = Admission(cfg, metrics)
    pricer = RequestPricer(cfg.served_model_name, cfg.pricing, cfg.gpu_hour_price)
    metrics.pricer = pricer if pricer.enabled else None
    app.state.engine, app.state.admission = engine, admission

    api_keys = [cfg.api_key] if isinstance(cfg.api_key, str) else list(cfg.api_key or [])

    async def check_auth(request: Request):
        if not api_keys:
            return
        header = request.headers.get("authorization", "")
        if not any(hmac.compare_digest(header, f"Bearer {k}") for k in api_keys):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def cache_salt(raw: Request, req) -> str | None:
        """Tenant isolation for the prefix cache: with --prefix-cache-salt-from, the salt comes from who is
        calling; a client's own cache_salt can only split its tenant further, never join another's."""
        source = cfg.prefix_cache_salt_from
        if source is None:
            return req.cache_salt
        if source == "api-key":
            tenant = raw.headers.get("authorization", "")
        else:
            name = source.split(":", 1)[1]
            tenant = raw.headers.get(name)
            if not tenant:
                raise APIError(400, f"this server keys its prefix cache by the {name} header; send it", param=name,
                               code="missing_tenant_header")
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        return digest + ("|" + req.cache_salt if req.cache_salt else "")

    def check_model(name: str | None) -> None:
        if name is not None and name != cfg.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_ready() -> None:
        if not engine.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")

    def log_extras(req) -> None:
        if req.model_extra:
            logger.info("ignoring unknown request fields: %s", sorted(req.model_extra))

    def sampling_params(req, prompt_len: int, logprobs: int | None, prompt_logprobs: int | None, default_max: int | None) -> SamplingParams:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else llm.max_model_len - prompt_len
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if prompt_len + max_tokens > llm.max_model_len:
            raise APIError(400, f"This model's maximum context length is {llm.max_model_len} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
                                "Please reduce the length of the messages or completion.", param="max_tokens", code="context_length_exceeded")
        try:
            bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias")
        params = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0, min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty or 1.0, logit_bias=bias or None,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
        )
        params.validate_token_ids(llm.model_config.vocab_size)
        return params

    async def run(prompts: list[list[int]], params: SamplingParams, req, slot: Slot, rid: str, salt: str | None):
        """Yields (prompt index, RequestOutput) from all prompts of one HTTP request, merged."""
        timeout = req.timeout or cfg.request_timeout
        gens = [engine.generate(f"{rid}-{i}", ids, params, priority=req.priority, timeout=timeout, cache_salt=salt)
                for i, ids in enumerate(prompts)]
        if len(gens) == 1:
            try:
                async for out in gens[0]:
                    slot.release()
                    yield 0, out
            finally:
                slot.release()
                await gens[0].aclose()
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, g):
            try:
                async for out in g:
                    await q.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(gens)
        try:
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    slot.release()
                    yield i, item
        finally:
            slot.release()
            for t in tasks:
                t.cancel()

    async def collect(raw: Request, agen) -> dict[int, object]:
        """Non-streaming: run to the end, aborting if the client goes away."""
        finals: dict[int, object] = {}

        async def consume():
            async for i, out in agen:
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(consume())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await raw.is_disconnected():
                task.cancel()
                await agen.aclose()
                raise APIError(499, "client disconnected")
        task.result()
        return finals

    def usage(prompt_lens: list[int], outs) -> dict:
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        prompt = sum(prompt_lens)
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}
        cost = pricer.cost(outs)
        if cost is not None:  # OpenRouter's extension fields: `cost` in USD, with its parts
            out["cost"] = cost.total
            out["cost_details"] = {**cost.as_usage_details(), "basis": pricer.basis}
        return out

    def token_str(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    def completion_logprobs(token_ids, logprobs, start_offset: int, prompt: list | None = None) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start_offset
        entries = list(zip(prompt[0], prompt[1])) if prompt else []
        entries += list(zip(token_ids, logprobs))
        for t, lp in entries:
            s = token_str(t)
            tokens.append(s)
            token_lps.append(None if lp is None else lp[t])
            tops.append(None if lp is None else {token_str(k): v for k, v in lp.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(token_ids, logprobs, k: int) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            s = token_str(t)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": s, "logprob": lp[t], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_str(a), "logprob": b, "bytes": list(token_str(a).encode())} for a, b in top]})
        return {"content": content}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(agen, make_chunks, include_usage: bool, prompt_lens: list[int], base: dict, first_chunks=()):
        finals = {}
        try:
            for chunk in first_chunks:
                yield sse({**base, **chunk, **({"usage": None} if include_usage else {})})
            async for i, out in agen:
                for chunk in make_chunks(i, out):
                    yield sse({**base, **chunk, **({"usage": None} if include_usage else {})})
                if out.finished:
                    finals[i] = out
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(prompt_lens, list(finals.values()))})
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - after the first byte, errors travel as an SSE event
            yield errors.sse_error(e)
        finally:
            await agen.aclose()
        yield "data: [DONE]\n\n"

    # ---- routes -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.alive:
            return errors.error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        if not engine.alive or time.monotonic() - engine.last_step_time > 60:
            return errors.error_response(503, "the engine is not stepping")
        return {"status": "ready", "model": cfg.served_model_name}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "llmserve", "max_model_len": llm.max_model_len}]}

    def render_chat(req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": _text(m.content), **({"name": m.name} if m.name else {})} for m in req.messages]
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message")
            text = tok.apply_chat_template(messages, add_generation_prompt=False, **(req.chat_template_kwargs or {}))
            final = messages[-1]["content"]
            cut = text.rfind(final)
            text = text[: cut + len(final)] if final and cut >= 0 else text
        else:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **(req.chat_template_kwargs or {}))
        return tok.encode(text, add_special_tokens=False)

    @app.post("/tokenize", dependencies=[Depends(check_auth)])
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if req.messages is not None:
            ids = render_chat(ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt))
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(check_auth)])
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        if any(not 0 <= t < llm.model_config.vocab_size for t in req.tokens):
            raise APIError(400, "tokens has ids outside the vocabulary", param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        check_ready()
        log_extras(req)
        slot = admission.reserve()
        try:
            p = req.prompt
            if isinstance(p, str):
                prompts, texts = [tok.encode(p)], [p]
            elif p and isinstance(p[0], str):
                prompts, texts = [tok.encode(x) for x in p], list(p)
            elif p and isinstance(p[0], int):
                prompts, texts = [list(p)], [tok.decode(list(p), skip_special_tokens=False)]
            elif p and isinstance(p[0], list):
                prompts = [list(x) for x in p]
                texts = [tok.decode(x, skip_special_tokens=False) for x in prompts]
            else:
                raise APIError(400, "prompt must not be empty", param="prompt")
            if any(not ids for ids in prompts):
                raise APIError(400, "prompt must not be empty", param="prompt")
            salt = cache_salt(raw, req)
            longest = max(len(ids) for ids in prompts)
            params = sampling_params(req, longest, req.logprobs, req.logprobs if (req.echo and req.logprobs is not None) else None, 16)
            slot.add_tokens(sum(len(x) for x in prompts))
        except BaseException:
            slot.release()
            raise
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": cfg.served_model_name}
        lens = [len(x) for x in prompts]
        agen = run(prompts, params, req, slot, rid, salt)

        if req.stream:
            sent: dict[tuple[int, int], int] = {}

            def chunks(i, out):
                for c in out.outputs:
                    key = (i, c.index)
                    if not c.delta_token_ids and c.finish_reason is None:
                        continue
                    n_before = sent.get(key, 0)
                    sent[key] = len(c.token_ids)
                    text = c.delta_text
                    lp = None
                    if params.logprobs is not None:
                        lp = completion_logprobs(c.token_ids[n_before:], c.logprobs[n_before:], 0)
                    yield {"choices": [{"index": i * params.n + c.index, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

            first = [{"choices": [{"index": i * params.n + j, "text": texts[i], "logprobs": None, "finish_reason": None}]}
                     for i in range(len(prompts)) for j in range(params.n)] if req.echo else []
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(agen, chunks, include, lens, base, first), media_type="text/event-stream")

        finals = await collect(raw, agen)
        choices = []
        for i in range(len(prompts)):
            out = finals[i]
            for c in out.outputs:
                text = (texts[i] if req.echo else "") + c.text
                lp = None
                if params.logprobs is not None:
                    prompt_part = (prompts[i], out.prompt_logprobs) if req.echo else None
                    lp = completion_logprobs(c.token_ids, c.logprobs, 0, prompt_part)
                choices.append({"index": i * params.n + c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**base, "choices": choices, "usage": usage(lens, [finals[i] for i in range(len(prompts))])}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        check_ready()
        log_extras(req)
        slot = admission.reserve()
        try:
            ids = render_chat(req)
            salt = cache_salt(raw, req)
            k = (req.top_logprobs or 0) if req.logprobs else None
            params = sampling_params(req, len(ids), k, None, None)
            slot.add_tokens(len(ids))
        except BaseException:
            slot.release()
            raise
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": int(time.time()), "model": cfg.served_model_name}
        agen = run([ids], params, req, slot, rid, salt)

        if req.stream:
            sent: dict[int, int] = {}

            def chunks(_, out):
                for c in out.outputs:
                    if not c.delta_token_ids and c.finish_reason is None:
                        continue
                    n_before = sent.get(c.index, 0)
                    sent[c.index] = len(c.token_ids)
                    lp = chat_logprobs(c.token_ids[n_before:], c.logprobs[n_before:], k) if k is not None else None
                    yield {"choices": [{"index": c.index, "delta": {"content": c.delta_text}, "logprobs": lp,
                                        "finish_reason": c.finish_reason}]}

            first = [{"choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
                     for j in range(params.n)]
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(agen, chunks, include, [len(ids)], base, first), media_type="text/event-stream")

        out = (await collect(raw, agen))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return {**base, "choices": choices, "usage": usage([len(ids)], [out])}

    return app


def create_server(engine_config, server_config: ServerConfig | None = None):
    """Load the model (in the engine thread), start the engine, return (app, async engine)."""
    from llmserve.engine.llm_engine import LLMEngine

    engine = AsyncEngine(lambda: LLMEngine(engine_config))
    llm = engine.engine
    cfg = server_config or ServerConfig(served_model_name=llm.model_name)
    if not cfg.served_model_name:
        cfg.served_model_name = llm.model_name
    metrics = Metrics(cfg.served_model_name)
    engine.metrics = metrics
    return build_app(engine, cfg, metrics), engine
