"""The engine's command-line flags (vLLM's names where vLLM has the feature), shared by generate, serve and bench,
and the EngineConfig they make (validated there, once)."""

from __future__ import annotations

import argparse
import json

from llmserve.config import ATTENTION_BACKENDS, QUANTIZATION_METHODS
from llmserve.errors import InvalidRequestError


def add_engine_args(p, parser: argparse.ArgumentParser | None = None) -> None:
    """The engine's flags on `p` (a parser, or a group of one); their own groups go on `parser` (default `p`), since
    argparse deprecates groups nested in groups."""
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: built-in SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees one, else CPU), cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-memory", default=None, help="bytes for the KV cache, e.g. 2GiB (default: a fraction of free memory)")
    p.add_argument("--kv-cache-fraction", type=float, default=None,
                   help="fraction of the memory free after the weights for the KV cache (default on CPU: 0.10, at "
                   "most 1 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="GPUs, as vLLM: the share of the device's memory in use once the KV cache is made, weights "
                   "included (default on CUDA: 0.9; ignored on CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: K/V in float8 e4m3, half the memory and bytes read per step")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in a step (default: 64 on CPU, "
                   "256 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in a step (default: 1024 on "
                   "CPU, 8192 on CUDA)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="TOKENS",
                   help="each prompt gets at most this many tokens of a step, so that a long prompt does not hold "
                   "back the others' first tokens (0: up to the whole step)")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted for vLLM's command lines: prompts are always computed in chunks here")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off automatic prefix caching (on by default)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True, help="vLLM's spelling of the same (--no-enable-prefix-caching turns it off)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for what a request leaves unset: auto the model's generation_config.json, "
                   "vllm none, or a folder holding one")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='sampling defaults laid over --generation-config\'s, in generation_config.json\'s names, e.g. '
                   '\'{"temperature": 0.5, "max_new_tokens": 64}\'')
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template that replaces the model's: a file, or the template itself")
    if "--tokenizer" not in (parser or p)._option_string_actions:  # bench has its own, with the same meaning
        p.add_argument("--tokenizer", default=None, metavar="FOLDER|GGUF",
                       help="a tokenizer other than the model's: a Hugging Face folder with tokenizer.json, or a GGUF "
                       "file")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs a request may ask for per token (-1: the whole vocabulary)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; changes nothing: llmserve runs no code from model folders")
    p.add_argument("--load-format", default="auto", metavar="auto|safetensors|gguf|dummy",
                   help="how to read the weights: as the path says, or dummy: random weights in the shape of a "
                   "Hugging Face folder's config.json (to measure speed without the weights)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate: text (completions, chat); pooling: embeddings (/v1/embeddings, LLM.embed); auto: "
                   "pooling for a checkpoint without an LM head (architectures *Model), generate otherwise")
    p.add_argument("--convert", default="auto", choices=["auto", "embed", "classify"],
                   help="with --runner pooling: what a generative model becomes: an embedding model (embed), or a "
                   "classifier/reranker over its LM head's rows for --hf-overrides' classifier_from_token (classify)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="the method of a pre-quantized checkpoint: gptq, awq, compressed-tensors, fp8 (gguf for a GGUF "
                   "file), checked against its config.json; without it, whatever the checkpoint is")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="keys of the model folder's config.json replaced, e.g. the reranker recipe '{\"architectures\": "
                   "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                   "\"is_original_qwen3_reranker\": true}'")
    p.add_argument("--task", default=None, choices=["auto", "generate", "embed", "embedding", "classify", "score"],
                   help="vLLM's older spelling: embed/embedding/classify/score is --runner pooling, generate is "
                   "--runner generate")
    p.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", default=None, metavar="JSON",
                   help='how embeddings are pooled: \'{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true}\' '
                   "(default: the model's sentence-transformers settings, else LAST, normalized)")
    p.add_argument("--tokenizer-mode", default="auto", metavar="auto|hf|slow",
                   help="accepted for vLLM's command lines: each reads tokenizer.json with `tokenizers`")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="only 1: llmserve splits a model with --tensor-parallel-size")
    p.add_argument("--kv-offload-memory", default=None, help="host-memory tier for evicted prefix blocks, e.g. 4GiB")
    p.add_argument("--kv-offload-dir", default=None, help="disk tier folder for evicted prefix blocks")
    p.add_argument("--kv-offload-disk", default="10GiB", help="disk tier budget")
    p.add_argument("--speculative-method", default=None, choices=["ngram", "suffix", "draft"],
                   help="speculative decoding: prompt lookup, suffix frequency tables, or a draft model (off by default)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="most drafts per sequence per step (1-16)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s spelling: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                   '\'{"model": PATH}\' (keys: method, num_speculative_tokens, model, prompt_lookup_min/max)')
    p.add_argument("--draft-model", default=None, help="with --speculative-method draft: GGUF file or HF folder with the same tokenizer")
    p.add_argument("--spec-max-tokens-per-step", type=int, default=32,
                   help="drafts only fill a step up to this many tokens, so busy steps get none")
    p.add_argument("--decode-quantization", default="auto", choices=["auto", "none", "int4", "int8", "w4a8"],
                   help="low-bit weights on CPU (auto: int4 for a Q4_1 GGUF, its own codes, none otherwise; w4a8: "
                        "int4 weights against int8 activations, opt-in, float32 on AVX2 or bf16 with AVX512-VNNI)")
    p.add_argument("--decode-quantization-max-rows", type=int, default=None,
                   help="steps of at most this many tokens use the low-bit weights, larger ones the float weights "
                        "(default: every step with llmserve's kernel (bf16 on CPUs with AMX or AVX512-BF16, float32 "
                        "with AVX2), 4 with torch's)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile small decode steps and lone prompts (faster; needs a C++ compiler, and ~2-3 min at the first start-up, ~15 s once cached)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention: native C++ kernels over the paged cache (CPU, built on first use; prompts too in bf16 on "
                        "AVX512-BF16 CPUs without AMX), torch SDPA, or one Triton kernel over the paged cache (CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every step's kernels eagerly instead of replaying decode steps' CUDA graphs")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="CUDA: decode steps of up to N sequences replay captured graphs (default: --max-num-seqs, "
                        "at most 512)")
    p.add_argument("--async-output-proc", action=argparse.BooleanOptionalAction, default=None,
                   help="make each step's outputs while the next step computes (default: on for CUDA, off on CPU)")
    p.add_argument("--disable-async-output-proc", dest="async_output_proc", action="store_false", default=None,
                   help="vLLM's name for --no-async-output-proc")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule and launch each step before the previous step's tokens reach the host (the engine's "
                        "own work overlaps the device's; not with speculative decoding or tensor parallelism)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model (implied by "
                   "--lora-modules, --lora and --allow-runtime-lora-updating)")
    p.add_argument("--max-loras", type=int, default=1, help="most distinct adapters in one step (each has a slot)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="highest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory, least recently used out first (default: --max-loras)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant mode: a request's tokens and logprobs do not depend on what else is batched "
                        "with it, on chunking, prefix-cache hits, preemption or speculation (CPU, float32; default: "
                        "on for CPUs that serve float32, unless --compile, LoRA or another attention backend is asked for)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many processes (gloo on CPU, NCCL on CUDA); under torchrun, its ranks")
    d = (parser or p).add_argument_group("disaggregated prefill and decode (docs/disaggregated.md)")
    d.add_argument("--role", dest="kv_role", default=None, choices=["prefill", "decode"],
                   help="this instance's role; the decode instance takes requests and orders prefills from its peer")
    d.add_argument("--kv-link", default=None, metavar="HOST:PORT",
                   help="the KV link's rendezvous: the prefill instance listens there, the decode instance connects")
    d.add_argument("--prefill-url", default=None, metavar="URL", help="(decode) the prefill instance's server")
    d.add_argument("--max-local-prefill-length", type=int, default=None, metavar="TOKENS",
                   help="(decode) prompts with fewer uncached tokens are prefilled here, not sent (default: from "
                        "llmserve plan's arithmetic for the measured link)")
    p.add_argument("-v", "--verbose", action="store_true")


