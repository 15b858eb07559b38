"""OpenAI-compatible HTTP server: a thin FastAPI layer over an EngineClient (async_engine.py). The routes are here;
the admission queue (admission.py), the merging of a request's prompt streams (request_streams.py) and the response
bodies (responses.py) are beside it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import ssl
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from llmserve.errors import InvalidRequestError
from llmserve.lora.registry import ModelNotFoundError
from llmserve.lora.request import LoRARequest
from llmserve.metrics import Metrics
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.beam_search import beam_search_from
from llmserve.pooling_params import score_method
from llmserve.plan.pricing import PricingConfig
from llmserve.server import errors
from llmserve.server.admission import Admission, QueueCounts
from llmserve.server.async_engine import AsyncEngine, EngineClient, EngineDeadError
from llmserve.server.cost import RequestPricer
from llmserve.server.errors import APIError
from llmserve.server.invocations import SageMakerRoutes
from llmserve.server.batch_routes import install_batch_routes
from llmserve.server.embeddings_routes import install_embeddings_routes
from llmserve.server.lora_routes import install_lora_routes
from llmserve.server.messages_routes import install_messages_routes
from llmserve.server.responses_routes import install_responses_routes
from llmserve.server.served_adapters import ServedAdapters, SharedServedAdapters
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from llmserve.server import reasoning, tool_calls
from llmserve.server.chat_output import ChatOutputParser
from llmserve.server.request_streams import beam_search_outputs, collect_finals, merged_outputs
from llmserve.server.responses import ResponseFormatter
from llmserve.webui import mount_webui

logger = logging.getLogger(__name__)

class ChatInputs(NamedTuple):
    ids: list[int]  # the rendered prompt
    params: SamplingParams
    salt: str | None  # the prefix cache's tenant
    top_logprobs: int | None  # None: no logprobs
    tool_format: tool_calls.ToolFormat | None  # how to read tool calls from the output (None: not at all)
    forced_function: bool  # tool_choice named a function


# request fields that, when a request leaves them unset, take the model's generation_config.json defaults
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def best_of_outputs(out: RequestOutput, n: int, keep_logprobs: bool) -> RequestOutput:
    """A best_of request's output: its n samples with the highest log probability per token (OpenAI's "best"),
    best first and numbered from 0; the logprobs that ranked them only where the request asked for them."""
    def per_token(c) -> float:
        return (c.cumulative_logprob or 0.0) / max(1, len(c.token_ids))

    best = sorted(out.outputs, key=per_token, reverse=True)[:n]
    best = [dataclasses.replace(c, index=j, **({} if keep_logprobs else {"logprobs": None, "cumulative_logprob": None}))
            for j, c in enumerate(best)]
    return dataclasses.replace(out, outputs=best)


@dataclass
class ServerConfig:
    served_model_name: str
    # vLLM's --served-model-name A B ...: requests may name the base model by any of these too (responses say the first)
    served_model_aliases: list[str] = field(default_factory=list)
    api_key: str | list[str] | None = None  # one key, or several (one per tenant)
    prefix_cache_salt_from: str | None = None  # "api-key" or "header:NAME": the server, not the client, picks the tenant
    max_queued_requests: int = 256
    max_queued_tokens: int = 1 << 20
    request_timeout: float | None = None
    pricing: PricingConfig | None = None  # per-model token prices (--pricing FILE)
    gpu_hour_price: float | None = None  # else: cost = compute time used x this price
    tool_call_parser: str = "auto"  # hermes, llama3_json, smollm2, or auto (from the chat template)
    reasoning_parser: str | None = None  # qwen3 or deepseek_r1: <think>…</think> goes to reasoning_content
    grammar_compile_timeout: float = 10.0  # seconds a response_format / structured_outputs grammar may take to build
    webui: bool = True  # the playground at / (--no-webui turns it off)
    # LoRA adapters served by name (--lora-modules name=path); with allow_runtime_lora_updating, clients holding the API
    # key may load and unload adapters whose folders lie inside lora_dirs (--lora-dir)
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_dirs: list[str] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    api_server_count: int = 1  # HTTP processes in front of the engine (api_servers.py), sharing one admission queue
    # CORS, as vLLM's: which web pages' origins may call the API from a browser (vLLM's defaults: any; [] turns CORS off)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    uvicorn_log_level: str = "warning"  # "info" logs each HTTP request (uvicorn's access log)
    # HTTPS (vLLM's --ssl-*): the server's certificate chain and key (PEM); with ssl_ca_certs and ssl_cert_reqs 2
    # (ssl.CERT_REQUIRED) clients must present a certificate signed by one of those CAs
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    log_requests: bool = False  # log each generation request: id, prompt tokens, sampling parameters (vLLM's flag)
    # vLLM's smaller server flags
    response_role: str = "assistant"  # the role chat answers carry (--response-role)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (for tokens that are not valid text)
    request_id_headers: bool = False  # answer with X-Request-Id (the client's, else the response's id)
    root_path: str = ""  # the path prefix a proxy serves the API under (--root-path)
    force_include_usage: bool = False  # every stream ends with its usage, asked for or not
    uvicorn_access_log: bool = True  # --disable-uvicorn-access-log turns uvicorn's access lines off
    dev_mode: bool = False  # vLLM's dev-mode routes (LLMSERVE_SERVER_DEV_MODE=1): POST /reset_prefix_cache
    openapi: bool = True  # /openapi.json (--disable-fastapi-docs turns it off)
    # the Responses API's stored responses (`store`, for previous_response_id and GET), kept in memory, oldest
    # forgotten first; 0 stores none
    max_stored_responses: int = 1000

    @property
    def base_names(self) -> list[str]:
        return [self.served_model_name, *self.served_model_aliases]

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @property
    def uvicorn_options(self) -> dict:
        """uvicorn.Config's arguments from these flags: logging and TLS."""
        options = dict(log_level=self.uvicorn_log_level, access_log=self.uvicorn_access_log)
        if self.ssl_certfile:
            options.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile,
                           ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=self.ssl_cert_reqs)
        return options

    def _check_tls(self) -> None:
        """The certificate and key load now, before the model does, so that a wrong file is one line at once."""
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise InvalidRequestError("HTTPS needs both --ssl-certfile and --ssl-keyfile", "ssl_certfile")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise InvalidRequestError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)", "ssl_cert_reqs")
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            raise InvalidRequestError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS: --ssl-certfile and "
                                      "--ssl-keyfile", "ssl_ca_certs")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise InvalidRequestError("--ssl-cert-reqs needs --ssl-ca-certs: the CAs that client certificates must "
                                      "come from", "ssl_cert_reqs")
        if not self.ssl_certfile:
            return
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            raise InvalidRequestError(f"cannot load the certificate {self.ssl_certfile} with the key "
                                      f"{self.ssl_keyfile}: {e.strerror or e}", "ssl_certfile") from None
        if self.ssl_ca_certs:
            try:
                context.load_verify_locations(self.ssl_ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise InvalidRequestError(f"cannot load --ssl-ca-certs {self.ssl_ca_certs}: {e.strerror or e}",
                                          "ssl_ca_certs") from None

    def __post_init__(self):
        if self.api_server_count < 1:
            raise InvalidRequestError("--api-server-count must be at least 1", "api_server_count")
        if self.tool_call_parser != "auto" and self.tool_call_parser not in tool_calls.PARSER_NAMES:
            raise InvalidRequestError(f"--tool-call-parser must be auto or one of {tool_calls.PARSER_NAMES}",
                                      "tool_call_parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning.PARSERS:
            raise InvalidRequestError(f"--reasoning-parser must be one of {list(reasoning.PARSERS)}", "reasoning_parser")
        if self.allow_runtime_lora_updating and not self.lora_dirs:
            raise InvalidRequestError("--allow-runtime-lora-updating needs --lora-dir: the folders adapters may be "
                                      "loaded from", "lora_dirs")
        for d in self.lora_dirs:
            if not os.path.isdir(d):
                raise InvalidRequestError(f"--lora-dir {d} is not a directory", "lora_dirs")
        self._check_tls()
        if not self.grammar_compile_timeout > 0:
            raise InvalidRequestError("--grammar-compile-timeout must be positive", "grammar_compile_timeout")
        if self.max_stored_responses < 0:
            raise InvalidRequestError("--max-stored-responses must be 0 or more", "max_stored_responses")
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


def _strict(schema):
    """OpenAI's strict mode: an object admits only the properties it lists (unless the schema says otherwise)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: every answer carries X-Request-Id, the client's own if it sent one. Plain
    ASGI (Starlette's BaseHTTPMiddleware would stand between a route and the client's disconnect)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        value = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", value)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(engine: EngineClient, cfg: ServerConfig, metrics: Metrics,
              queue_counts: QueueCounts | None = None) -> FastAPI:
    """The HTTP side over a started engine. queue_counts: the admission queue's counts, when several API-server
    processes share them."""
    app = FastAPI(title="llmserve", docs_url=None, redoc_url=None, root_path=cfg.root_path,
                  openapi_url="/openapi.json" if cfg.openapi else None)
    errors.install(app)
    tok = engine.tokenizer
    if tok is None:
        raise InvalidRequestError(f"the model {engine.model_name} has no tokenizer (no tokenizer.json in its folder); "
                                  "pass --tokenizer with a Hugging Face tokenizer folder or a GGUF file", "tokenizer")
    app.add_middleware(SageMakerRoutes, task=engine.task)  # innermost: an invocation is answered as its route is
    if cfg.request_id_headers:
        app.add_middleware(RequestIdHeader)
    if cfg.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=cfg.allowed_methods,
                           allow_headers=cfg.allowed_headers, allow_credentials=cfg.allow_credentials)
    admission = Admission(cfg.max_queued_requests, cfg.max_queued_tokens, metrics, queue_counts)
    pricer = RequestPricer(cfg.served_model_name, cfg.pricing, cfg.gpu_hour_price)
    metrics.pricer = pricer if pricer.enabled else None
    metrics.deterministic.set(int(engine.deterministic))
    formatter = ResponseFormatter(tok, pricer, cfg.return_tokens_as_token_ids)
    app.state.engine, app.state.admission = engine, admission

    api_keys = [cfg.api_key] if isinstance(cfg.api_key, str) else list(cfg.api_key or [])
    # with several API-server processes the engine process keeps the adapters' names, for all of them
    served_adapters = SharedServedAdapters if cfg.api_server_count > 1 else ServedAdapters
    app.state.adapters = adapters = served_adapters(engine, cfg.lora_dirs)
    for name, path in cfg.lora_modules.items():  # read and checked now: a bad adapter stops the start-up
        if name in cfg.base_names:
            raise InvalidRequestError(f"--lora-modules: adapter name {name!r} is the base model's name", "lora_modules")
        adapters.load_at_start(name, path)

    def presented_key(request: Request) -> str:
        """The caller's API key: OpenAI clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`."""
        header = request.headers.get("authorization", "")
        return header[len("Bearer "):] if header.startswith("Bearer ") else request.headers.get("x-api-key", "")

    async def check_auth(request: Request):
        if not api_keys:
            return
        key = presented_key(request)
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in api_keys):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def cache_salt(raw: Request, req) -> str | None:
        """Tenant isolation for the prefix cache: with --prefix-cache-salt-from, the salt comes from who is
        calling; a client's own cache_salt can only split its tenant further, never join another's."""
        source = cfg.prefix_cache_salt_from
        if source is None:
            return req.cache_salt
        if source == "api-key":
            tenant = presented_key(raw)
        else:
            name = source.split(":", 1)[1]
            tenant = raw.headers.get(name)
            if not tenant:
                raise APIError(400, f"this server keys its prefix cache by the {name} header; send it", param=name,
                               code="missing_tenant_header")
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        return digest + ("|" + req.cache_salt if req.cache_salt else "")

    async def check_model(name: str | None) -> LoRARequest | None:
        """The request's `model`: the base (None) or one of the adapters (its LoRARequest); 404 for anything else."""
        if name is None or name in cfg.base_names:
            return None
        adapter = await adapters.find(name)
        if adapter is None:
            raise ModelNotFoundError(name)
        return adapter

    def check_task(task: str) -> None:
        """Each engine runs one kind of model (vLLM's --runner): a request for another kind is the client's error.
        "score" (/score, /rerank) is served by an embedding model and by a cross-encoder (a one-class classifier)."""
        num_labels = engine.model_config.num_labels
        if task == engine.task or (task == "score" and score_method(engine.task, num_labels)):
            return
        served = {"generate": "generates text with it", "embed": "computes embeddings with it (--runner pooling): "
                  "POST /v1/embeddings, /score, /rerank", "classify": "classifies with it (--runner pooling): POST "
                  "/classify" + (", /score, /rerank" if num_labels == 1 else f" ({num_labels} classes)")}[engine.task]
        wanted = {"generate": "text generation", "embed": "the Embeddings API", "classify": "the Classification API",
                  "score": "the Score API"}
        hint = {"generate": "a model with an LM head under --runner generate",
                "embed": "--runner pooling with an embedding or generative model",
                "classify": "--runner pooling with a *ForSequenceClassification model",
                "score": "--runner pooling with an embedding model, or a cross-encoder (a classifier of one class)"}
        raise APIError(400, f"The model {cfg.served_model_name} does not support {wanted[task]}: this server {served}; "
                            f"{wanted[task]} needs {hint[task]}", param="model", code="model_not_supported")

    def check_ready() -> None:
        if not engine.alive:
            raise EngineDeadError(engine.why_dead())  # 503 engine_dead, saying why

    def log_extras(req) -> None:
        if req.model_extra:
            logger.info("ignoring unknown request fields: %s", sorted(req.model_extra))

    @asynccontextmanager
    async def admitted(req, task: str = "generate"):
        """What every request to the engine goes through first: the model name, an engine that does `task`
        ("generate", "embed" or "classify": --runner), a live engine, then a place in the queue (429 when it is full). Yields
        the reserved slot, which the body fills with the prompts' tokens; if the body raises (a bad prompt or
        parameter), the slot is handed back."""
        adapter = await check_model(req.model)
        check_task(task)
        check_ready()
        log_extras(req)
        slot = admission.reserve()
        try:
            yield slot, adapter
        except BaseException:
            slot.release()
            raise

    def request_outputs(req, prompts: list[list[int]], params: SamplingParams, rid: str, slot, salt: str | None,
                        adapter: LoRARequest | None):
        """The request's outputs from the engine, merged over its prompts, under its own or the server's timeout;
        it leaves the queue (its slot) at its first output."""
        timeout = req.timeout or cfg.request_timeout
        if cfg.log_requests:
            logger.info("request %s: %s prompt tokens, adapter %s, %s", rid, "+".join(str(len(p)) for p in prompts),
                        adapter.lora_name if adapter is not None else None, params)
        if getattr(req, "use_beam_search", False):
            return beam_search_outputs(engine, prompts, params, req.length_penalty, rid, slot, req.priority, timeout,
                                       salt, adapter)
        order = getattr(req, "kv_transfer_params", None)
        if order is not None and len(prompts) != 1:
            raise InvalidRequestError("kv_transfer_params takes one prompt", "kv_transfer_params")
        return merged_outputs(engine, prompts, params, rid, slot, req.priority, timeout, salt, adapter, order)

    def structured_spec(req) -> tuple[StructuredOutputsParams | None, str | None]:
        """response_format (OpenAI) or structured_outputs (vLLM) as one spec, and the field to name in errors."""
        rf, so = req.response_format, req.structured_outputs
        if so is not None and rf is not None and rf.type != "text":
            raise APIError(400, "give response_format or structured_outputs, not both", param="response_format")
        if so is not None:
            fields = {"json": so.json_, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
                      "grammar": so.grammar}
            return StructuredOutputsParams(**fields, disable_any_whitespace=so.disable_any_whitespace), "structured_outputs"
        if rf is None or rf.type == "text":
            return None, None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required for type json_schema", param="response_format")
        schema = rf.json_schema.schema_
        if rf.json_schema.strict and isinstance(schema, dict):
            schema = _strict(schema)
        return StructuredOutputsParams(json=schema), "response_format"

    async def compile_grammar(spec: StructuredOutputsParams | None, param: str | None) -> None:
        """Build the grammar in a worker thread, bounded in time, so that a bad or slow one never reaches the engine
        (which then finds it in its cache)."""
        if spec is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.structured.compile, spec, param), cfg.grammar_compile_timeout)
        except asyncio.TimeoutError:
            raise APIError(400, f"{param}: the grammar took longer than {cfg.grammar_compile_timeout:g} s to compile",
                           param=param, code="grammar_compile_timeout") from None
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=param) from None

    def sampling_params(req, prompt_len: int, logprobs: int | None, prompt_logprobs: int | None, default_max: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        if req.prompt_logprobs is not None:
            if req.stream:  # as vLLM: they would arrive before any token, in no chunk's shape
                raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
            prompt_logprobs = max(req.prompt_logprobs, prompt_logprobs or 0)
        defaults = engine.sampling_defaults  # the model's generation_config.json, for what the request leaves unset
        # each field: the request's, else the model's default, else SamplingParams' own
        sampling = {name: value for name in DEFAULTED_FIELDS
                    if (value := getattr(req, name)) is not None or (value := defaults.get(name)) is not None}
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None and prompt_len >= engine.max_model_len:  # the prompt alone fills the context
            where = "messages" if hasattr(req, "messages") else "prompt"
            raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
                                f"{where} resulted in {prompt_len} tokens. Please reduce the length of the {where}.",
                           param=where, code="context_length_exceeded")
        if max_tokens is None and "max_tokens" in defaults:
            max_tokens = min(defaults["max_tokens"], engine.max_model_len - prompt_len)
        elif max_tokens is None:
            max_tokens = default_max if default_max is not None else engine.max_model_len - prompt_len
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if prompt_len + max_tokens > engine.max_model_len:
            raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
                                "Please reduce the length of the messages or completion.", param="max_tokens", code="context_length_exceeded")
        try:
            bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        params = SamplingParams(
            n=req.n, **sampling, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=bias or None,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids or [],
            allowed_token_ids=req.allowed_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens, structured_outputs=structured,
        )
        params.validate_for_model(engine.model_config.vocab_size, engine.max_logprobs)
        if getattr(req, "use_beam_search", False):  # what beam search cannot honour is refused now, as a 400
            beam, processors = beam_search_from(params, req.length_penalty)
            beam.step_params(engine.max_logprobs, **processors)
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
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def model_cards() -> list[dict]:
        """The base model under each of its names, then the adapters (vLLM's model cards)."""
        now = int(time.time())
        base = [{"id": name, "object": "model", "created": now, "owned_by": "llmserve", "root": cfg.served_model_name,
                 "parent": None, "max_model_len": engine.max_model_len} for name in cfg.base_names]
        loras = [{"id": a.lora_name, "object": "model", "created": now, "owned_by": "llmserve", "root": a.lora_path,
                  "parent": cfg.served_model_name, "max_model_len": engine.max_model_len} for a in await adapters.served()]
        return base + loras

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        return {"object": "list", "data": await model_cards()}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(check_auth)])
    async def retrieve_model(model: str):
        """OpenAI's GET /v1/models/{model} (client.models.retrieve); 404 model_not_found for another name."""
        card = next((c for c in await model_cards() if c["id"] == model), None)
        if card is None:
            raise ModelNotFoundError(model)
        return card

    if cfg.dev_mode:
        @app.post("/reset_prefix_cache", dependencies=[Depends(check_auth)])
        async def reset_prefix_cache():
            """vLLM's dev-mode route (LLMSERVE_SERVER_DEV_MODE=1): prompts from now on find no prefix cached before
            (to measure cold prefill between benchmark runs). 200 when nothing cached is left; 409 while running
            requests still hold cached blocks (freed blocks were forgotten)."""
            if not await asyncio.wrap_future(engine.call("reset_prefix_cache")):
                return errors.error_response(409, "running requests still hold cached prefix blocks; they were kept "
                                             "(the free ones were forgotten): call again once they finish")
            return Response(status_code=200)

    @app.get("/version")
    async def version():
        from llmserve import __version__

        return {"version": __version__}

    if cfg.allow_runtime_lora_updating:
        install_lora_routes(app, adapters, cfg.base_names, check_auth)

    model_tool_format = tool_calls.format_for_template(tok.chat_template, cfg.tool_call_parser)
    logger.info("tool calls in the %s format (%s)", model_tool_format.name,
                "--tool-call-parser" if cfg.tool_call_parser != "auto" else "read from the chat template")

    def chat_messages(req: ChatCompletionRequest, fmt: tool_calls.ToolFormat) -> list[dict]:
        """The messages as chat templates read them. Earlier tool calls carry their arguments as objects (as Hugging
        Face templates expect); a template that does not render tools gets them, and earlier calls, as text."""
        messages = []
        for m in req.messages:
            msg = {"role": m.role, "content": _text(m.content)}
            if m.name:
                msg["name"] = m.name
            if m.tool_call_id:
                msg["tool_call_id"] = tool_calls.model_call_id(fmt, m.tool_call_id)
            if m.tool_calls:
                calls = [{**c.model_dump(), "id": tool_calls.model_call_id(fmt, c.id)} for c in m.tool_calls]
                if not fmt.native:
                    shown = tool_calls.render_calls_as_text(fmt, calls)
                    msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + shown
                else:
                    for c in calls:
                        args = c["function"]["arguments"]
                        if isinstance(args, str):
                            try:
                                c["function"]["arguments"] = json.loads(args)
                            except ValueError:
                                raise APIError(400, "messages: a tool call's arguments are not valid JSON", param="messages") from None
                    msg["tool_calls"] = calls
            messages.append(msg)
        if req.tools and not fmt.native:
            prompt = tool_calls.system_prompt_with_tools(fmt, req.tools)
            if messages[0]["role"] in ("system", "developer"):
                messages[0] = {**messages[0], "role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        return messages

    def render_chat(req: ChatCompletionRequest) -> list[int]:
        fmt = model_tool_format
        messages = chat_messages(req, fmt)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools and fmt.native:
            kwargs["tools"] = req.tools
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message")
            text = tok.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
            final = messages[-1]["content"]
            cut = text.rfind(final)
            text = text[: cut + len(final)] if final and cut >= 0 else text
        else:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    def tool_grammar(req: ChatCompletionRequest, fmt) -> tuple[StructuredOutputsParams | None, bool]:
        """tool_choice "required" or a named function: a grammar that forces the call. Returns it and whether a
        function was named."""
        if req.tool_choice is not None and not req.tools:
            raise APIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
        if not req.tools:
            return None, False
        tool_calls.validate_tools(req.tools, req.tool_choice)
        named = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
        if req.tool_choice != "required" and named is None:
            return None, False
        if req.structured_outputs is not None or (req.response_format is not None and req.response_format.type != "text"):
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with response_format "
                                "or structured_outputs", param="tool_choice")
        lark = tool_calls.forcing_grammar(fmt, req.tools, named, req.parallel_tool_calls and named is None,
                                          tok.special_token_id)
        return StructuredOutputsParams(lark=lark), named is not None

    @app.post("/tokenize", dependencies=[Depends(check_auth)])
    async def tokenize(req: TokenizeRequest):
        await check_model(req.model)
        if req.messages is not None:
            chat_req = ChatCompletionRequest(messages=req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt)
            if req.tools:
                tool_calls.validate_tools(req.tools, None)
            ids = render_chat(chat_req)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(t) for t in ids]  # the vocabulary's own strings, as vLLM's
        return out

    @app.post("/detokenize", dependencies=[Depends(check_auth)])
    async def detokenize(req: DetokenizeRequest):
        await check_model(req.model)
        if any(not 0 <= t < engine.model_config.vocab_size for t in req.tokens):
            raise APIError(400, "tokens has ids outside the vocabulary", param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: CompletionRequest, raw: Request):
        async with admitted(req) as (slot, adapter):
            p = req.prompt
            if req.suffix:  # OpenAI's insertion: the model writes what goes between the prompt and the suffix
                prompts, texts = fill_in_the_middle(p, req.suffix), ([p] if isinstance(p, str) else list(p))
            elif isinstance(p, str):
                prompts, texts = [tok.encode(p)], [p]
            elif p and isinstance(p[0], str):
                prompts, texts = [tok.encode(x) for x in p], list(p)
            elif p and isinstance(p[0], int):
                prompts = [list(p)]
            elif p and isinstance(p[0], list):
                prompts = [list(x) for x in p]
            else:
                raise APIError(400, "prompt must not be empty", param="prompt")
            if any(not ids for ids in prompts):
                raise APIError(400, "prompt must not be empty", param="prompt")
            vocab = engine.model_config.vocab_size
            if not isinstance(p, str) and not isinstance(p[0], str):  # token ids: checked before they are decoded
                if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for ids in prompts for t in ids):
                    raise APIError(400, f"prompt has token ids outside the vocabulary [0, {vocab})", param="prompt")
                texts = [tok.decode(x, skip_special_tokens=False) for x in prompts]
            salt = cache_salt(raw, req)
            spec, spec_param = structured_spec(req)
            longest = max(len(ids) for ids in prompts)
            params = sampling_params(req, longest, req.logprobs, req.logprobs if (req.echo and req.logprobs is not None) else None, 16,
                                     spec)
            params = best_of_params(req, params)
            await compile_grammar(spec, spec_param)
            slot.add_tokens(sum(len(x) for x in prompts))
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": adapter.lora_name if adapter else cfg.served_model_name}
        lens = [len(x) for x in prompts]
        agen = request_outputs(req, prompts, params, rid, slot, salt, adapter)

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
                        lp = formatter.completion_logprobs(c.token_ids[n_before:], c.logprobs[n_before:], 0)
                    choice = {"index": i * params.n + c.index, "text": text, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if req.return_token_ids:  # vLLM's: the prompt's ids with a choice's first chunk, then each delta's
                        choice.update({"prompt_token_ids": prompts[i]} if n_before == 0 else {},
                                      token_ids=list(c.token_ids[n_before:]))
                    yield {"choices": [choice]}

            first = [{"choices": [{"index": i * params.n + j, "text": texts[i], "logprobs": None, "finish_reason": None}]}
                     for i in range(len(prompts)) for j in range(params.n)] if req.echo else []
            include = cfg.force_include_usage or bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(formatter.stream(agen, chunks, include, lens, base, first, continuous),
                                     media_type="text/event-stream")

        finals = await collect_finals(raw, agen)
        usage = formatter.usage(lens, [finals[i] for i in range(len(prompts))])
        if params.n > req.n:  # best_of: the n most likely of the samples (all of them count in usage, as OpenAI's)
            finals = {i: best_of_outputs(out, req.n, req.logprobs is not None) for i, out in finals.items()}
        choices = []
        for i in range(len(prompts)):
            out = finals[i]
            for c in out.outputs:
                text = (texts[i] if req.echo else "") + c.text
                lp = None
                if req.logprobs is not None:
                    prompt_part = (prompts[i], out.prompt_logprobs) if req.echo else None
                    lp = formatter.completion_logprobs(c.token_ids, c.logprobs, 0, prompt_part)
                ids_of = {"prompt_token_ids": prompts[i], "token_ids": list(c.token_ids)} if req.return_token_ids else {}
                if req.prompt_logprobs is not None:
                    ids_of["prompt_logprobs"] = formatter.prompt_logprobs(prompts[i], out.prompt_logprobs,
                                                                          req.prompt_logprobs)
                choices.append({**ids_of, "index": i * req.n + c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**base, "choices": choices, "usage": usage}

    def echoed_content(req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's text, when it has the role the answer will have."""
        if not req.echo:
            return ""
        role = cfg.response_role if req.add_generation_prompt else "assistant"
        last = req.messages[-1]
        if last.role != role or last.content is None:
            return ""
        return last.content if isinstance(last.content, str) else "".join(part.text for part in last.content)

    def fill_in_the_middle(prompt, suffix: str) -> list[list[int]]:
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not texts or not all(isinstance(t, str) for t in texts):
            raise APIError(400, "suffix needs the prompt as text (a string or a list of strings)", param="prompt")
        prompts = [tok.fill_in_the_middle(t, suffix) for t in texts]
        if prompts[0] is None:
            raise APIError(400, f"suffix needs a model trained to fill in the middle (its vocabulary has FIM tokens, "
                                f"as Qwen2.5-Coder's, StarCoder's or DeepSeek-Coder's); {cfg.served_model_name} has "
                                "none", param="suffix")
        return prompts

    def best_of_params(req: CompletionRequest, params: SamplingParams) -> SamplingParams:
        """OpenAI's best_of: best_of samples per prompt, of which the n with the highest log probability per token
        are returned; their logprobs are needed to rank them, asked for or not."""
        if req.best_of is None or req.best_of == req.n:
            return params
        if req.best_of < req.n:
            raise APIError(400, f"best_of must be greater than or equal to n, got best_of={req.best_of}, n={req.n}",
                           param="best_of")
        if req.stream:
            raise APIError(400, "best_of cannot be used with stream: the best samples are known only at the end",
                           param="best_of")
        if req.use_beam_search:
            raise APIError(400, "best_of and use_beam_search: give n beams alone", param="best_of")
        ranked = dataclasses.replace(params, n=req.best_of, logprobs=params.logprobs or 0)
        ranked.validate_for_model(engine.model_config.vocab_size, engine.max_logprobs)
        return ranked

    async def chat_inputs(req: ChatCompletionRequest, raw: Request) -> ChatInputs:
        """What a chat request (or a Responses request, as one) gives the engine; its errors are the client's (400)."""
        # parse the output for calls
        fmt = model_tool_format.with_tools(req.tools) if req.tools and req.tool_choice != "none" else None
        forced, named = tool_grammar(req, model_tool_format)
        ids = render_chat(req)
        salt = cache_salt(raw, req)
        k = (req.top_logprobs or 0) if req.logprobs else None
        spec, spec_param = (forced, "tools") if forced is not None else structured_spec(req)
        params = sampling_params(req, len(ids), k, None, None, spec)
        if fmt is not None and fmt.layout == "marker" and tok.special_token_id(fmt.start) is not None:
            # Mistral's [TOOL_CALLS] is a control token, which decoding would drop with the calls' only sign (vLLM's
            # Mistral parser does the same)
            params = dataclasses.replace(params, skip_special_tokens=False)
        await compile_grammar(spec, spec_param)
        return ChatInputs(ids, params, salt, k, fmt, named)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat(req: ChatCompletionRequest, raw: Request):
        async with admitted(req) as (slot, adapter):
            ids, params, salt, k, fmt, named = await chat_inputs(req, raw)
            slot.add_tokens(len(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        echoed = echoed_content(req)
        base = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": int(time.time()), "model": adapter.lora_name if adapter else cfg.served_model_name}
        agen = request_outputs(req, [ids], params, rid, slot, salt, adapter)
        parsers = [ChatOutputParser(cfg.reasoning_parser, fmt, named) for _ in range(params.n)]

        if req.stream:
            sent: dict[int, int] = {}

            def chunks(_, out):
                for c in out.outputs:
                    if not c.delta_token_ids and c.finish_reason is None:
                        continue
                    n_before = sent.get(c.index, 0)
                    sent[c.index] = len(c.token_ids)
                    lp = formatter.chat_logprobs(c.token_ids[n_before:], c.logprobs[n_before:], k) if k is not None else None
                    parser = parsers[c.index]
                    delta = parser.delta(c.text, c.delta_text, c.finish_reason is not None)
                    if not delta and c.finish_reason is None and lp is None and not req.return_token_ids:
                        continue  # held back (a marker may be starting)
                    choice = {"index": c.index, "delta": delta, "logprobs": lp,
                              "finish_reason": parser.finish_reason(c.finish_reason, parser.sent_calls)}
                    if req.return_token_ids:  # every token's id, held-back text or not
                        choice["token_ids"] = list(c.token_ids[n_before:])
                    yield {"choices": [choice]}

            role = cfg.response_role if req.add_generation_prompt else "assistant"
            first = [{"choices": [{"index": j, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}],
                      **({"prompt_token_ids": ids} if req.return_token_ids and j == 0 else {})}
                     for j in range(params.n)]
            if echoed:
                first += [{"choices": [{"index": j, "delta": {"content": echoed}, "logprobs": None,
                                        "finish_reason": None}]} for j in range(params.n)]
            include = cfg.force_include_usage or bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(formatter.stream(agen, chunks, include, [len(ids)], base, first, continuous),
                                     media_type="text/event-stream")

        out = (await collect_finals(raw, agen))[0]
        choices = []
        for c in out.outputs:
            parser = parsers[c.index]
            message, has_calls = parser.message(c.text)
            if req.add_generation_prompt:
                message["role"] = cfg.response_role
            if echoed:
                message["content"] = echoed + (message.get("content") or "")
            choices.append({"index": c.index, "message": message,
                            "logprobs": formatter.chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None,
                            "finish_reason": parser.finish_reason(c.finish_reason, has_calls), "stop_reason": c.stop_reason,
                            **({"token_ids": list(c.token_ids)} if req.return_token_ids else {})})
        prompt_ids = {"prompt_token_ids": ids} if req.return_token_ids else {}  # vLLM's return_token_ids
        if req.prompt_logprobs is not None:
            prompt_ids["prompt_logprobs"] = formatter.prompt_logprobs(ids, out.prompt_logprobs, req.prompt_logprobs)
        return {**base, **prompt_ids, "choices": choices, "usage": formatter.usage([len(ids)], [out])}

    install_responses_routes(app, engine, cfg, formatter, check_auth, admitted, chat_inputs, request_outputs)
    install_embeddings_routes(app, engine, cfg, check_auth, admitted, render_chat, request_outputs)
    install_batch_routes(app, cfg, check_auth, presented_key)
    install_messages_routes(app, engine, cfg, check_auth, check_model, admitted, chat_inputs, render_chat,
                            request_outputs)
    if cfg.webui and engine.task == "generate":  # the playground chats: nothing to do with an embedding model
        mount_webui(app)
    return app


def create_server(engine_config, server_config: ServerConfig | None = None, engine_process: bool | None = None):
    """Start the engine and return (app, engine client). engine_process: the engine loads and runs in a process of
    its own (engine_process.py); else in a thread of this one, where it shares the GIL with the HTTP side. None: the
    platform decides (a process on CUDA, a thread on CPU)."""
    if engine_process is None:
        from llmserve.platforms import get_platform

        engine_process = get_platform(engine_config.device).default_engine_process
    if engine_process:
        from llmserve.server.engine_process import EngineProcessClient

        engine = EngineProcessClient(engine_config)
    else:
        from llmserve.engine.llm_engine import LLMEngine

        def load() -> LLMEngine:  # in the thread that steps it
            llm = LLMEngine(engine_config)
            llm.structured.warm_up()  # now, not when the first grammar would stall the running steps
            return llm

        engine = AsyncEngine(load)
    cfg = server_config or ServerConfig(served_model_name=engine.model_name)
    if not cfg.served_model_name:
        cfg.served_model_name = engine.model_name
    metrics = Metrics(cfg.served_model_name)
    engine.metrics = metrics
    try:
        return build_app(engine, cfg, metrics), engine
    except BaseException:  # a bad --lora-modules adapter: stop the engine (its process) before the error goes up
        engine.shutdown()
        raise
