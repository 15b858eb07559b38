"""GPU serving figures for issue 37, llmserve and transformers side by side on the same random weights, in one run.

    # here (CPU), once: the default model's tokenizer as a folder (the GGUF is too large to travel)
    .venv/bin/python benchmarks/gpu_bench.py --make-tokenizer .whl/smollm2-tokenizer
    # on the GPU machine (see benchmarks/gpu_run.sh, which also installs the carried wheels)
    python3 benchmarks/gpu_bench.py --tokenizer .whl/smollm2-tokenizer --json $OUT/gpu_bench.json

For each shape (Llama-shaped, bf16, vocabulary 49,152, random weights: speed does not depend on their values) the
Hugging Face model is built on the GPU with transformers, then:
- the bandwidth bound at batch 1: the measured device copy rate (bytes read + written per second) over the weights'
  bytes, in tokens per second;
- transformers: `generate` at batch 1 (128 tokens after a 16-token prompt), and `generate_batch` on N prompts of
  L random ids, O tokens out each (EOS ignored) for throughput;
- the Hugging Face model is freed and llmserve's engine loads the same weights (from memory, no file): batch-1 decode
  and the same N x L/O workload, with max_num_seqs 256, max_num_batched_tokens 8192 and --kv-cache-memory; again
  with --attention-backend triton, and on the deterministic shape with --deterministic, where one greedy request
  alone and inside a batch of 64 is compared (tokens and logprobs), in that mode and in the default one.
For the serving shape the folder is also written to disk and `llmserve serve` is loaded by `llmserve bench` at each
concurrency (L tokens in, O out, EOS ignored): output tok/s, TTFT and ITL percentiles, and the server's output rate
at the highest concurrency over the offline engine's; then, at the highest concurrency, the same with the engine the
other way (on CUDA --no-engine-process: in a thread of the server's process) as the reference for the default, and
with --api-servers HTTP processes (`--api-server-count`, default 4). Results go to one JSON file, rewritten after
every figure, so a run cut short still reports what it measured. `--shapes tiny --device cpu` runs the same code on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

VOCAB = 49152
# name: (hidden, intermediate, layers, heads, kv heads, tied embeddings)
SHAPES = {
    "tiny": (64, 128, 2, 4, 2, True),
    "smollm2-135m": (576, 1536, 30, 9, 3, True),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, False),
}


def make_tokenizer(folder: str) -> None:
    """The default GGUF's tokenizer as tokenizer.json + tokenizer_config.json (chat template, BOS/EOS)."""
    from llmserve.loader import load_model_files

    tok = load_model_files(None).tokenizer
    os.makedirs(folder, exist_ok=True)
    tok.tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}, f)
    print(f"tokenizer written to {folder}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rate(device: torch.device) -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB (64 MiB on CPU)."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * n * 10 / (time.perf_counter() - t)


def build_hf_model(name: str, folder: str, tokenizer: str, device: torch.device):
    import transformers

    hidden, inter, layers, heads, kv_heads, tied = SHAPES[name]
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=4096, tie_word_embeddings=tied, rope_theta=500000.0,
                                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no float32 copy of an 8B model first
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tokenizer, f)) as src, open(os.path.join(folder, f), "w") as dst:
            dst.write(src.read())
    return model


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g).tolist()


def hf_batch1(model, device, tokens: int) -> float:
    ids = torch.tensor(random_prompts(1, 16, 1), device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        sync(device)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)


def hf_throughput(model, prompts, output_len: int) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate_batch(inputs=prompts[:4], generation_config=config, progress_bar=False)  # warm-up
        t = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        seconds = time.perf_counter() - t
    return sum(len(r.generated_tokens) for r in results.values()) / seconds


def llmserve_engine(folder: str, state: dict, args, **overrides):
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.loader import ModelFiles
    from llmserve.loader.hf import read_config
    from llmserve.tokenizer import Tokenizer

    config, _ = read_config(folder)
    config.num_parameters = sum(t.numel() for t in state.values())
    config.weight_file_bytes = sum(t.numel() * t.element_size() for t in state.values())
    files = ModelFiles(path=folder, name=os.path.basename(folder), config=config,
                       weights=lambda: iter(state.items()), tokenizer=Tokenizer.from_hf_folder(folder))
    engine_config = EngineConfig(**{**dict(model=folder, device=args.device, dtype="bfloat16", max_num_seqs=256,
                                           max_num_batched_tokens=8192, kv_cache_memory=args.kv_cache_memory),
                                    **overrides})
    return LLMEngine(engine_config, files=files)