def speculative_args(args) -> dict:
    """--speculative-method, --num-speculative-tokens and --draft-model, or vLLM's --speculative-config JSON."""
    from llmserve.config import speculative_settings

    if args.speculative_config is None:
        return dict(speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                    draft_model=args.draft_model)
    if args.speculative_method or args.draft_model:
        raise InvalidRequestError("give --speculative-config or --speculative-method/--draft-model, not both",
                                  "speculative_config")
    spec = json_object_arg(args, "speculative_config")
    return dict({"num_speculative_tokens": args.num_speculative_tokens}, **speculative_settings(spec))


def json_object_arg(args, name: str) -> dict | None:
    """A flag whose value is a JSON object (--speculative-config, --override-generation-config), read."""
    text = getattr(args, name)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"--{name.replace('_', '-')} is not JSON: {e}", name) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"--{name.replace('_', '-')} must be a JSON object, got {text!r}", name)
    return value


def runner_arg(args) -> str:
    """--runner, or vLLM's older --task (embed/embedding: pooling) when --runner is left at auto."""
    task = getattr(args, "task", None)
    if task in (None, "auto"):
        return args.runner
    runner = "generate" if task == "generate" else "pooling"
    if args.runner not in ("auto", runner):
        raise InvalidRequestError(f"--task {task} and --runner {args.runner} disagree; give --runner alone", "runner")
    return runner


def engine_config_from_args(args):
    from llmserve.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
        kv_cache_fraction=args.kv_cache_fraction, gpu_memory_utilization=args.gpu_memory_utilization,
        chat_template=args.chat_template, generation_config=args.generation_config,
        override_generation_config=json_object_arg(args, "override_generation_config"),
        tokenizer=args.tokenizer, max_logprobs=args.max_logprobs, trust_remote_code=args.trust_remote_code,
        pipeline_parallel_size=args.pipeline_parallel_size, load_format=args.load_format,
        tokenizer_mode=args.tokenizer_mode, runner=runner_arg(args), convert=args.convert,
        pooler_config=json_object_arg(args, "pooler_config"), hf_overrides=json_object_arg(args, "hf_overrides"),
        quantization=args.quantization,
        log_stats=not getattr(args, "disable_log_stats", True),  # serve's flag; generate and bench log none
        seed=getattr(args, "engine_seed", 0),
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching, kv_offload_memory=args.kv_offload_memory,
        kv_offload_dir=args.kv_offload_dir, kv_offload_disk=args.kv_offload_disk,
        **speculative_args(args), spec_max_tokens_per_step=args.spec_max_tokens_per_step,
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        decode_quantization=args.decode_quantization, decode_quantization_max_rows=args.decode_quantization_max_rows,
        compile=args.compile, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size, async_output_proc=args.async_output_proc,
        async_scheduling=args.async_scheduling,
        enable_lora=args.enable_lora or bool(getattr(args, "lora_modules", None) or getattr(args, "lora", None)
                                             or getattr(args, "allow_runtime_lora_updating", False)),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        deterministic=args.deterministic, tensor_parallel_size=args.tensor_parallel_size,
        kv_role=args.kv_role, kv_link=args.kv_link, prefill_url=args.prefill_url,
        max_local_prefill_length=args.max_local_prefill_length,
    )
