"""Load a running OpenAI-compatible server at fixed concurrency and report TTFT, TPOT, ITL, throughput.

    .venv/bin/llmserve serve --port 8000 &
    .venv/bin/python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --concurrency 1 8 32

Definitions as `vllm bench serve`: TTFT = send → first token; TPOT = (E2E − TTFT) / (output tokens − 1);
ITL = every gap between streamed chunks, pooled; output throughput = output tokens / wall time of the
level. Prompts are ~200 tokens, 128 output tokens, EOS ignored; token counts from the server's usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

WORDS = ("inference serving batches requests together so that each forward pass reads the weights once for many "
         "sequences while the key value cache keeps the attention state of every token already processed ").split()


def prompt(i: int, words: int) -> str:
    return f"Request {i}. " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))


async def one(client, model, i, args):
    body = {"model": model, "prompt": prompt(i, args.prompt_words), "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", "/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    e2e = stamps[-1] - t0
    ttft = stamps[0] - t0
    out_tokens = usage["completion_tokens"]
    return {"ttft": ttft, "e2e": e2e, "tpot": (e2e - ttft) / max(out_tokens - 1, 1),
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "out": out_tokens, "in": usage["prompt_tokens"]}


async def level(base_url, model, concurrency, args):
    sem = asyncio.Semaphore(concurrency)
    n = max(args.min_requests, concurrency * args.rounds)

    async def guarded(client, i):
        async with sem:
            return await one(client, model, i, args)

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await one(client, model, 10_000, argparse.Namespace(**{**vars(args), "output_len": 4}))  # warm-up, not counted
        t = time.perf_counter()
        results = await asyncio.gather(*[guarded(client, i) for i in range(n)])
        wall = time.perf_counter() - t
    itl = [g for r in results for g in r["itl"]]

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "concurrency": concurrency, "requests": n, "mean_input_tokens": statistics.mean(r["in"] for r in results),
        "output_tokens_per_s": sum(r["out"] for r in results) / wall,
        "mean_ttft_s": statistics.mean(r["ttft"] for r in results), "p50_ttft_s": statistics.median(r["ttft"] for r in results),
        "p99_ttft_s": pct([r["ttft"] for r in results], 0.99),
        "mean_tpot_ms": 1000 * statistics.mean(r["tpot"] for r in results),
        "mean_itl_ms": 1000 * statistics.mean(itl), "p99_itl_ms": 1000 * pct(itl, 0.99),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = concurrency x rounds")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=195, help="~200 tokens with the default tokenizer")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = args.model or httpx.get(args.base_url + "/models").json()["data"][0]["id"]
    rows = [asyncio.run(level(args.base_url, model, c, args)) for c in args.concurrency]
    print(json.dumps(rows, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
