"""Speculative decoding on the default model: batch-1 decode speed on repetitive tasks, throughput under load.

    .venv/bin/python benchmarks/spec_decode.py [--method ngram] [--k 6] [--json bench-results/spec.json]

Part 1 (offline, batch 1, greedy): two repetitive tasks, each run with speculation off and on in the same
process: rewrite a ~300-token code snippet with one identifier renamed, and answer by quoting a passage of
the prompt. Decode tokens/s = output tokens after the first / time of the steps after the first token.
The greedy outputs must be identical.
Part 2 (server, concurrency 32): `llmserve bench` with synthetic chat prompts against a server with
speculation off, then on; output tokens/s compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from serving import LLMSERVE, llmserve_server

from llmserve import LLM, SamplingParams
from common import write_json

SNIPPET = '''def load_inventory(path):
    """Read the inventory file: one item per line, name, count and price separated by commas."""
    inventory = {}
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, count, price = line.split(",")
            if name in inventory:
                raise ValueError(f"line {line_number}: duplicate item {name}")
            inventory[name] = {"count": int(count), "price": float(price)}
    return inventory


def total_value(inventory):
    """What the whole inventory is worth."""
    return sum(item["count"] * item["price"] for item in inventory.values())


def restock(inventory, name, amount):
    """Add stock for one item, creating it with a zero price when it is new."""
    if amount <= 0:
        raise ValueError("amount must be positive")
    item = inventory.setdefault(name, {"count": 0, "price": 0.0})
    item["count"] += amount
    return item["count"]
'''

PASSAGE = ("The lighthouse keeper climbed the one hundred and twelve steps every evening at dusk. He trimmed the wick, "
           "polished the great lens until it shone, and wound the clockwork that turned the light. Ships passing the "
           "reef at night counted the flashes, three short and one long, and knew exactly where they were. In forty "
           "years the light never failed, not in the storm of the long winter nor on the night the harbour froze.")

# (prompt, max_tokens): the rewrite is about as long as the snippet; the quote about as long as the passage
TASKS = {
    "rename identifier in code": ("Rewrite this code with the variable `inventory` renamed to `stock`. Output only the code.\n\n"
                                  + SNIPPET, 256),
    "quote a passage": ("Here is a passage:\n\n" + PASSAGE + "\n\nQuote the passage above word for word.", 96),
}


def decode_speed(llm, prompt_ids, max_tokens):
    engine = llm.engine
    engine.step_stats.clear()
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    steps = list(engine.step_stats)
    first = next(i for i, s in enumerate(steps) if s.num_prefill_tokens == 0 and i > 0) if len(steps) > 1 else len(steps)
    seconds = sum(s.seconds for s in steps[first:])
    tokens = len(out.outputs[0].token_ids) - 1
    return out.outputs[0].token_ids, tokens / seconds if seconds else float("nan")


def offline(args, dtype: str) -> list[dict]:
    base = LLM(dtype=dtype)
    spec = LLM(dtype=dtype, speculative_method=args.method, num_speculative_tokens=args.k)
    tok = base.get_tokenizer()
    rows = []
    for name, (text, max_tokens) in TASKS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        decode_speed(base, ids[:32], 4)  # warm-up
        decode_speed(spec, ids[:32], 4)
        off_tokens, off_tps = decode_speed(base, ids, max_tokens)
        before = spec.engine.speculator.stats.num_accepted_tokens, spec.engine.speculator.stats.num_draft_tokens
        on_tokens, on_tps = decode_speed(spec, ids, max_tokens)
        s = spec.engine.speculator.stats
        same = next((i for i, (a, b) in enumerate(zip(off_tokens, on_tokens)) if a != b), None)
        rows.append({"dtype": dtype, "task": name, "prompt_tokens": len(ids), "output_tokens": len(off_tokens),
                     "identical_output": off_tokens == on_tokens, "first_difference_at": same,
                     "off_tokens_per_s": off_tps, "on_tokens_per_s": on_tps, "speedup": on_tps / off_tps,
                     "acceptance_rate": (s.num_accepted_tokens - before[0]) / max(1, s.num_draft_tokens - before[1])})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def serve_case(name, server_args, args) -> dict:
    with llmserve_server(*server_args) as url:
        result = f"bench-results/spec-{name}.json"
        subprocess.run([LLMSERVE, "bench", "--base-url", f"{url}/v1", "--endpoint", "chat", "--concurrency", "32",
                        "--num-requests", str(args.num_requests), "--input-len", "200", "--output-len", "64", "--ignore-eos",
                        "--quiet", "--no-plots", "--label", name, "--result", result], check=True, stdout=subprocess.DEVNULL)
    with open(result) as f:
        return json.load(f)["levels"][0]["summary"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs("bench-results", exist_ok=True)
    result = {"method": args.method, "k": args.k, "batch1": offline(args, "float32") + offline(args, "bfloat16")}
    if not args.skip_serve:
        off = serve_case("off", [], args)
        on = serve_case("on", ["--speculative-method", args.method, "--num-speculative-tokens", str(args.k)], args)
        result["concurrency32"] = {"off_output_tokens_per_s": off["output_throughput"], "on_output_tokens_per_s": on["output_throughput"],
                                   "ratio": on["output_throughput"] / off["output_throughput"],
                                   "on_draft_tokens": on.get("spec_draft_tokens"), "on_acceptance_rate": on.get("spec_acceptance_rate")}
    print(json.dumps(result, indent=1))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
