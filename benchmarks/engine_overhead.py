"""The host's time per decode step (scheduling, step inputs, sampling bookkeeping, outputs, detokenizing), apart from
the model's arithmetic.

    .venv/bin/python benchmarks/engine_overhead.py [--sequences 256] [--output-len 64] [--rounds 3]
        [--output-kind cumulative|delta|final_only]

On a GPU a decode step of a small model over hundreds of sequences takes a few milliseconds, so the Python the
engine runs around each step bounds the throughput; on a CPU the model's arithmetic hides it. This runs a tiny
random-weight Llama (the default model's vocabulary and tokenizer, 2 layers of width 64) on the CPU with
`--sequences` greedy requests at once and takes out of `LLMEngine.step`'s time what a GPU would compute: the model's
forward and the sampler's argmax over the logits. What is left is Python the host runs on the step's critical path:
the scheduler, the step input, the runner's input buffers and attention metadata, the sampler's bookkeeping, the
outputs and the detokenizer. Prints its milliseconds per step and per sequence (median of the rounds) and writes
them to --json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from common import write_json  # noqa: E402
from gpu_bench import build_hf_model, llmserve_engine, make_tokenizer, random_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-kind", choices=["cumulative", "delta", "final_only"], default="cumulative",
                    help="what the engine returns per step: every request's output (a server's streams), or only the "
                         "finished ones (LLM.generate)")
    ap.add_argument("--json", default="bench-results/engine_overhead.json")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="engine-overhead-")
    tokenizer = os.path.join(root, "tokenizer")
    make_tokenizer(tokenizer)
    model = build_hf_model("tiny", os.path.join(root, "tiny"), tokenizer, torch.device("cpu"))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    engine = llmserve_engine(os.path.join(root, "tiny"), state,
                             argparse.Namespace(device="cpu", kv_cache_memory="512MiB"), dtype="float32",
                             max_num_seqs=args.sequences, max_num_batched_tokens=max(8192, args.sequences))
    from llmserve import sampling_params
    from llmserve.sampling_params import SamplingParams

    device_seconds = [0.0]  # what a GPU computes, taken out of the step's time

    def timed(fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                device_seconds[0] += time.perf_counter() - t
        return call

    runner = engine.executor.runner
    forward = timed(runner.model.forward)
    last_logits = [None]

    def forward_keeping_logits(*args, **kwargs):
        # The logits (256 x 49k floats) stay alive until the next forward frees them, inside the timed call: on the
        # CPU freeing them returns 50 MB to the system (~4 ms), which a GPU's caching allocator does not do.
        t = time.perf_counter()
        last_logits[0] = None
        device_seconds[0] += time.perf_counter() - t
        last_logits[0] = forward(*args, **kwargs)
        return last_logits[0]

    runner.model.forward = forward_keeping_logits
    runner.sampler._argmax = timed(runner.sampler._argmax)
    kinds = getattr(sampling_params, "RequestOutputKind", None)  # a checkout from before output kinds: cumulative
    extra = {"output_kind": getattr(kinds, args.output_kind.upper())} if kinds is not None else {}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, **extra)
    per_step = []
    for r in range(args.rounds + 1):  # the first round warms up
        for p in random_prompts(args.sequences, args.prompt_len, r):
            engine.add_request(None, p, params)
        while engine.num_waiting:  # the prompts' steps are not what is measured
            engine.step()
        device_seconds[0], steps = 0.0, 0
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if r:
            per_step.append((time.perf_counter() - t - device_seconds[0]) / steps)
    ms = statistics.median(per_step) * 1000
    result = {"sequences": args.sequences, "output_kind": args.output_kind, "host_ms_per_step": ms, "host_us_per_sequence": ms * 1000 / args.sequences,
              "rounds_ms": [s * 1000 for s in per_step]}
    print(f"host: {ms:.2f} ms per step of {args.sequences} sequences ({result['host_us_per_sequence']:.1f} us each)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