def run_engine(engine, prompts, output_len: int) -> tuple[float, int]:
    from llmserve.sampling_params import RequestOutputKind, SamplingParams

    # only finished outputs, as LLM.generate (and vLLM's offline throughput benchmark) asks for
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for p in prompts:
        engine.add_request(None, p, params)
    tokens = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - t, tokens


def llmserve_figures(engine, args) -> dict:
    run_engine(engine, random_prompts(2, 16, 7), 8)  # warm-up
    seconds, tokens = run_engine(engine, random_prompts(1, 16, 1), 128)
    batch1 = tokens / seconds
    run_engine(engine, random_prompts(8, args.prompt_len, 8), 8)
    seconds, tokens = run_engine(engine, random_prompts(args.num_prompts, args.prompt_len, 2), args.output_len)
    return {"llmserve_batch1_tok_s": batch1, "llmserve_throughput_tok_s": tokens / seconds}


def step_profile(engine, batch: int, steps: int = 8) -> dict:
    """Decode steps of `batch` sequences under torch's profiler: wall time per step against the GPU's busy time
    (kernels' time summed) and the kernels launched per step, which say whether the step is bound by the host or by
    the GPU; and the kernels that took the most time."""
    from torch.profiler import ProfilerActivity, profile

    from llmserve.sampling_params import SamplingParams

    device = engine.executor.runner.device
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for p in random_prompts(batch, 64, 5):
        engine.add_request(None, p, params)
    while engine.num_waiting:  # the prompts' steps
        engine.step()
    engine.step()  # every sequence decoding from here
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    # the GPU's own events (kernels, copies) are events of device type CUDA, each with its time range
    kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    sort_by = "device_time_total" if kernels else "cpu_time_total"
    return {"batch": batch, "wall_ms_per_step": wall / steps * 1e3, "kernels_per_step": len(kernels) / steps,
            "gpu_busy_ms_per_step": busy_us / steps / 1e3,
            "top": prof.key_averages().table(sort_by=sort_by, row_limit=12, max_name_column_width=60)}


