"""OpenAI-compatible HTTP server: a thin FastAPI layer over AsyncEngine. The routes are here; the admission queue
(admission.py), the merging of a request's prompt streams (request_streams.py) and the response bodies (responses.py)
are beside it."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve.errors import InvalidRequestError
from llmserve.metrics import Metrics
from llmserve.sampling_params import SamplingParams
from llmserve.plan.pricing import PricingConfig
from llmserve.server import errors
from llmserve.server.admission import Admission
from llmserve.server.async_engine import AsyncEngine
from llmserve.server.cost import RequestPricer
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from llmserve.server.request_streams import collect_finals, merged_outputs
from llmserve.server.responses import ResponseFormatter

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
    admission = Admission(cfg.max_queued_requests, cfg.max_queued_tokens, metrics)
    pricer = RequestPricer(cfg.served_model_name, cfg.pricing, cfg.gpu_hour_price)
    metrics.pricer = pricer if pricer.enabled else None
    fmt = ResponseFormatter(tok, pricer)
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

    @contextmanager
    def admitted(req):
        """What every generation request goes through first: the model name, a live engine, then a place in the
        queue (429 when it is full). Yields the reserved slot, which the body fills with the prompts' tokens; if
        the body raises (a bad prompt or parameter), the slot is handed back."""
        check_model(req.model)
        check_ready()
        log_extras(req)
        slot = admission.reserve()
        try:
            yield slot
        except BaseException:
            slot.release()
            raise

    def request_outputs(req, prompts: list[list[int]], params: SamplingParams, rid: str, slot, salt: str | None):
        """The request's outputs from the engine, merged over its prompts, under its own or the server's timeout;
        it leaves the queue (its slot) at its first output."""
        timeout = req.timeout or cfg.request_timeout
        return merged_outputs(engine, prompts, params, rid, slot, req.priority, timeout, salt)

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
        with admitted(req) as slot:
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
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": cfg.served_model_name}
        lens = [len(x) for x in prompts]
        agen = request_outputs(req, prompts, params, rid, slot, salt)

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
                        lp = fmt.completion_logprobs(c.token_ids[n_before:], c.logprobs[n_before:], 0)
                    yield {"choices": [{"index": i * params.n + c.index, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

            first = [{"choices": [{"index": i * params.n + j, "text": texts[i], "logprobs": None, "finish_reason": None}]}
                     for i in range(len(prompts)) for j in range(params.n)] if req.echo else []
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(fmt.stream(agen, chunks, include, lens, base, first),
                                     media_type="text/event-stream")

        finals = await collect_finals(raw, agen)
        choices = []
        for i in range(len(prompts)):
            out = finals[i]
            for c in out.outputs:
                text = (texts[i] if req.echo else "") + c.text
                lp = None
                if params.logprobs is not None:
                    prompt_part = (prompts[i], out.prompt_logprobs) if req.echo else None
                    lp = fmt.completion_logprobs(c.token_ids, c.logprobs, 0, prompt_part)
                choices.append({"index": i * params.n + c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**base, "choices": choices, "usage": fmt.usage(lens, [finals[i] for i in range(len(prompts))])}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat(req: ChatCompletionRequest, raw: Request):
        with admitted(req) as slot:
            ids = render_chat(req)
            salt = cache_salt(raw, req)
            k = (req.top_logprobs or 0) if req.logprobs else None
            params = sampling_params(req, len(ids), k, None, None)
            slot.add_tokens(len(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": int(time.time()), "model": cfg.served_model_name}
        agen = request_outputs(req, [ids], params, rid, slot, salt)

        if req.stream:
            sent: dict[int, int] = {}

            def chunks(_, out):
                for c in out.outputs:
                    if not c.delta_token_ids and c.finish_reason is None:
                        continue
                    n_before = sent.get(c.index, 0)
                    sent[c.index] = len(c.token_ids)
                    lp = fmt.chat_logprobs(c.token_ids[n_before:], c.logprobs[n_before:], k) if k is not None else None
                    yield {"choices": [{"index": c.index, "delta": {"content": c.delta_text}, "logprobs": lp,
                                        "finish_reason": c.finish_reason}]}

            first = [{"choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
                     for j in range(params.n)]
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(fmt.stream(agen, chunks, include, [len(ids)], base, first),
                                     media_type="text/event-stream")

        out = (await collect_finals(raw, agen))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": fmt.chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return {**base, "choices": choices, "usage": fmt.usage([len(ids)], [out])}

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
