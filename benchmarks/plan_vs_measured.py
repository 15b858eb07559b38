"""The capacity planner's roofline for the default model on this CPU, beside what llmserve measures, in one run.

    .venv/bin/python benchmarks/plan_vs_measured.py [--context 256] [--batches 1 32] [--json out.json]

The planner measures this machine's bandwidth and bf16 matmul rate, then predicts decode tokens/s for the
weights as llmserve serves them (bf16) at each batch; llmserve then decodes at the same batch and context.
KV bytes per token are compared with what the engine allocates.
"""

from __future__ import annotations

import argparse
import json

from llmserve import LLM, SamplingParams
from llmserve.plan.estimate import PlanInputs, Planner
from llmserve.plan.hardware import measure_cpu
from llmserve.plan.models import load_spec
from common import write_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    hw = measure_cpu()
    llm = LLM(max_num_seqs=max(args.batches))
    engine = llm.engine
    spec = load_spec(engine.model_path)
    kv_actual = engine.executor.info.kv_cache_bytes / (engine.kv.num_blocks * engine.config.block_size)
    rows = []
    tok = engine.tokenizer
    base = tok.encode("the " * args.context, add_special_tokens=False)[: args.context]
    llm.generate([base[:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for b in args.batches:
        plan = Planner(PlanInputs(spec=spec, hardware=hw, weight_format="BF16", kv_format="BF16",
                                  context=args.context + args.output_len // 2, batch=b)).plan()
        prompts = [[(t + i) % 1000 + 200 for t in base] for i in range(b)]  # distinct prompts of the same length
        engine.step_stats.clear()
        llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0), use_tqdm=False)
        decode = [s for s in engine.step_stats if not s.num_prefill_tokens and s.num_decode_seqs == b]
        measured = b * len(decode) / sum(s.seconds for s in decode)
        predicted = plan["compute"]["decode_tokens_per_s_total"]
        rows.append({"batch": b, "predicted_tokens_per_s": predicted, "measured_tokens_per_s": measured,
                     "measured_over_predicted": measured / predicted, "bound": plan["compute"]["decode_bound"]})
    result = {
        "hardware": {"bandwidth_GBps": hw.bandwidth_tbps * 1e3, "bf16_TFLOPs": hw.tflops["bf16"]},
        "kv_bytes_per_token": {"predicted": spec.kv_bytes_per_token(2), "allocated_by_llmserve": kv_actual,
                               "engine_dtype": engine.executor.info.dtype},
        "decode": rows,
    }
    print(json.dumps(result, indent=1))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