def batch_invariance(engine) -> dict:
    """One greedy request alone, then the same inside a batch of 63 others: equal tokens and logprobs, bit for bit?"""
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    probe = random_prompts(1, 100, 11)[0]

    def run(prompts):
        ids = [engine.add_request(None, p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        return done[ids[0]]

    alone = run([probe])
    batched = run([probe] + random_prompts(63, 100, 12))
    return {"same_tokens": alone.token_ids == batched.token_ids, "same_logprobs": alone.logprobs == batched.logprobs}


def serving(folder: str, state: dict, args, offline_tok_s: float, flags: list[str]) -> dict:
    """`llmserve serve` at each concurrency, its engine where the platform puts it (CUDA: a process of its own); then,
    at the highest, the other way (CUDA: --no-engine-process, a thread of the server's process), as the same-run
    reference for that default."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    # issue 37's GPU defaults (KV sizing, steps' sequences and tokens, CUDA graphs), as `llmserve info` states them
    info = subprocess.run([sys.executable, "-m", "llmserve", "info", folder, "--device", args.device],
                          capture_output=True, text=True, timeout=120)
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        out = serving_sweep(folder, args, levels, flags, offline_tok_s)
        out["llmserve_info"] = info.stdout + info.stderr
    except Exception as e:  # noqa: BLE001 - the engine's own process failed: still measure the server, and say so
        out = serving_sweep(folder, args, levels, flags + ["--no-engine-process"], offline_tok_s)
        out["engine_process_error"] = f"{type(e).__name__}: {e}"
        out["llmserve_info"] = info.stdout + info.stderr
        return out
    if args.serving_engine_ab:
        from llmserve.platforms import get_platform

        other = "--no-engine-process" if get_platform(args.device).default_engine_process else "--engine-process"
        out["other_engine_mode"] = {"flag": other, **serving_sweep(folder, args, levels[-1:], flags + [other],
                                                                    offline_tok_s)}
    if args.api_servers > 1:  # the HTTP side over several processes (one streams at most ~28k tok/s on a CPU core)
        try:
            out["api_servers"] = {"count": args.api_servers, **serving_sweep(
                folder, args, levels[-1:], flags + ["--engine-process", "--api-server-count", str(args.api_servers)],
                offline_tok_s)}
        except Exception as e:  # noqa: BLE001 - recorded; the figures above stand
            out["api_servers"] = {"count": args.api_servers, "error": f"{type(e).__name__}: {e}"}
    return out


def serving_sweep(folder: str, args, levels: list[int], flags: list[str], offline_tok_s: float) -> dict:
    from serving import free_port, wait_healthy

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()]))}
    server = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--model", folder, "--port", str(port),
                               "--device", args.device, "--dtype", "bfloat16", "--max-num-seqs", "256",
                               "--max-num-batched-tokens", "8192", "--kv-cache-memory", args.kv_cache_memory,
                               "--no-webui", *flags], env=env)
    summaries = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 600, server)  # a server that exits (a failed start) ends it at once
        for level in levels:
            # each level on its own: 4 requests at concurrency 1, two waves of requests above
            result = os.path.join(tempfile.mkdtemp(prefix="gpu-bench-"), f"serving-{level}.json")
            subprocess.run([sys.executable, "-m", "llmserve", "bench", "--base-url", f"http://127.0.0.1:{port}/v1",
                            "--concurrency", str(level), "--input-len", str(args.prompt_len), "--output-len",
                            str(args.output_len), "--ignore-eos", "--num-requests", str(max(4, 2 * level)),
                            # one client process streams up to ~30,000 tok/s: above c=64 it would measure itself
                            "--client-processes", str(4 if level >= 64 else 1),
                            "--result", result, "--no-plots", "--quiet"], env=env, check=True)
            with open(result) as f:
                summaries[level] = json.load(f)["levels"][0]["summary"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    keys = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")
    out = {f"c={c}": {k: s[k] for k in keys} for c, s in summaries.items()}
    top = summaries[max(summaries)]["output_throughput"]
    out["server_over_offline_at_max_concurrency"] = top / offline_tok_s
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-tokenizer", metavar="DIR", help="write the default model's tokenizer folder and stop")
    ap.add_argument("--tokenizer", default=".whl/smollm2-tokenizer")
    # the 1B first (serving and deterministic mode run on it), the 135M last: a run cut short loses the least
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b,smollm2-135m")
    ap.add_argument("--serving-shape", default="llama-3.2-1b", help="'' for none")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--api-servers", type=int, default=4,
                    help="also serve the highest concurrency with this many API-server processes (0: do not)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-cache-memory", default="40GiB")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--variants", default="async,eager,sdpa",
                    help="llmserve variants beside the default (Triton attention, CUDA graphs, async output "
                         "processing): async (async scheduling: each step launched before the previous step's tokens "
                         "are on the host), eager (no CUDA graphs), sdpa (SDPA attention, eager), sync (outputs made "
                         "after each step, not during the next), unfused (torch's ops for the norms, rotary, SwiGLU "
                         "and KV write; also run when the default fails); '' for none")
    ap.add_argument("--variant-shapes", default="llama-3.2-1b,llama-3.1-8b",
                    help="the shapes the variants run on (each costs an engine start with its graph capture)")
    ap.add_argument("--deterministic-shape", default="llama-3.2-1b",
                    help="the shape on which deterministic mode is measured and checked for batch invariance")
    ap.add_argument("--profile-shape", default="llama-3.2-1b",
                    help="the shape whose default engine is profiled at batch 1 and at --num-prompts ('' for none)")
    ap.add_argument("--no-serving-engine-ab", dest="serving_engine_ab", action="store_false",
                    help="skip the server with its engine the other way (on CUDA: --no-engine-process, in a thread of "
                         "the server's process) at the highest concurrency")
    ap.add_argument("--json", default="bench-results/gpu_bench.json")
    args = ap.parse_args()
    if args.make_tokenizer:
        make_tokenizer(args.make_tokenizer)
        return
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "settings": vars(args), "shapes": {}}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)

    report["copy_rate_bytes_per_s"] = rate = copy_rate(device)
    save()
    root = tempfile.mkdtemp(prefix="gpu-bench-models-")
    for name in args.shapes.split(","):
        t0 = time.perf_counter()
        folder = os.path.join(root, name)
        model = build_hf_model(name, folder, args.tokenizer, device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        figures = report["shapes"][name] = {"weight_bytes": weight_bytes, "bandwidth_bound_tok_s": rate / weight_bytes}
        prompts = random_prompts(args.num_prompts, args.prompt_len, 2)
        if not args.skip_transformers:
            figures["transformers_batch1_tok_s"] = hf_batch1(model, device, 128)
            save()
            figures["transformers_generate_batch_tok_s"] = hf_throughput(model, prompts, args.output_len)
            save()
        # the weights as a state dict on the device; the HF modules go (their memory is the engine's next)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        del model
        gc.collect()
        # the default engine, then each variant on the same weights: without CUDA graphs, with SDPA attention, and
        # (on the deterministic shape) the batch-invariant mode with its batch-invariance check against the default's
        known = {"async": {"async_scheduling": True}, "eager": {"enforce_eager": True},
                 "sdpa": {"attention_backend": "sdpa"}, "sync": {"async_output_proc": False},
                 "unfused": {}}  # LLMSERVE_FUSED_KERNELS=0, set below
        variants = {"default": {}}
        if name in args.variant_shapes.split(","):
            variants.update({v: known[v] for v in args.variants.split(",") if v in known})
        if name == args.deterministic_shape:
            variants["deterministic"] = {"deterministic": True}
        queue = list(variants.items())
        while queue:
            variant, overrides = queue.pop(0)
            try:
                os.environ["LLMSERVE_FUSED_KERNELS"] = "0" if variant == "unfused" else "1"
                engine = llmserve_engine(folder, state, args, **overrides)
                info = engine.executor.info
                measured = {"attention_backend": info.attention_backend,
                            "cuda_graph_max_batch": info.cuda_graph_sizes[-1] if info.cuda_graph_sizes else 0,
                            "cuda_graph_seconds": info.cuda_graph_seconds, **llmserve_figures(engine, args)}
                if name == args.deterministic_shape and variant in ("default", "deterministic"):
                    measured["batch_invariance"] = batch_invariance(engine)
                if name == args.profile_shape and variant == "default":
                    measured["profile"] = [step_profile(engine, b) for b in (1, args.num_prompts)]
                engine.shutdown()
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
                measured = {"error": f"{type(e).__name__}: {e}"}
                if variant == "default":  # perhaps a fused kernel: the same without them, to still have figures
                    queue.insert(0, ("unfused", {}))
            if "llmserve_batch1_tok_s" in measured:
                measured["llmserve_batch1_over_bound"] = measured["llmserve_batch1_tok_s"] / rate * weight_bytes
            if variant == "default":
                figures.update(measured)
            else:
                figures.setdefault("variants", {})[variant] = measured
            save()
            engine = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if name == args.serving_shape:
            # the server as the default engine ran; if that failed, as the first variant that worked (and say so)
            flags = {"async": ["--async-scheduling"], "eager": ["--enforce-eager"],
                     "sdpa": ["--attention-backend", "sdpa"], "unfused": []}
            ran = [("default", figures)] + [(v, m) for v, m in figures.get("variants", {}).items() if v in flags]
            ok = next(((v, m) for v, m in ran if "llmserve_throughput_tok_s" in m), None)
            if ok is not None:
                os.environ["LLMSERVE_FUSED_KERNELS"] = "0" if ok[0] == "unfused" else "1"  # the server inherits it
                figures["serving"] = serving(folder, state, args, ok[1]["llmserve_throughput_tok_s"],
                                             flags.get(ok[0], []))
                figures["serving"]["variant"] = ok[0]
        del state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        figures["seconds"] = time.perf_counter() - t0
        save()
        print(name, json.dumps({k: v for k, v in figures.items() if k != "serving"}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
