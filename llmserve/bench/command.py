"""`llmserve bench run` (the default) and `llmserve bench compare`."""

from __future__ import annotations

import datetime as dt
import math
import os
import sys

from llmserve.bench import report, workloads
from llmserve.bench.metrics import SLO
from llmserve.bench.runner import ClientProcesses, LoadLevel, event_loop_runner, run_sweep
from llmserve.engine_args import add_engine_args, engine_config_from_args
from llmserve.errors import InvalidRequestError
from llmserve.gc_policy import freeze_startup_heap

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn")


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server (or llmserve in-process): TTFT, ITL, goodput, sweeps",
                       description="Subcommands: run (the default: `llmserve bench --base-url ...`) and compare.")
    bsub = b.add_subparsers(dest="bench_command", required=True)

    r = bsub.add_parser("run", help="run a benchmark (default)")
    target = r.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    target.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $LLMSERVE_API_KEY)")
    target.add_argument("--engine", action="store_true", help="run llmserve's engine in this process instead of calling a server "
                        "(--model is then a GGUF file or HF folder)")
    target.add_argument("--endpoint", choices=["completions", "chat", "embeddings"], default=None,
                        help="default: completions (chat for multi-turn); embeddings: an embedding server's "
                        "/v1/embeddings (throughput in input tokens/s, latency as E2E)")
    target.add_argument("--timeout", type=float, default=600, help="seconds per request")

    w = r.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    w.add_argument("--dataset", default=None, help="JSONL file: {\"prompt\"} or {\"messages\"} per line (overrides --workload)")
    w.add_argument("--tokenizer", default=None, help="GGUF file or HF (tokenizer) folder whose tokenizer builds prompts of "
                   "exact length (default: the engine's model, else the built-in default model); with --engine, the "
                   "engine's tokenizer too")
    w.add_argument("--input-len", type=int, default=200, help="prompt tokens (synthetic)")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    w.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix: tokens per system prompt")
    w.add_argument("--question-len", type=int, default=32, help="shared-prefix: tokens per question")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    w.add_argument("--system-len", type=int, default=500, help="multi-turn: system prompt tokens")
    w.add_argument("--user-len", type=int, default=64, help="multi-turn: tokens per user message")
    w.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens (every benchmark should)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0)

    ld = r.add_argument_group("load")
    ld.add_argument("--concurrency", default=None, help="sessions in flight; a list (1,4,16) sweeps")
    ld.add_argument("--request-rate", default=None, help="sessions per second, Poisson; a list sweeps; inf = all at once")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson, < 1 burstier")
    ld.add_argument("--num-requests", type=int, default=None, help="sessions per level (default: 4 x concurrency, at least 16)")
    ld.add_argument("--duration", type=float, default=None, help="stop starting sessions after this many seconds per level")
    ld.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    ld.add_argument("--client-processes", type=int, default=1,
                    help="client processes sharing the load, each with its own event loop and connections: one "
                    "streams up to ~30,000 tok/s on a recent core; use more to measure a faster server")
    ld.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft_ms=500,tpot_ms=50,e2e_ms=10000")

    o = r.add_argument_group("output")
    o.add_argument("--result", default=None, help="JSON result file (default: bench-results/bench-<time>.json)")
    o.add_argument("--label", default=None, help="name of this run in comparisons (default: the model)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    eng = r.add_argument_group("engine (with --engine)")
    add_engine_args(eng, parser=r)
    for action in r._actions:
        if action.dest == "model":
            action.help = "served model name at --base-url (default: the first it lists); with --engine, a GGUF file or HF folder"
    r.set_defaults(func=cmd_run)

    c = bsub.add_parser("compare", help="two result files side by side, with ratios")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--plot", default=None, help="write both Pareto curves and distributions to PREFIX.*.png")
    c.set_defaults(func=cmd_compare, verbose=False)


def normalize_argv(argv: list[str]) -> list[str]:
    """`llmserve bench --base-url ...` means `llmserve bench run --base-url ...`."""
    if len(argv) >= 1 and argv[0] == "bench" and (len(argv) == 1 or argv[1] not in ("run", "compare", "-h", "--help")):
        return ["bench", "run", *argv[1:]]
    return argv


def _numbers(text: str | None, name: str, kind) -> list:
    if text is None:
        return []
    try:
        values = [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InvalidRequestError(f"--{name} takes numbers separated by commas, got {text!r}", name) from None
    if not values or any(v <= 0 for v in values):
        raise InvalidRequestError(f"--{name} values must be positive", name)
    return values


def load_levels(args) -> list[LoadLevel]:
    concurrencies = _numbers(args.concurrency, "concurrency", int)
    rates = _numbers(args.request_rate, "request-rate", float)
    if args.burstiness <= 0:
        raise InvalidRequestError("--burstiness must be positive", "burstiness")
    if len(concurrencies) > 1 and len(rates) > 1:
        raise InvalidRequestError("sweep either --concurrency or --request-rate, not both", "concurrency")
    if rates:
        cap = concurrencies[0] if concurrencies else None
        return [LoadLevel(cap, rate, args.burstiness) for rate in rates]
    return [LoadLevel(c) for c in (concurrencies or [1])]


def _check_positive(args, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < 1:
            raise InvalidRequestError(f"--{name} must be at least 1, got {value}", name)


def make_workload(args, tokenizer):
    """Returns (make_sessions(n, seed) -> sessions, endpoint, description)."""
    _check_positive(args, ["input-len", "output-len", "num-prefixes", "prefix-len", "question-len", "turns", "user-len", "num-requests"])
    if not 0 <= args.range_ratio < 1:
        raise InvalidRequestError("--range-ratio must be in [0, 1)", "range-ratio")
    if args.dataset:
        rows = workloads.from_jsonl(args.dataset, args.output_len)
        chat = any(t.messages is not None for s in rows for t in s.turns)
        if args.endpoint in ("completions", "embeddings") and chat:
            raise InvalidRequestError("this dataset has chat messages; use --endpoint chat", "endpoint")
        if args.endpoint == "embeddings":
            return (lambda n, seed: [rows[i % len(rows)] for i in range(n)]), "embeddings", \
                {"workload": "dataset", "dataset": os.path.abspath(args.dataset), "rows": len(rows)}
        desc = {"workload": "dataset", "dataset": os.path.abspath(args.dataset), "rows": len(rows)}
        return (lambda n, seed: [rows[i % len(rows)] for i in range(n)]), "chat" if chat else "completions", desc

    endpoint = args.endpoint or ("chat" if args.workload == "multi-turn" else "completions")
    chat = endpoint == "chat"
    if args.workload == "multi-turn" and not chat:
        raise InvalidRequestError("the multi-turn workload needs --endpoint chat", "endpoint")
    if endpoint == "embeddings" and args.engine and args.runner == "generate":
        raise InvalidRequestError("--endpoint embeddings needs an embedding engine: add --runner pooling", "endpoint")
    desc = {"workload": args.workload, "output_len": args.output_len}
    if args.workload == "synthetic":
        desc.update(input_len=args.input_len, range_ratio=args.range_ratio)

        def make(n, seed):
            return workloads.synthetic(tokenizer, n, args.input_len, args.output_len, args.range_ratio, seed, chat)
    elif args.workload == "shared-prefix":
        desc.update(num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, question_len=args.question_len)

        def make(n, seed):
            per_prefix = max(1, math.ceil(n / args.num_prefixes))
            return workloads.shared_prefix(tokenizer, args.num_prefixes, per_prefix, args.prefix_len, args.question_len,
                                           args.output_len, seed, chat)[:n]
    else:
        desc.update(turns=args.turns, system_len=args.system_len, user_len=args.user_len)

        def make(n, seed):
            return workloads.multi_turn(tokenizer, n, args.turns, args.system_len, args.user_len, args.output_len, seed)
    return make, endpoint, desc


def level_line(summary: dict, endpoint: str) -> str:
    """A finished level in one line: what a text server streams, or what an embedding server answers."""
    if endpoint == "embeddings":
        return (f"{summary['total_token_throughput']:.1f} input tok/s, {summary['request_throughput']:.2f} req/s, "
                f"mean E2E {(summary['mean_e2e_ms'] or 0):.0f} ms")
    return f"{summary['output_throughput']:.1f} output tok/s, mean TTFT {(summary['mean_ttft_ms'] or 0):.0f} ms"


def cmd_run(args) -> int:
    from llmserve.bench.backends import EngineBackend, HTTPBackend
    from llmserve.loader import load_model_files, load_tokenizer_from

    levels = load_levels(args)
    slo = SLO.parse(args.slo)
    if args.duration is not None and args.duration <= 0:
        raise InvalidRequestError("--duration must be positive", "duration")
    if args.warmup < 0:
        raise InvalidRequestError("--warmup must be 0 or more", "warmup")
    if args.client_processes < 1:
        raise InvalidRequestError("--client-processes must be at least 1", "client-processes")
    if args.client_processes > 1 and args.engine:
        raise InvalidRequestError("--client-processes needs a server (--base-url): with --engine the engine runs in "
                                  "this process", "client-processes")

    if args.engine:
        backend = EngineBackend(engine_config_from_args(args), args.ignore_eos, args.temperature)
        tokenizer = backend.llm.tokenizer
    else:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMSERVE_API_KEY")
        tokenizer = load_tokenizer_from(args.tokenizer) if args.tokenizer else load_model_files(None).tokenizer
        extra = {"temperature": args.temperature, **({"ignore_eos": True} if args.ignore_eos else {})}
        backend = HTTPBackend(args.base_url, args.model, api_key, args.timeout, extra)
    make, endpoint, desc = make_workload(args, tokenizer)
    if not args.engine:
        backend.endpoint = endpoint

    def sessions_for(k: int):
        """Level k's sessions (k = -1: the warm-up), each level drawn afresh so no level warms another's cache."""
        if k < 0:
            return make(args.warmup, args.seed + 999)
        n = args.num_requests or (desc["rows"] if args.dataset else max(16, 4 * (levels[k].concurrency or 4)))
        return make(n, args.seed + 1000 * (k + 1))

    result_path = args.result or os.path.join("bench-results", f"bench-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    count_tokens = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer is not None else None

    async def main():
        clients = None
        try:
            model = await backend.start()
            if args.client_processes > 1:  # started now: the server answered, so each of them will too
                clients = ClientProcesses(args.client_processes, (args.base_url, model, api_key, args.timeout, extra,
                                                                  endpoint))
            freeze_startup_heap()  # a full collection here would show as the server's (or engine's) latency (gc_policy.py)
            print(f"llmserve bench: {model} at {'this process (engine)' if args.engine else args.base_url}; "
                  f"{desc['workload']} workload, {endpoint} endpoint; {len(levels)} level(s)"
                  + (f"; {args.client_processes} client processes" if clients else ""), file=sys.stderr)
            results = await run_sweep(backend, sessions_for, levels, slo, args.warmup, args.duration, args.seed,
                                      progress=not args.quiet, count_tokens=count_tokens, clients=clients,
                                      on_level=lambda lv: print(f"  {lv['label']}: {level_line(lv['summary'], endpoint)}",
                                                                file=sys.stderr))
            return model, results
        finally:
            if clients is not None:
                clients.close()
            await backend.close()

    model, levels_out = event_loop_runner()(main())
    result = {
        "tool": "llmserve bench",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "llmserve " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("llmserve") else None,
        "label": args.label or model,
        "target": "engine" if args.engine else args.base_url,
        "model": model,
        "endpoint": endpoint,
        "workload": desc,
        "ignore_eos": args.ignore_eos,
        "levels": levels_out,
    }
    report.write_result(result_path, result)
    print(report.summary_table(levels_out))
    print(f"\nresult: {result_path}")
    if not args.no_plots:
        for path in report.plot_results([(result["label"], result)], os.path.splitext(result_path)[0]):
            print(f"plot: {path}")
    return 0


def cmd_compare(args) -> int:
    a, b = report.load_result(args.a), report.load_result(args.b)
    name_a, name_b = a.get("label") or "A", b.get("label") or "B"
    if name_a == name_b:
        name_a, name_b = f"A ({name_a})", f"B ({name_b})"
    print(f"A = {args.a}\nB = {args.b}\n")
    print(report.compare_table(a, b, name_a, name_b))
    if args.plot:
        for path in report.plot_results([(name_a, a), (name_b, b)], args.plot):
            print(f"plot: {path}")
    return 0
