"""`llmserve` command line: generate, serve, gateway, bench, plan, info."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from llmserve.config import QUANTIZATION_METHODS
from llmserve.engine_args import add_engine_args, engine_config_from_args
from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.gc_policy import freeze_startup_heap
from llmserve.server.tool_calls import PARSER_NAMES as TOOL_CALL_PARSERS


def cmd_generate(args) -> int:
    from llmserve.sampling_params import SamplingParams

    # the request and the settings are checked first: a bad flag is refused before torch and the model load (2 s)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, structured_outputs=_structured(args))
    config = engine_config_from_args(args)
    from llmserve.loader import resolve_model_path

    resolve_model_path(config.model)  # a missing or pickled model: one line, before torch loads (2 s)
    from llmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    lora = None
    if args.lora:
        from llmserve.lora import LoRARequest

        lora = LoRARequest(os.path.basename(os.path.normpath(args.lora)), 1, args.lora)
    engine.add_request("cli", prompt, params, lora_request=lora)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    if args.verbose:
        stats = list(engine.step_stats)
        decode = [s for s in stats if s.num_decode_tokens and not s.num_prefill_tokens]
        if decode:
            tps = len(decode) / sum(s.seconds for s in decode)
            print(f"[decode {tps:.1f} tokens/s over {len(decode)} steps]", file=sys.stderr)
    return 0


def _structured(args):
    """--json-schema / --regex / --choice / --grammar (llama.cpp's flags); a value @PATH is read from that file."""
    from llmserve.sampling_params import StructuredOutputsParams

    def read(value, flag):
        if value is None or not value.startswith("@"):
            return value
        try:
            with open(value[1:], encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise InvalidRequestError(f"{flag}: cannot read {value[1:]}: {e.strerror}", flag) from None

    given = {"json": read(args.json_schema, "--json-schema"), "regex": args.regex, "choice": args.choice,
             "grammar": read(args.grammar, "--grammar")}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    spec = StructuredOutputsParams(**given)
    from llmserve.structured.manager import check_grammar

    check_grammar(spec)  # a malformed grammar is refused before the model loads
    return spec


def json_list(text: str, flag: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's --allowed-origins '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequestError(f"{flag} takes a JSON list of strings, e.g. '[\"https://example.com\"]'; got "
                                  f"{text!r}", flag.lstrip("-").replace("-", "_"))
    return value


def cmd_serve(args) -> int:
    from llmserve.lora.registry import parse_lora_module
    from llmserve.server.api_servers import leave_on_sigterm, run_http_server, serve_with_api_servers
    from llmserve.server.app import ServerConfig, create_server

    logging.getLogger("llmserve").setLevel(logging.INFO)
    from llmserve.plan.pricing import PricingConfig

    if args.gpu_hour_price is not None and args.gpu_hour_price <= 0:
        raise InvalidRequestError("--gpu-hour-price must be positive", "gpu_hour_price")
    cfg = ServerConfig(
        served_model_name=(args.served_model_name or [""])[0], served_model_aliases=(args.served_model_name or [])[1:],
        prefix_cache_salt_from=args.prefix_cache_salt_from,
        api_key=args.api_key or ([k for k in os.environ.get("LLMSERVE_API_KEY", "").split(",") if k] or None),
        max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens, request_timeout=args.request_timeout,
        pricing=PricingConfig.load(args.pricing) if args.pricing else None, gpu_hour_price=args.gpu_hour_price,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        grammar_compile_timeout=args.grammar_compile_timeout, webui=not args.no_webui,
        lora_modules=dict(parse_lora_module(m) for m in args.lora_modules or []), lora_dirs=args.lora_dir or [],
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, api_server_count=args.api_server_count,
        allowed_origins=json_list(args.allowed_origins, "--allowed-origins"),
        allowed_methods=json_list(args.allowed_methods, "--allowed-methods"),
        allowed_headers=json_list(args.allowed_headers, "--allowed-headers"), allow_credentials=args.allow_credentials,
        uvicorn_log_level=args.uvicorn_log_level, log_requests=args.enable_log_requests,
        max_stored_responses=args.max_stored_responses, response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids, request_id_headers=args.enable_request_id_headers,
        root_path=args.root_path, force_include_usage=args.enable_force_include_usage,
        uvicorn_access_log=not args.disable_uvicorn_access_log, openapi=not args.disable_fastapi_docs,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs, dev_mode=os.environ.get("LLMSERVE_SERVER_DEV_MODE") == "1",
    )
    if cfg.api_server_count > 1 and args.engine_process is False:
        raise InvalidRequestError("--api-server-count above 1 needs the engine in a process of its own: drop "
                                  "--no-engine-process", "api_server_count")
    engine_config = engine_config_from_args(args)
    from llmserve.loader import resolve_model_path

    resolve_model_path(engine_config.model)  # a missing or pickled model: one line, before any process starts
    prefill_process = None
    if args.disaggregated:
        engine_config, prefill_process = start_disaggregated(engine_config, cfg)
    if cfg.api_server_count > 1:
        leave_on_sigterm()
        try:
            return serve_with_api_servers(engine_config, cfg, args.host, args.port, cfg.api_server_count)
        finally:
            if prefill_process is not None:
                prefill_process.terminate()
                prefill_process.wait(timeout=30)
    try:
        app, engine = create_server(engine_config, cfg, engine_process=args.engine_process)
    except BaseException:
        if prefill_process is not None:
            prefill_process.kill()
        raise
    print(f"llmserve: serving {cfg.served_model_name} on {cfg.scheme}://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    if engine.task == "embed":
        print("llmserve: an embedding model (--runner pooling): POST /v1/embeddings, /score, /rerank", file=sys.stderr,
              flush=True)
    elif engine.task == "classify":
        print("llmserve: a classifier (--runner pooling): POST /classify", file=sys.stderr, flush=True)
    elif cfg.webui:
        print(f"llmserve: playground at {cfg.scheme}://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    leave_on_sigterm()
    try:
        died = run_http_server(app, engine, host=args.host, port=args.port, options=cfg.uvicorn_options)
    finally:
        engine.shutdown()
        if prefill_process is not None:
            prefill_process.terminate()
            prefill_process.wait(timeout=30)
    return 1 if died else 0


def start_disaggregated(engine_config, server_config):
    """`serve --disaggregated` on one machine: a prefill instance in its own process on the first half of the
    cores, this process the decode instance (and the front) on the other half."""
    from llmserve.kv_transfer.prefill_process import spawn_prefill_instance
    from llmserve.platforms import get_platform

    if engine_config.kv_role is not None:
        raise InvalidRequestError("--disaggregated starts both roles itself: drop --role", "kv_role")
    engine_config, process = spawn_prefill_instance(engine_config, server_config.served_model_name)
    get_platform(engine_config.device).bind_rank(1, 2)  # this thread and the threads it starts: the decode half
    return engine_config, process


def cmd_gateway(args) -> int:
    import uvicorn

    from llmserve.gateway.app import build_gateway_app
    from llmserve.gateway.config import GatewayConfig

    logging.getLogger("llmserve").setLevel(logging.INFO)
    config = GatewayConfig.load(args.config)
    keys = args.api_key or [k for k in os.environ.get(config.api_keys_env or "LLMSERVE_GATEWAY_API_KEY", "").split(",") if k]
    for name, backend in config.backends.items():
        if backend.api_key_env and not os.environ.get(backend.api_key_env):
            print(f"llmserve gateway: warning: backends.{name}.api_key_env: {backend.api_key_env} is not set", file=sys.stderr)
    app = build_gateway_app(config, keys, webui=not args.no_webui)
    freeze_startup_heap()  # full collections would stop every stream it relays (gc_policy.py)
    print(f"llmserve gateway: {len(config.models)} models over {len(config.backends)} backends on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def _tensor_parallel_sizes(model_config) -> str:
    """The sizes (up to 8) that split this model, with the KV heads per rank where they split unevenly."""
    from llmserve.executor.multiproc import check_tensor_parallel

    sizes = []
    for size in range(1, 9):
        try:
            check_tensor_parallel(model_config, size)
        except InvalidRequestError:
            continue
        base, extra = divmod(model_config.num_key_value_heads, size)
        sizes.append(f"{size} (KV heads {'+'.join(str(base + (r < extra)) for r in range(size))})" if extra else str(size))
    return ", ".join(sizes)


def cmd_run_batch(args) -> int:
    from llmserve.entrypoints.run_batch import run_batch
    from llmserve.lora.registry import parse_lora_module
    from llmserve.server.app import ServerConfig

    if args.max_concurrency < 1:
        raise InvalidRequestError("--max-concurrency must be at least 1", "max_concurrency")
    cfg = ServerConfig(served_model_name=(args.served_model_name or [""])[0],
                       served_model_aliases=(args.served_model_name or [])[1:], request_timeout=args.request_timeout,
                       tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser, webui=False,
                       lora_modules=dict(parse_lora_module(m) for m in args.lora_modules or []),
                       max_queued_requests=args.max_concurrency, uvicorn_access_log=False)
    total, failed = run_batch(engine_config_from_args(args), cfg, args.input_file, args.output_file,
                              args.max_concurrency)
    where = "standard output" if args.output_file == "-" else args.output_file
    print(f"llmserve: {total} requests, {failed} failed; answers in {where}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    import torch

    from llmserve.loader import load_model_files

    from llmserve.engine_args import json_object_arg

    files = load_model_files(args.model, load_tokenizer=False, load_format=args.load_format,
                             hf_overrides=json_object_arg(args, "hf_overrides"), convert=args.convert,
                             quantization=args.quantization)
    c = files.config
    windowed = sum(1 for i in range(c.num_hidden_layers) if c.layer_sliding_window(i))
    rows = [
        ("model", files.path),
        ("architecture", c.architecture),
        # what --runner auto makes of it
        ("runs as", "a text generator (--runner generate; --runner pooling for embeddings)" if c.has_lm_head else
         "a one-class classifier: a cross-encoder (reranker) or reward model (--runner pooling: /score, /rerank, "
         "/classify)" if c.num_labels == 1 else
         f"a classifier of {c.num_labels} classes (--runner pooling: /classify)" if c.num_labels else
         "an embedding model (--runner pooling: /v1/embeddings)"),
        ("quantization", c.quantization + ("; on CPU its 4-bit codes run as they are in llmserve's int4 kernel "
                                           "(--decode-quantization auto)" if c.checkpoint_int4_codes else "")),
        *([("linear weights' types", ", ".join(f"{n} {t}" for t, n in Counter(c.weight_formats.values()).most_common())
            + " (--decode-quantization auto on CPU: Q4_0/Q4_1/Q4_K as int4 with their codes, other low-bit types "
              "int8, float ones float)")] if c.weight_formats else []),
        ("parameters", f"{c.num_parameters / 1e6:.1f}M"),
        ("weights in file", f"{c.weight_file_bytes / 2**20:.1f} MiB"),
        # what a step multiplies depends on the run's settings (--dtype, --decode-quantization): the file's own
        # low-bit blocks where llmserve's kernels serve them, else the weights widened to the serving dtype
        ("weights widened (bf16 / float32)", f"{c.num_parameters * 2 / 2**20:.1f} / {c.num_parameters * 4 / 2**20:.1f} MiB"),
        ("layers / hidden / FFN", f"{c.num_hidden_layers} / {c.hidden_size} / {c.intermediate_size}"),
        *([("experts", f"{c.num_experts}, {c.num_experts_per_tok} per token, FFN {c.moe_intermediate_size} each")]
          if c.num_experts else []),
        ("heads / KV heads / head dim", f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}"),
        ("KV bytes per token (bf16)", f"{c.kv_bytes_per_token(torch.bfloat16):,} (2 x {c.num_hidden_layers} layers x {c.num_key_value_heads} KV heads x {c.head_dim} x 2 bytes)"),
        *([("sliding window", f"{c.sliding_window:,} tokens, on {windowed} of {c.num_hidden_layers} layers (the "
                                 "cache keeps every key)")] if windowed else []),
        *([("no rotary embedding (NoPE)", f"on {len(c.no_rope_layers)} of {c.num_hidden_layers} layers")]
          if c.no_rope_layers else []),
        *([("scales (Granite)", f"embeddings x{c.embedding_multiplier:g}, block outputs x{c.residual_multiplier:g}, "
                                f"attention scores x{c.attention_scale:g}, logits / {c.logits_scaling:g}")]
          if (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) != (1.0, 1.0, 1.0) else []),
        *([("soft-capping", ", ".join(f"{name} {cap:g}" for name, cap in (("attention scores", c.attn_logit_softcapping),
                                                                          ("logits", c.final_logit_softcapping)) if cap))]
          if c.attn_logit_softcapping or c.final_logit_softcapping else []),
        ("context length", f"{c.max_position_embeddings:,}"),
        ("vocab", f"{c.vocab_size:,}"),
        ("tied embeddings", str(c.tie_word_embeddings)),
        ("--tensor-parallel-size", _tensor_parallel_sizes(c)),
    ]
    from llmserve.config import EngineConfig
    from llmserve.platforms import get_platform

    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, deterministic=args.deterministic)
    platform = get_platform(args.device)
    deterministic = platform.resolve_deterministic(config)
    dtype = platform.resolve_dtype(dataclasses.replace(config, deterministic=deterministic))
    rows += [
        ("serving device / dtype", f"{platform.device} / {str(dtype).removeprefix('torch.')}"),
        ("deterministic (batch-invariant)", "on: a request's tokens and logprobs do not depend on its batch" if deterministic
         else "off (--deterministic: float32 on CPU)"),
    ]
    chosen = platform.with_defaults(config)
    rows.append(("scheduling defaults", f"--max-num-seqs {chosen.max_num_seqs}, --max-num-batched-tokens "
                 f"{chosen.max_num_batched_tokens}, {platform.kv_sizing(chosen)} on {platform.name}"))
    if platform.name == "cuda":
        from llmserve.graphs.cuda_graphs import MAX_CAPTURE_SIZE, capture_sizes

        sizes = capture_sizes(min(chosen.max_num_seqs, MAX_CAPTURE_SIZE))
        rows.append(("CUDA graphs", f"decode steps of up to {sizes[-1]} sequences, {len(sizes)} batch sizes "
                     "(--max-cudagraph-capture-size; off with --enforce-eager)"))
    rows.append(("async output processing", "on: a step's outputs are made while the next step computes "
                 "(--no-async-output-proc)" if platform.resolve_async_output_proc(config)
                 else "off (--async-output-proc; on by default on CUDA)"))
    rows.append(("async scheduling", "off by default; --async-scheduling launches each step before the previous "
                 "step's tokens reach the host"))
    rows.append(("serve: the engine runs in", "a process of its own (--no-engine-process: a thread of the server's)"
                 if platform.default_engine_process else
                 "a thread of the server's process (--engine-process: a process of its own)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM inference engine and OpenAI-compatible server")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--lora", default=None, metavar="PATH", help="run the prompt through this LoRA adapter (a PEFT folder)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    c = g.add_argument_group("structured output (one of)")
    c.add_argument("--json-schema", default=None, metavar="SCHEMA|@FILE", help="the output is JSON valid against this schema")
    c.add_argument("--regex", default=None, help="the output matches this regular expression")
    c.add_argument("--choice", action="append", default=None, help="the output is one of these strings (repeatable)")
    c.add_argument("--grammar", default=None, metavar="GRAMMAR|@FILE", help="a Lark or GBNF grammar")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in vLLM's `vllm serve MODEL` (the same as --model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=None,
                   help="require Authorization: Bearer KEY on /v1; repeat for several tenants (or LLMSERVE_API_KEY=k1,k2)")
    s.add_argument("--prefix-cache-salt-from", default=None, metavar="api-key|header:NAME",
                   help="isolate the prefix cache per tenant: by API key, or by a header a trusted gateway sets")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API (default: the model file's name); with several, requests may "
                   "use any and responses say the first")
    s.add_argument("--max-queued-requests", type=int, default=256, help="beyond this, requests get 429 at once")
    s.add_argument("--max-queued-tokens", type=int, default=1 << 20, help="prompt tokens allowed to wait at once")
    s.add_argument("--request-timeout", type=float, default=None, help="seconds; a request then ends with what it has")
    s.add_argument("--pricing", default=None, help="JSON price table: {\"models\": {NAME: {\"input\", \"cached_input\", \"output\"}}} "
                   "in USD per 1M tokens; each response's usage then carries its cost")
    s.add_argument("--gpu-hour-price", type=float, default=None, help="USD per device-hour: without a price table, a request costs "
                   "the compute time it used at this price")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_CALL_PARSERS],
                   help="how the model writes tool calls (default: read from its chat template)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM needs it for tool_choice \"auto\"; here that is always on where the model's tool-call "
                   "format is known, so it changes nothing")
    s.add_argument("--seed", dest="engine_seed", type=int, default=0,
                   help="the sampler's seed for requests without a seed of their own (default 0, as vLLM)")
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="put the model's <think>...</think> in reasoning_content")
    s.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds a response_format / structured_outputs grammar may take to compile (then 400)")
    s.add_argument("--no-webui", action="store_true", help="do not serve the web playground at /")
    s.add_argument("--allowed-origins", default='["*"]', metavar="JSON",
                   help='CORS: origins whose web pages may call the API, as vLLM (default \'["*"]\'; \'[]\' turns '
                   'CORS off)')
    s.add_argument("--allowed-methods", default='["*"]', metavar="JSON",
                   help="CORS: allowed methods (default '[\"*\"]')")
    s.add_argument("--allowed-headers", default='["*"]', metavar="JSON",
                   help="CORS: allowed request headers (default '[\"*\"]')")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: let browsers send cookies and credentials")
    s.add_argument("--ssl-certfile", default=None, metavar="PEM", help="HTTPS: the server's certificate (chain)")
    s.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="HTTPS: the certificate's private key")
    s.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                   help="HTTPS: CA certificates that client certificates are checked against")
    s.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="HTTPS: client certificates 0 not asked for, 1 checked if given, 2 required")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (info: one access-log line per HTTP request)")
    s.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request as it arrives: id, prompt tokens, sampling parameters (not the prompt)")
    s.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older spelling of --no-enable-log-requests (the default)")
    s.add_argument("--response-role", default="assistant", help="the role chat answers carry (vLLM's flag)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:N' (vLLM's flag; for tokens that are not whole characters)")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer with an X-Request-Id header: the request's own if it sent one")
    s.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves the API under, e.g. /llm (requests may carry it or not)")
    s.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with its usage chunk, whether stream_options asked for it or not")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access-log line per HTTP request")
    s.add_argument("--disable-fastapi-docs", action="store_true", help="no /openapi.json")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted for vLLM's command lines: usage always has prompt_tokens_details.cached_tokens")
    s.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="accepted for vLLM's command lines: llmserve logs no prompt text or ids to shorten")
    s.add_argument("--max-stored-responses", type=int, default=1000, metavar="N",
                   help="Responses API: how many responses are kept (in memory) for GET /v1/responses/{id} and "
                        "previous_response_id, the oldest forgotten first; 0 keeps none")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, requests, KV use every 10 s of activity) in the log")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own (the default on CUDA), or (--no-engine-process) in a "
                        "thread of the server's process (the default on CPU), where it shares the GIL with the HTTP side")
    s.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="HTTP server processes in front of the one engine process, on one port: more cores for "
                        "streaming, tokenizing and JSON when one process cannot keep up with the engine")
    s.add_argument("--disaggregated", action="store_true",
                   help="run a prefill instance and a decode instance (each its own process and half of the cores) "
                        "with KV handed over between them; this server is the decode side and the front")
    s.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served by name: a request's model names one")
    s.add_argument("--lora-dir", action="append", default=None, metavar="DIR",
                   help="a folder that runtime-loaded adapters may come from (repeatable)")
    s.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; "
                        "folders inside --lora-dir only)")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    rb = sub.add_parser("run-batch", help="a file of OpenAI Batch API requests through the server's routes, "
                        "answers to a file (vLLM's run-batch)")
    rb.add_argument("-i", "--input-file", required=True, metavar="PATH|URL|-",
                    help="JSONL, one request per line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"}")
    rb.add_argument("-o", "--output-file", required=True, metavar="PATH|URL|-",
                    help="JSONL answers in the input's order (a URL is written with PUT)")
    rb.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (the same as --model)")
    rb.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the model's name in the requests' bodies and the answers (default: the file's name)")
    rb.add_argument("--max-concurrency", type=int, default=256, metavar="N",
                    help="requests in flight at once (the engine batches them; default 256)")
    rb.add_argument("--request-timeout", type=float, default=None, help="seconds; a request then ends with what it has")
    rb.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_CALL_PARSERS])
    rb.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"])
    rb.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                    help="LoRA adapters (PEFT folders) by name: a line's body.model names one")
    add_engine_args(rb)
    rb.set_defaults(func=cmd_run_batch)

    gw = sub.add_parser("gateway", help="one OpenAI-compatible front for many backends: routing, fallbacks, cost")
    gw.add_argument("--config", required=True, help="the gateway's YAML file (docs/gateway.md)")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8080)
    gw.add_argument("--api-key", action="append", default=None,
                    help="the gateway's own key (repeatable); else from the config's api_keys_env or LLMSERVE_GATEWAY_API_KEY")
    gw.add_argument("--no-webui", action="store_true", help="do not serve the web playground at /")
    gw.add_argument("-v", "--verbose", action="store_true")
    gw.set_defaults(func=cmd_gateway)

    from llmserve.bench.command import add_parser as add_bench_parser

    add_bench_parser(sub)

    from llmserve.plan.command import add_parser as add_plan_parser

    add_plan_parser(sub)

    i = sub.add_parser("info", help="architecture, size and KV cost of a model")
    i.add_argument("model", nargs="?", default=None)
    i.add_argument("--device", default="auto", help="the device whose settings to report (auto, cpu, cuda, ...)")
    i.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    i.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="report the batch-invariant mode as asked (default: as the platform decides)")
    i.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: a folder with only config.json (its shapes)")
    i.add_argument("--hf-overrides", default=None, metavar="JSON", help="keys of the folder's config.json replaced")
    i.add_argument("--convert", default="auto", choices=["auto", "embed", "classify"],
                   help="classify: a generative model read as a classifier over its LM head (with --hf-overrides' "
                   "classifier_from_token)")
    i.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="the pre-quantized checkpoint's method, checked against its config.json")
    i.set_defaults(func=cmd_info, verbose=False)
    return parser


def run_as_torchrun_worker(args) -> bool:
    """Under torchrun every process runs this command; ranks other than 0 serve rank 0's engine as its workers and
    return True when it shuts down."""
    from llmserve.executor.multiproc import run_torchrun_worker

    return run_torchrun_worker(engine_config_from_args(args))


def main(argv: list[str] | None = None) -> int:
    from llmserve.bench.command import normalize_argv

    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else list(argv)))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="llmserve: %(message)s", stream=sys.stderr)
    try:
        if getattr(args, "model_tag", None) is not None:
            if args.model is not None and args.model != args.model_tag:
                raise InvalidRequestError(f"two models given: {args.model_tag} and --model {args.model}", "model")
            args.model = args.model_tag
        if getattr(args, "tensor_parallel_size", 1) > 1 and run_as_torchrun_worker(args):
            return 0
        return args.func(args)
    except LLMServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as e:  # unreadable files, damaged weights: still one line for the user
        if os.environ.get("LLMSERVE_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
