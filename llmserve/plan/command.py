"""`llmserve plan`: the capacity planner on the command line."""

from __future__ import annotations

import json

from llmserve.bench.report import format_table


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory, FLOPs, rooflines, KV transfer and cost for a model on given hardware",
                       description="MODEL is a preset (see --list-presets), a config.json, a Hugging Face folder or a GGUF file "
                                   "(default: the built-in model).")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--weight-dtype", default=None, help="BF16, FP16, FP8, INT8, INT4, NVFP4, MXFP4 or a GGUF type (Q4_K, Q8_0, ...); "
                   "default: as stored for a GGUF file, else BF16")
    p.add_argument("--kv-dtype", default="BF16", help="BF16, FP16, FP8 or FP32")
    p.add_argument("--context", type=int, default=8192, help="tokens per request (prompt + output)")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests")
    p.add_argument("--hardware", default="H100-SXM", help="H100-SXM, H100-PCIe, H200, B200, A100-40GB, A100-80GB, L4, L40S, MI300X, "
                   "or cpu (this machine, measured)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens for TTFT and KV transfer (default: the context)")
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of peak FLOP/s reached by matmuls")
    p.add_argument("--overhead", type=float, default=0.06, help="activations and runtime, as a fraction of weights + KV")
    p.add_argument("--memory-utilization", type=float, default=1.0, help="fraction of device memory the engine may use")
    p.add_argument("--link-gbps", type=float, default=400.0, help="prefill-to-decode link for KV transfer")
    p.add_argument("--handoff-ms", type=float, default=50.0, help="fixed cost of a remote prefill (queueing, set-up)")
    p.add_argument("--gpu-hour-price", type=float, default=None, help="USD per device-hour (default: a typical 2026 rate)")
    p.add_argument("--utilization", type=float, default=0.6, help="share of paid hours doing useful work, for cost")
    p.add_argument("--input-per-output", type=float, default=3.0, help="input tokens per output token, for blended cost")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list-presets", action="store_true")
    p.set_defaults(func=cmd_plan, verbose=False)


def cmd_plan(args) -> int:
    from llmserve.plan.estimate import PlanInputs, Planner, plan_rows
    from llmserve.plan.hardware import get_hardware
    from llmserve.plan.models import PRESETS, load_spec

    if args.list_presets:
        print("\n".join(PRESETS))
        return 0
    spec = load_spec(args.model)
    inputs = PlanInputs(
        spec=spec, hardware=None, weight_format=args.weight_dtype, kv_format=args.kv_dtype, context=args.context, batch=args.batch,
        tensor_parallel=args.tp, prompt_len=args.prompt_len, mfu=args.mfu, overhead_fraction=args.overhead,
        memory_utilization=args.memory_utilization, link_gbps=args.link_gbps, handoff_ms=args.handoff_ms,
        gpu_hour_price=args.gpu_hour_price, utilization=args.utilization, input_per_output=args.input_per_output,
    )
    inputs.validate()  # before measuring a CPU for nothing
    import dataclasses

    plan = Planner(dataclasses.replace(inputs, hardware=get_hardware(args.hardware))).plan()
    if args.json:
        print(json.dumps(plan, indent=1))
        return 0
    for title, rows in plan_rows(plan):
        print(format_table([title, ""], [[k, v] for k, v in rows]))
        print()
    return 0
