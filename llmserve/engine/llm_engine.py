"""The engine: request → scheduler → step input → executor (model → logits → sampler) → detokenizer → outputs.

`step()` runs one iteration of continuous batching and returns the outputs that changed. It is
single-threaded by design; the server drives it from its own thread.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from llmserve.config import EngineConfig, ModelConfig, PoolerConfig
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.engine.stats import EngineStats
from llmserve.engine.step_io import (PLACEHOLDER_TOKEN, ForwardPass, NewRequestData, SampledRow, ScheduledRow,
                                     StepInput)
from llmserve.errors import InvalidRequestError
from llmserve.executor import make_executor
from llmserve.executor.multiproc import check_tensor_parallel
from llmserve.gc_policy import collect_less_often
from llmserve.loader import ModelFiles, load_engine_model_files
from llmserve.loader.hf import generation_defaults
from llmserve.lora.request import LoRARequest
from llmserve.layers.pooler import Pooler
from llmserve.outputs import (CompletionOutput, ListPrefix, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                              RequestOutput)
from llmserve.platforms import get_platform
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.structured import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One iteration, split into its two phases."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    seconds: float
    forward_passes: list[ForwardPass] = field(default_factory=list)  # how the executor ran it (compiled parts, eager)


def resolve_runner(config: EngineConfig, model_config: ModelConfig, model_name: str) -> EngineConfig:
    """--runner auto settled by the checkpoint (no LM head: an embedding model), and for pooling the pooler (the
    flag's, else the model's sentence-transformers settings, else LAST and normalized). MEAN and CLS pool tokens that a
    prefix-cache hit would skip computing, so prefix caching is off for them (vLLM keeps it for LAST only)."""
    runner = config.runner
    if runner == "auto":
        runner = "generate" if model_config.has_lm_head else "pooling"
    if runner == "generate":
        if not model_config.has_lm_head:
            what = "a classifier" if model_config.num_labels else "a bare decoder: an embedding model"
            raise InvalidRequestError(f"{model_name} has no LM head ({what}); serve it with --runner pooling", "runner")
        return config if config.runner == runner else dataclasses.replace(config, runner=runner)
    pooler = config.pooler_config or PoolerConfig.parse(model_config.pooler_defaults or {})
    if model_config.num_labels and pooler.pooling_type == "MEAN":
        raise InvalidRequestError(f"{model_name} is a classifier: its head reads one token's state, so it pools LAST "
                                  "or CLS, not MEAN", "pooler_config")
    caching = config.enable_prefix_caching and pooler.pooling_type == "LAST"
    if config.enable_prefix_caching and not caching:
        logger.info("prefix caching is off: %s pooling reads every prompt token's hidden state, which a cache hit "
                    "would not compute", pooler.pooling_type)
    return dataclasses.replace(config, runner="pooling", pooler_config=pooler, enable_prefix_caching=caching)


class _Parent:
    """A user request: `n` sampled sequences (child Requests) that share one prompt."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children = children
        # Samples 1..n-1 wait until sample 0 has computed the prompt, then share its KV blocks.
        self.pending = children[1:]
        self.output_kind = children[0].params.output_kind

    def all_finished(self) -> bool:
        for c in self.children:  # a plain loop: read for every request of every step
            if not c.status.finished:
                return False
        return True

    def wants_output(self) -> bool:
        """Whether a change to this request makes an output now: FINAL_ONLY waits until every sample has finished."""
        return self.output_kind is not RequestOutputKind.FINAL_ONLY or self.all_finished()

    def metrics(self) -> RequestMetrics:
        first = self.children[0]
        if len(self.children) == 1:  # the usual case, without the loops over samples
            return RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                  first.last_token_time, first.finished_time, first.num_preemptions,
                                  first.prefill_compute_seconds, first.decode_compute_seconds)
        c = self.children
        return RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                              max((r.last_token_time or 0) for r in c) or None, first.finished_time,
                              sum(r.num_preemptions for r in c), sum(r.prefill_compute_seconds for r in c),
                              sum(r.decode_compute_seconds for r in c))


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, skip_tokenizer: bool = False, files: ModelFiles | None = None):
        config = config or EngineConfig()
        platform = get_platform(config.device)
        self.config = config = platform.with_defaults(config)  # scheduling defaults by device
        collect_less_often()  # a step allocates thousands of containers (gc_policy.py)
        if config.trust_remote_code:
            logger.info("--trust-remote-code changes nothing here: llmserve runs no code from model folders (the "
                        "architectures it serves are its own code)")
        skip_tokenizer = skip_tokenizer or config.skip_tokenizer_init
        files = files or load_engine_model_files(config, load_tokenizer=not skip_tokenizer)
        self.model_name = files.name
        self.model_path = files.path
        self.model_config = files.config
        # the runner (text or embeddings) and the pooler are settled now, from the model's config, for the workers too
        self.config = config = resolve_runner(config, files.config, files.name)
        # what the engine does: generate text, embed (pool to a vector) or classify (a classifier's head over it)
        self.task = "generate" if config.runner == "generate" else "classify" if files.config.num_labels else "embed"
        self.pooler = Pooler(config.pooler_config, files.config.num_labels, files.config.problem_type) \
            if config.runner == "pooling" else None
        self.tokenizer = None if skip_tokenizer else files.tokenizer
        if config.chat_template is not None and self.tokenizer is not None:
            self.tokenizer = self.tokenizer.with_chat_template(config.chat_template)
        # what a request leaves unset takes these first (the model's generation_config.json, as vLLM)
        self.sampling_defaults = generation_defaults(config, files.config)
        try:
            SamplingParams(**self.sampling_defaults)
        except InvalidRequestError as e:  # refused at start, not as a 400 on every request
            if config.override_generation_config:
                raise InvalidRequestError(f"the sampling defaults (generation_config.json with "
                                          f"--override-generation-config): {e.message}", "override_generation_config") from None
            raise InvalidRequestError(f"the model's generation_config.json: {e.message}; fix it, or pass "
                                      "--generation-config vllm", "generation_config") from None
        if self.sampling_defaults:
            sources = {"auto": ["the model's generation_config.json (--generation-config vllm ignores it)"],
                       "vllm": []}.get(config.generation_config, [f"{config.generation_config}/generation_config.json"])
            sources += ["--override-generation-config"] if config.override_generation_config else []
            logger.info("sampling defaults for what a request leaves unset, from %s: %s", " and ".join(sources),
                        self.sampling_defaults)
        self.max_model_len = min(config.max_model_len or files.config.max_position_embeddings, files.config.max_position_embeddings)
        self.max_logprobs = files.config.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(files.config, config.tensor_parallel_size)
        self.executor = make_executor(config, files.config, files.weights)
        info = self.executor.info
        self.kv = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching,
                                 self._make_offload(config), block_io=self.executor)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.kv_connector = None
        if config.kv_role is not None:
            from llmserve.kv_transfer.connector import DisaggConnector
            from llmserve.kv_transfer.link import KVLayout

            layout = KVLayout(files.config.num_hidden_layers, config.block_size, files.config.num_key_value_heads,
                              files.config.head_dim, info.kv_dtype)
            self.kv_connector = self.scheduler.connector = DisaggConnector(config, self, layout,
                                                                           self.executor.runner.device)
        self.speculator = None
        if config.speculative_method is not None:
            from llmserve.spec.speculator import Speculator

            self.speculator = Speculator(config, self)
        self.eos_token_ids = files.config.eos_token_ids
        self.structured = StructuredOutputManager(self.tokenizer, files.config.vocab_size, self.eos_token_ids)
        self._parents: dict[str, _Parent] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._lora_users: Counter[int] = Counter()  # lora_int_id → live user requests running with it
        self._lora_unloading: set[int] = set()  # removed while in use: dropped when the last of them finishes
        # What the executor holds state for, and what to tell it in the next step input.
        self._sent_to_executor: set[str] = set()
        self._finished_ids: list[str] = []
        self._block_copies: list[tuple[int, int]] = []
        self.step_stats: deque[StepStats] = deque(maxlen=1024)
        # since start, for the periodic stats line: prompt tokens computed (cached ones are not) and rows sampled
        self.num_prompt_tokens_computed = 0
        self._num_sampled_rows = 0
        # Async output processing (on by default on CUDA): a step's outputs are made while the next step computes.
        self.async_output_proc = platform.resolve_async_output_proc(config)
        self._pending: tuple[list[Request], dict[str, SampledRow]] | None = None  # the step whose outputs wait
        # Async scheduling (config.async_scheduling): the step launched last, whose tokens are not processed yet
        self.async_scheduling = config.async_scheduling
        self._inflight: tuple[SchedulerOutput, object, float] | None = None
        self._last_tokens_time = 0.0
        w = info.weights
        logger.info(
            "model %s loaded in %.1fs on %s (%s%s; low-bit weights: %s, %.1f MiB, %s kernel, %s; %s attention); "
            "KV cache: %d blocks x %d tokens = %.1f MiB in %s, max_model_len %d; steps of up to %d sequences and "
            "%d tokens%s%s",
            self.model_name, info.load_seconds, info.device, info.dtype,
            ", deterministic (batch-invariant)" if info.deterministic else "", w.decode_quantization,
            w.lowbit_bytes / 2**20, w.lowbit_kernel or "no",
            "every step" if w.lowbit_max_rows is None else f"steps of up to {w.lowbit_max_rows} rows",
            info.attention_backend, self.kv.num_blocks, config.block_size, info.kv_cache_bytes / 2**20,
            info.kv_dtype, self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
            f"; CUDA graphs for decode steps of up to {info.cuda_graph_sizes[-1]} sequences "
            f"({len(info.cuda_graph_sizes)} sizes, captured in {info.cuda_graph_seconds:.1f}s)"
            if info.cuda_graph_sizes else "",
            "; async scheduling" if self.async_scheduling else "",
        )
        if self.task == "embed":
            logger.info("an embedding model (--runner pooling): %s pooling of the last layer's hidden states%s",
                        config.pooler_config.pooling_type, ", normalized" if config.pooler_config.normalize else "")
        elif self.task == "classify":
            logger.info("a classifier (--runner pooling): %d classes, scored from the %s token's state",
                        files.config.num_labels, "last" if config.pooler_config.pooling_type == "LAST" else "first")

    @property
    def runner(self) -> str:
        """"generate" or "pooling" (vLLM's --runner, as settled for this model)."""
        return self.config.runner

    def _make_offload(self, config: EngineConfig):
        from llmserve.config import parse_bytes
        from llmserve.engine.kv_offload import DiskTier, HostTier, KVOffload

        host_bytes = parse_bytes(config.kv_offload_memory, "kv_offload_memory") if config.kv_offload_memory else 0
        if not host_bytes and not config.kv_offload_dir:
            return None
        host = HostTier(host_bytes, pin=self.executor.info.pin_host_memory) if host_bytes else None
        disk = None
        if config.kv_offload_dir:
            # the layout key names the dtype as torch prints it, so that blocks spilled by earlier versions still match
            layout = f"{self.model_name}:torch.{self.executor.info.kv_dtype}:{config.block_size}:{self.model_config.num_hidden_layers}x{self.model_config.num_key_value_heads}x{self.model_config.head_dim}"
            disk = DiskTier(os.path.expanduser(config.kv_offload_dir), parse_bytes(config.kv_offload_disk or 0, "kv_offload_disk"), layout)
        return KVOffload(host, disk)

    def shutdown(self) -> None:
        """Stops the executor's worker processes (tensor parallelism) and the KV link; the engine runs no more
        steps."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.shutdown()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.no_tokenizer_reason()}: pass token ids", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        return None, ids

    def no_tokenizer_reason(self) -> str:
        """Why this engine has no tokenizer, for error messages."""
        if self.config.skip_tokenizer_init:
            return "the engine was started with skip_tokenizer_init"
        return ("the model has no tokenizer (no tokenizer.json in its folder; give one with --tokenizer, "
                "LLM(tokenizer=))")

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, kv_transfer_params: dict | None = None) -> str:
        """kv_transfer_params: on a prefill instance, a decode instance's order ({"do_remote_decode": true,
        "transfer_id": N, "skip_tokens": S}): compute the prompt and send its KV from position S on."""
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params, priority, arrival_time, cache_salt,
                                             lora_request)
        if self.pooler is not None:
            raise InvalidRequestError("this engine computes embeddings (--runner pooling) and generates no text: pass "
                                      "PoolingParams (LLM.embed, /v1/embeddings), or start it with --runner generate",
                                      "runner")
        params = params or SamplingParams()
        if kv_transfer_params is not None:
            self._check_transfer_order(kv_transfer_params, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt(ids, params)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # a bad grammar fails here, before any state
        if lora_request is not None:
            self.add_lora(lora_request)  # read from disk now, so that no step waits on it; a bad adapter fails here
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:  # distinct but reproducible samples
                child_params = SamplingParams(**{**params.__dict__, "seed": (params.seed + i) % 2**64, "n": 1})
            child = Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, child_params, self.eos_token_ids,
                            priority=priority, arrival_time=arrival_time, prompt=text, cache_salt=cache_salt,
                            lora_request=lora_request)
            child.parent_id, child.index = request_id, i
            if params.structured_outputs is not None:  # each sample walks the grammar on its own
                child.grammar = self.structured.matcher(params.structured_outputs)
            if i > 0:
                child.prompt_logprobs = None  # scored once, by sample 0
            children.append(child)
        self._parents[request_id] = _Parent(request_id, text, ids, children)
        children[0].kv_transfer_params = kv_transfer_params
        if self.kv_connector is not None and self.kv_connector.role == "decode":
            self.kv_connector.on_new_request(children[0])  # here or on the prefill instance
        self._lora_request_started(lora_request)
        for child in children:
            if self.tokenizer is not None:
                self._detok[child.request_id] = IncrementalDetokenizer(self.tokenizer, child)
        self.scheduler.add_request(children[0])
        return request_id

    def _add_pooling_request(self, request_id: str | None, prompt: str | list[int], params: PoolingParams,
                             priority: int, arrival_time: float | None, cache_salt: str | None,
                             lora_request: LoRARequest | None) -> str:
        """An embedding request: its prompt is computed (in chunks, batched with others) and pooled; nothing is
        sampled, and it finishes with its last prompt token."""
        if self.pooler is None:
            raise InvalidRequestError("embeddings need an embedding engine: start it with --runner pooling "
                                      "(LLM(..., runner=\"pooling\"))", "runner")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt(ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)  # read from disk now (a bad adapter fails here)
        req = Request(request_id, ids, SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY), [],
                      priority=priority, arrival_time=arrival_time, prompt=text, cache_salt=cache_salt,
                      lora_request=lora_request)
        req.pooling_params = params
        self._parents[request_id] = _Parent(request_id, text, ids, [req])
        self._lora_request_started(lora_request)
        self.scheduler.add_request(req)
        return request_id

    def _pooled_outputs(self, sched: SchedulerOutput, output) -> list[PoolingRequestOutput]:
        """--runner pooling: each scheduled request keeps the rows the step pooled for it; a request whose prompt
        this step completed is reduced to its embedding, finished, and answered."""
        outs = []
        for s in sched.scheduled:
            req = s.request
            part = output.pooled.get(req.request_id)
            if part is not None:
                req.pooled_parts.append(part)
            if not s.samples or req.is_finished:
                continue
            embedding = self.pooler.finish(req.pooled_parts, req.pooling_params)
            req.pooled_parts = []
            req.first_token_time = req.last_token_time = time.monotonic()  # its one result: the prompt's end
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            self._release(req.request_id)
            parent = self._parents.pop(req.parent_id)
            self._lora_request_done(parent)
            outs.append(PoolingRequestOutput(req.parent_id, PoolingOutput(embedding), req.prompt_token_ids, True,
                                             parent.prompt, parent.metrics(), req.num_cached_tokens or 0))
        return outs

    def _check_transfer_order(self, order: dict, params: SamplingParams) -> None:
        if self.kv_connector is None or self.kv_connector.role != "prefill":
            raise InvalidRequestError("kv_transfer_params: this server is not a prefill instance (--role prefill)",
                                      "kv_transfer_params")
        if not isinstance(order, dict) or order.get("do_remote_decode") is not True:
            raise InvalidRequestError("kv_transfer_params must be {\"do_remote_decode\": true, \"transfer_id\": N, "
                                      "\"skip_tokens\": S}", "kv_transfer_params")
        for key in ("transfer_id", "skip_tokens"):
            value = order.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"kv_transfer_params.{key} must be a non-negative integer", "kv_transfer_params")
        if order["skip_tokens"] % self.config.block_size:
            raise InvalidRequestError(f"kv_transfer_params.skip_tokens must be a multiple of the block size "
                                      f"({self.config.block_size})", "kv_transfer_params")
        if params.n != 1:
            raise InvalidRequestError("kv_transfer_params needs n = 1", "kv_transfer_params")

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLM.reset_prefix_cache: later prompts find no prefix cached before now (to measure cold prefill,
        or after changing what a prefix means). Blocks that running requests hold keep their prefixes until
        freed; the answer is False while any do."""
        return self.kv.reset_prefix_cache()

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> int:
        """Reads and checks an adapter into the workers' host memory (nothing kept if it is bad); returns its bytes."""
        if not self.config.enable_lora:
            raise InvalidRequestError("LoRA adapters are not enabled on this engine; start it with enable_lora=True "
                                      "(--enable-lora, or --lora-modules)", "lora_request")
        self._lora_unloading.discard(lora_request.lora_int_id)
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drops an adapter from the workers once no live request uses it: running requests finish with it first."""
        if self._lora_users[lora_int_id]:
            self._lora_unloading.add(lora_int_id)
        else:
            self.executor.remove_lora(lora_int_id)

    def lora_users(self, lora_int_id: int) -> int:
        """How many live user requests run with this adapter."""
        return self._lora_users[lora_int_id]

    def _lora_request_started(self, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            self._lora_users[lora_request.lora_int_id] += 1
            if self._lora_users[lora_request.lora_int_id] == 1:  # in host memory until its last request is done
                self.executor.pin_lora(lora_request.lora_int_id, True)

    def _lora_request_done(self, parent: _Parent) -> None:
        lora = parent.children[0].lora_request
        if lora is None:
            return
        self._lora_users[lora.lora_int_id] -= 1
        if not self._lora_users[lora.lora_int_id]:
            del self._lora_users[lora.lora_int_id]
            if lora.lora_int_id in self._lora_unloading:
                self._lora_unloading.discard(lora.lora_int_id)
                self.executor.remove_lora(lora.lora_int_id)
            else:
                self.executor.pin_lora(lora.lora_int_id, False)

    def _fork_pending(self, first: Request) -> None:
        """Sample 0 has just computed the whole prompt: start the other samples on its KV blocks.
        They share every full block and recompute only the last prompt token, to sample on their own."""
        parent = self._parents[first.parent_id]
        shared = first.num_prompt_tokens - 1
        for child in parent.pending:
            if child.is_finished:
                continue
            copy = self.kv.fork(first, child, shared)
            if copy is not False:
                if copy is not None:  # copied by the executor before the next forward
                    self._block_copies.append(copy)
                child.num_computed_tokens = shared
            self.scheduler.add_request(child)
        parent.pending = []

    def validate_prompt(self, ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """A prompt to generate from (it needs room for at least one token after it), or a pooling request's input
        (which may fill the context), checked against the model and the KV pool, with its parameters."""
        pooling = isinstance(params, PoolingParams)
        where = "input" if pooling else "prompt"
        if not ids:
            raise InvalidRequestError(f"the {where} is empty", where)
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"{where} has token ids outside the vocabulary [0, {vocab})", where)
        if pooling and len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of the input.",
                "input")
        if not pooling and len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(ids)} tokens, which leaves no room for output. Please reduce the length of the prompt.",
                "prompt",
            )
        if not pooling and self.tokenizer is None:  # what reads or writes text needs the tokenizer
            for name, needs in (("stop", params.stop), ("structured_outputs", params.structured_outputs)):
                if needs:
                    raise InvalidRequestError(f"{name} needs the tokenizer, and {self.no_tokenizer_reason()}"
                                              + (" (stop_token_ids need none)" if name == "stop" else ""), name)
        if pooling:
            params.validate_for_model(self.model_config.hidden_size, self.model_config.matryoshka_dimensions,
                                      self.model_name, self.task)
        else:
            params.validate_for_model(vocab, self.max_logprobs)
        if self.kv.blocks_needed(len(ids) + (not pooling)) > self.kv.num_blocks:
            raise InvalidRequestError(
                f"the {where} ({len(ids)} tokens) needs more KV blocks than the whole cache holds "
                f"({self.kv.num_blocks} x {self.kv.block_size} tokens); raise --kv-cache-memory",
                where,
            )

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> RequestOutput | None:
        """Stop a request now (client gone, timeout); its blocks are freed at once. Returns its final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, status)
        if self._pending is not None and any(r.parent_id == request_id for r in self._pending[0]):
            # its last step's tokens are not detokenized yet: the final output includes them
            return self._process_pending(only={request_id})[-1]
        return self._output(parent, {})

    def has_unfinished_requests(self) -> bool:
        """Requests to run, outputs not yet given (async output processing), or (prefill instance) blocks held
        until their KV is sent."""
        return (self.scheduler.has_unfinished() or self._pending is not None or self._inflight is not None
                or (self.kv_connector is not None and self.kv_connector.has_pending()))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_generation_tokens(self) -> int:
        """Tokens generated since start: one per sampled row, plus the drafts verification accepted (counted by the
        speculator), so that nothing per step walks the batch for it."""
        accepted = self.speculator.stats.num_accepted_tokens if self.speculator is not None else 0
        return self._num_sampled_rows + accepted

    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges /metrics reports (copies: later steps do not change it)."""
        kv, sched, loras = self.kv, self.scheduler, self.config.enable_lora
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks, kv_usage=kv.usage, num_preemptions=sched.num_preemptions,
            prefix_cache=dataclasses.replace(kv.stats, hits=dict(kv.stats.hits)),
            offload_bytes={t.name: t.stats.bytes for t in kv.offload.tiers} if kv.offload is not None else {},
            max_loras=self.config.max_loras,
            running_loras=sorted({r.lora_request.lora_name for r in sched.running if r.lora_request}) if loras else None,
            waiting_loras=sorted({r.lora_request.lora_name for r in sched.waiting if r.lora_request}) if loras else None,
            spec_decode=copy.deepcopy(self.speculator.stats) if self.speculator is not None else None,
            kv_transfer=copy.deepcopy(self.kv_connector.stats) if self.kv_connector is not None else None,
        )

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_async()
        t0 = time.perf_counter()
        if self.kv_connector is not None:
            for req in self.kv_connector.get_finished():  # sent to the decode instance: free its held blocks
                self.kv.free(req)
        sched = self.scheduler.schedule()
        wait = self.executor.execute_async(self._step_input(sched)) if sched.scheduled else None
        # With async output processing the previous step's tokens are detokenized and turned into outputs here,
        # while the device computes this step. A stop string found now ends its request one step late: this step
        # computes a token for it that is dropped (update_from_output skips finished requests).
        earlier = self._process_pending() if self._pending is not None else []
        ended = self._ended_outputs(sched)
        if wait is None:
            if self.kv_connector is not None:
                time.sleep(0.001)  # waiting on KV transfers only: do not spin the engine thread
            return earlier + ended
        output = wait()
        updated, result, seconds = self._update(sched, output, t0)
        if self.pooler is not None:
            outputs = self._pooled_outputs(sched, output)
        elif self.async_output_proc:
            self._pending, outputs = (updated, result), []
        else:
            outputs = self._process_outputs(updated, result)
        if self.speculator is not None:
            t1 = time.perf_counter()
            decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
            drafted = self.speculator.propose(decoding, self.max_model_len)
            self._trim_drafts_to_grammar(drafted)
            if drafted:  # the drafters pay for proposing (they are all still running)
                extra = time.perf_counter() - t1
                self._charge_compute([(r, 1, False) for r in drafted], extra)
                seconds += extra
        self._record_step(sched, seconds, output)
        return earlier + ended + outputs

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: this step is scheduled and launched while the previous one may still be on the device
        (its rows that decode read the previous step's tokens there); then the previous step's tokens are waited
        for and processed, while this one computes. A request that stops on a token processed now had a row in this
        step too: its token is dropped (update_from_output skips finished requests)."""
        t0 = time.perf_counter()
        outputs = []
        previous, self._inflight = self._inflight, None
        if previous is not None and any(s.samples and s.request.grammar is not None for s in previous[0].scheduled):
            # a grammar's next mask needs the token it accepts: this step waits for the previous one
            outputs += self._finish_inflight(previous)
            previous = None
        sched = self.scheduler.schedule()
        if sched.scheduled:
            wait = self.executor.execute_async(self._step_input(sched))
            self.scheduler.launched(sched)
            self._inflight = (sched, wait, t0)
        if previous is not None:
            outputs += self._finish_inflight(previous)
        return outputs + self._ended_outputs(sched)

    def _finish_inflight(self, inflight) -> list[RequestOutput]:
        sched, wait, t0 = inflight
        output = wait()
        # the device time between this step's launch and its tokens overlapped the next step's: charge each step
        # the time since the previous one's tokens arrived
        start, self._last_tokens_time = max(t0, self._last_tokens_time), time.perf_counter()
        updated, result, seconds = self._update(sched, output, start, launched=True)
        self._record_step(sched, seconds, output)
        return self._process_outputs(updated, result)

    def _ended_outputs(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The outputs of the requests the scheduler ended (the KV pool cannot hold them)."""
        return [self._output(self._parents[r.parent_id], {}) for r in sched.finished
                if r.parent_id in self._parents and self._parents[r.parent_id].wants_output()]

    def _update(self, sched: SchedulerOutput, output, t0: float, launched: bool = False):
        """A step's output into its requests: prompt logprobs, n > 1 samples started, speculation recorded, tokens
        appended, stops checked, the step's time charged. Returns (requests with new tokens, sampled rows, the
        step's seconds)."""
        if output.prompt_logprobs:
            scored = {s.request.request_id: s.request for s in sched.scheduled}
            for rid, entries in output.prompt_logprobs.items():
                scored[rid].prompt_logprobs.extend(entries)
        result = output.sampled
        for s in sched.scheduled:
            r = s.request
            if not s.samples or r.is_finished:
                continue
            if r.index == 0 and not r.output_token_ids and self._parents[r.parent_id].pending:
                self._fork_pending(r)
            if self.speculator is not None and r.spec_token_ids:
                self.speculator.record(r, len(r.spec_token_ids), result[r.request_id].num_accepted)
        sampled = {rid: row.token_ids for rid, row in result.items()}
        updated = self.scheduler.update_from_output(sched, sampled, launched)
        seconds = time.perf_counter() - t0
        # before the outputs: a request finishing now pays for this step
        self._charge_compute([(s.request, s.num_new_tokens, s.is_prefill) for s in sched.scheduled], seconds)
        return updated, result, seconds

    def _record_step(self, sched: SchedulerOutput, seconds: float, output) -> None:
        self.num_prompt_tokens_computed += sched.num_prefill_tokens
        self._num_sampled_rows += len(output.sampled)
        self.step_stats.append(StepStats(
            sched.num_prefill_tokens, sched.num_decode_tokens,
            sched.num_prefill_seqs, len(sched.scheduled) - sched.num_prefill_seqs, seconds, output.forward_passes,
        ))

    def _process_pending(self, only: set[str] | None = None) -> list[RequestOutput]:
        """The outputs of the step whose processing was deferred (async output processing): all of them, or those
        of the parents in `only` (the rest stay pending)."""
        updated, result = self._pending
        if only is None:
            self._pending = None
            mine = updated
        else:
            mine = [r for r in updated if r.parent_id in only]
            rest = [r for r in updated if r.parent_id not in only]
            self._pending = (rest, result) if rest else None
        # a parent that ended meanwhile (aborted, or ended by the scheduler) has had its final output already
        return self._process_outputs([r for r in mine if r.parent_id in self._parents], result)

    def _step_input(self, sched: SchedulerOutput) -> StepInput:
        """The scheduler's decision as plain data: new requests once, then each scheduled request's tokens, positions
        and block-table row, and what it samples."""
        step = StepInput(rows=[], finished_request_ids=self._finished_ids, block_copies=self._block_copies,
                         kv_loads=self.kv_connector.build_connector_meta() if self.kv_connector else [])
        constrained = []  # (row, matcher, drafts) of the rows that sample under a grammar
        self._finished_ids, self._block_copies = [], []
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            if req.request_id not in self._sent_to_executor:
                self._sent_to_executor.add(req.request_id)
                step.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.params,
                                                        req.eos_token_ids, list(req.output_token_ids),
                                                        req.lora_request))
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n]
            if len(tokens) < n:  # the drafts being verified follow the last real token
                tokens = tokens + req.spec_token_ids[: n - len(tokens)]
                if len(tokens) < n:  # async scheduling: the token the step in flight samples
                    tokens.append(PLACEHOLDER_TOKEN)
            spec = req.spec_token_ids if s.samples else []
            scored = None
            if req.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1; positions scored before a preemption are skipped.
                first, last = max(start, len(req.prompt_logprobs) - 1), min(start + n, req.num_prompt_tokens - 1)
                scored = (first, last) if last > first else None
            step.rows.append(ScheduledRow(req.request_id, tokens, start, self.kv.block_tables[req.request_id],
                                          s.samples, req.num_output_tokens + req.num_placeholders, spec,
                                          req.spec_draft_probs if spec else None, scored))
            if s.samples and req.grammar is not None:
                constrained.append((step.rows[-1], req.grammar, spec))
        if constrained:
            masks = self.structured.fill_bitmasks([(m, drafts) for _, m, drafts in constrained])
            for (row, _, drafts), mask in zip(constrained, masks):
                row.grammar_bitmask = mask if drafts else mask[0]
        return step

    def _trim_drafts_to_grammar(self, drafted: list[Request]) -> None:
        """A draft the grammar cannot take would be rejected anyway; cut it (and what follows) before verifying."""
        for r in drafted:
            if r.grammar is not None and r.spec_token_ids:
                keep = r.grammar.valid_prefix(r.spec_token_ids)
                if keep < len(r.spec_token_ids):
                    r.spec_token_ids = r.spec_token_ids[:keep]
                    if r.spec_draft_probs is not None:
                        r.spec_draft_probs = r.spec_draft_probs[:keep] if keep else None

    def _release(self, request_id: str) -> None:
        """The executor may drop this request's state with the next step."""
        if request_id in self._sent_to_executor:
            self._sent_to_executor.discard(request_id)
            self._finished_ids.append(request_id)

    @staticmethod
    def _charge_compute(phases: list[tuple[Request, int, bool]], seconds: float) -> None:
        """Each request pays for a step in proportion to the tokens it ran in it: the basis of per-request cost."""
        total = sum(n for _, n, _ in phases)
        for request, n, is_prefill in phases:
            if is_prefill:
                request.prefill_compute_seconds += seconds * n / total
            else:
                request.decode_compute_seconds += seconds * n / total

    def _process_outputs(self, updated: list[Request], result: dict[str, SampledRow]) -> list[RequestOutput]:
        deltas: dict[str, dict[int, tuple[str, list[int]]]] = {}
        for req in updated:
            new = req.output_token_ids[len(req.output_token_ids) - req.num_new_output_tokens:]
            text = ""
            detok = self._detok.get(req.request_id)
            if detok is not None:
                for i, token in enumerate(new):  # one at a time: a stop string ends the run where it appears
                    last = i == len(new) - 1
                    textless = last and req.ended_by_stop_token and not req.params.include_stop_str_in_output
                    piece, stopped = detok.update(token, req.is_finished and last, textless)
                    text += piece
                    if stopped:
                        if not last:  # tokens after the stop string are not part of the output
                            drop = len(new) - 1 - i
                            del req.output_token_ids[-drop:], req.all_token_ids[-drop:]
                            new = new[: i + 1]
                        if not req.is_finished:
                            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                        elif not last:  # the token that ended it otherwise (max_tokens, EOS) was dropped
                            req.status = RequestStatus.FINISHED_STOPPED
                        req.stop_reason = detok.stop_reason
                        break
            if req.params.logprobs is not None:
                row = result[req.request_id]  # logprobs of the tokens kept
                for lp, slp in zip(row.logprobs[: len(new)], row.sampled_logprobs[: len(new)]):
                    if lp is not None:
                        req.logprobs.append(lp)
                        req.cumulative_logprob += slp
            if req.is_finished:
                self._release(req.request_id)
                if self.speculator is not None:
                    self.speculator.release(req)
            deltas.setdefault(req.parent_id, {})[req.index] = (text, new)
        parents = self._parents
        return [self._output(parents[pid], d) for pid, d in deltas.items() if parents[pid].wants_output()]

    def _output(self, parent: _Parent, deltas: dict[int, tuple[str, list[int]]]) -> RequestOutput:
        kind = parent.output_kind
        outs = []
        for child in parent.children:
            detok = self._detok.get(child.request_id)
            text = detok.text if detok else ""
            delta_text, delta_ids = deltas.get(child.index) or ("", [])  # a fresh list: it is the caller's
            wants_logprobs = child.params.logprobs is not None
            if kind is RequestOutputKind.CUMULATIVE:  # snapshots of the lists, which only grow at their end
                token_ids = ListPrefix(child.output_token_ids)
                logprobs = ListPrefix(child.logprobs) if wants_logprobs else None
            elif kind is RequestOutputKind.DELTA:
                text, token_ids = delta_text, delta_ids
                logprobs = child.logprobs[len(child.logprobs) - len(delta_ids):] if wants_logprobs else None
            else:  # FINAL_ONLY: the one output is the whole of it, and all of it is new
                token_ids, logprobs = child.output_token_ids, child.logprobs if wants_logprobs else None
                delta_text, delta_ids = text, token_ids
            outs.append(CompletionOutput(child.index, text, token_ids, child.status.value if child.is_finished else None,
                                         child.stop_reason, child.cumulative_logprob if wants_logprobs else None,
                                         logprobs, delta_text, delta_ids))
        finished = parent.all_finished()
        first = parent.children[0]
        if finished and self._parents.pop(parent.request_id, None) is not None:
            self._lora_request_done(parent)
            for c in parent.children:
                self._detok.pop(c.request_id, None)
                self._release(c.request_id)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids, outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0, kv_transfer=first.kv_transfer,
            prompt_logprobs=ListPrefix(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            metrics=parent.metrics(),
        )

