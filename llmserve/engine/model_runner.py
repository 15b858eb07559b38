"""Model runner: owns the model and the KV tensors, turns a scheduled batch into tensors, runs the
forward and the sampler. The seam to the scheduler is narrow: a SchedulerOutput goes in, sampled
token ids come out, so a multi-process runner can take its place later."""

from __future__ import annotations

import logging
import time
import types

import numpy as np
import torch

from llmserve.config import EngineConfig, ModelConfig, available_memory_bytes, parse_bytes
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.scheduler import SchedulerOutput
from llmserve.errors import InvalidRequestError
from llmserve.layers.attention import AttentionGroup, AttentionMetadata, PagedAttention
from llmserve.layers.linear import Linear
from llmserve.layers.quant import lowbit_supported, quantize_weight
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.models import build_model
from llmserve.platform_tuning import MMAP_THRESHOLD_BYTES, keep_freed_memory, release_freed_memory
from llmserve.sample.rejection import VerifiedRow, verify
from llmserve.sample.sampler import Sampler

logger = logging.getLogger(__name__)
DEFAULT_CPU_KV_CAP = 1 << 30
LONE_PROMPT_TRIAL_ROWS = 97  # the compiled lone-prompt graph's trial: unlike any model dimension, which torch would
                             # otherwise assume equal to it
# Where the low-bit row limit leaves room for prompts of 8 rows or more on the low-bit weights, a second lone-prompt
# graph is traced with this many rows (or the limit, if smaller), so that they run compiled too.
SHORT_PROMPT_TRIAL_ROWS = 37
# The largest steps that take the low-bit weights by default with torch's kernels, which work in blocks of 4 rows and
# lose to oneDNN's bf16 matmul from the second block on. llmserve's own (AMX or AVX512-BF16) serves every step.
TORCH_LOWBIT_MAX_ROWS = 4
LOWBIT_DTYPES = (torch.bfloat16, torch.float32)  # the activations' dtypes the low-bit kernels take


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, vocab_size: int | None = None):
        self.config = config
        self.model_config = model_config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype()
        self.kv_dtype = config.resolve_kv_cache_dtype()
        if self.device.type == "cpu":
            keep_freed_memory()
        if self.device.type == "cpu" and self.dtype == torch.float16:
            raise InvalidRequestError("float16 is slow and inexact on CPU; use bfloat16 or float32", "dtype")
        t0 = time.perf_counter()
        model = build_model(model_config)
        model.load_weights(weights())
        self.decode_quantization = self._attach_lowbit_weights(model)
        # Rotary tables stay float32 (a bf16 round trip would blur the angles at long positions).
        tables = {m: (m.cos, m.sin) for m in model.modules() if isinstance(m, RotaryEmbedding)}
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        for m, (cos, sin) in tables.items():
            m.cos, m.sin = cos.to(self.device), sin.to(self.device)
        if config.cpu_prepack:
            # The LM head too: with tied embeddings this keeps a second (packed) copy of that weight, for faster logits.
            self.num_prepacked = sum(m.prepack() for m in self.model.modules() if isinstance(m, Linear))
        if self.device.type == "cpu":
            release_freed_memory()
        self.load_seconds = time.perf_counter() - t0
        self.block_size = config.block_size
        self.query_groups = model_config.num_attention_heads // model_config.num_key_value_heads
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.native_decode_attention = self._native_attention_available()
        # The prompt kernel reads keys from the bf16 cache; under an FP8 cache, only fresh prompts' own keys (unrounded).
        self.native_prompt_kernel = self._native_prompt_kernel_available()
        self.native_prefill_attention = self.native_prompt_kernel and self.kv_dtype == torch.bfloat16
        # With SDPA, compiled decode steps above 4 rows measured no faster than eager (docs/benchmarks.md).
        self.compile_max_decode_batch = config.compile_max_decode_batch or (
            config.max_num_seqs if self.native_decode_attention else 4)
        self.sampler = Sampler(vocab_size or model_config.vocab_size, self.device, seed=config.seed)
        self._logits_buffer: torch.Tensor | None = None
        self.compiled_forward = None
        self.compile_seconds = 0.0
        if config.compile:
            self._compile()

    def _attach_lowbit_weights(self, model) -> str:
        """Low-bit copies of the projections, quantized from the float32 weights as loaded, and the rows they serve
        (self.lowbit_max_rows: 0 without them, None for every step). Returns the kind used."""
        self.lowbit_bytes, self.lowbit_max_rows, self.lowbit_kernel = 0, 0, None
        from llmserve import kernels

        kind = self.config.decode_quantization
        if kind == "auto":
            native_q4 = self.model_config.quantization == "Q4_1"
            kind = "int4" if native_q4 and self.device.type == "cpu" and self.dtype in LOWBIT_DTYPES else "none"
            if kind == "int4" and self.dtype == torch.float32 and kernels.lowbit_linear_route(self.dtype) == "avx2":
                kind = "w4a8"  # as llama.cpp multiplies Q4_1: int8 activations (docs/performance.md)
        if kind == "none" or self.config.decode_quantization_max_rows == 0:
            return "none"
        if self.device.type != "cpu" or self.dtype not in LOWBIT_DTYPES:
            raise InvalidRequestError(f"decode_quantization {kind} runs on CPU in bfloat16 or float32 only",
                                      "decode_quantization")
        isa = kernels.lowbit_linear_route(self.dtype)
        int8_route = kernels.lowbit_linear_int8_route(self.dtype)
        if kind == "w4a8" and int8_route is None:
            raise InvalidRequestError("decode_quantization w4a8 runs on CPU with llmserve's kernels only: in float32 "
                                      "on a CPU with AVX2, FMA and F16C, or in bfloat16 with AVX512-VNNI and "
                                      "AVX512-BF16 (and a C++ compiler)", "decode_quantization")
        self.lowbit_kernel = isa or "torch"
        max_rows = self.config.decode_quantization_max_rows
        # By default llmserve's kernel serves every step (it matches or beats oneDNN's bf16, or MKL's float32, matmul
        # at every size measured, docs/performance.md) and the float copy is dropped; torch's only the smallest steps.
        self.lowbit_max_rows = max_rows if max_rows is not None or isa else TORCH_LOWBIT_MAX_ROWS
        for name, m in model.named_modules():
            # The LM head gets int8 whatever the kind: it is often the embedding, which GGUF files tend to keep at
            # more bits than the layers (Q8_0 in the default model), where 4 bits would add error of its own. Its
            # activations stay in float with w4a8, as do those of layers that ask (Linear.int8_activations): with
            # 8-bit codes vpmaddubsw needs twice the integer multiplies, and Zen's one integer-multiply pipe then
            # loses to float FMAs from 16 rows on (docs/benchmarks.md).
            if not isinstance(m, Linear):
                continue
            head = name.endswith("lm_head")
            m_kind = "int8" if head else "int4" if kind == "w4a8" else kind
            route = int8_route if kind == "w4a8" and not head and m.int8_activations else isa
            if lowbit_supported(m_kind, m.weight.shape, isa is not None):
                m.attach_lowbit(quantize_weight(m_kind, m.weight, self.dtype, route), self.lowbit_max_rows)
                self.lowbit_bytes += m.lowbit.nbytes
        return kind

    def uses_lowbit(self, rows: int) -> bool:
        """Whether a step of this many token rows runs on the low-bit weights."""
        return self.lowbit_max_rows is None or rows <= self.lowbit_max_rows

    def _native_attention_available(self) -> bool:
        """Whether decode rows use the C++ paged-attention kernel (see EngineConfig.attention_backend)."""
        backend = self.config.attention_backend
        if backend == "sdpa" or (backend == "auto" and self.device.type != "cpu"):
            return False
        if self.device.type != "cpu":
            raise InvalidRequestError("attention_backend native runs on CPU only", "attention_backend")
        from llmserve import kernels

        cfg = self.model_config
        if cfg.num_attention_heads > kernels.MAX_QUERY_HEADS or cfg.head_dim > kernels.MAX_HEAD_DIM:
            if backend == "native":
                raise InvalidRequestError(f"the native attention kernel takes at most {kernels.MAX_QUERY_HEADS} query "
                                          f"heads and head_dim {kernels.MAX_HEAD_DIM}", "attention_backend")
            return False

        if kernels.load_cpu_kernels():
            return True
        if backend == "native":
            raise InvalidRequestError(f"the native attention kernel could not be built ({kernels.build_error()}); it needs a "
                                      "C++ compiler with OpenMP on PATH, or use attention_backend sdpa", "attention_backend")
        return False

    def _native_prompt_kernel_available(self) -> bool:
        """Whether prompt rows can use the C++ prompt-attention kernel: with the native decode kernel, bf16 queries,
        and AVX512-BF16. Not where the CPU has AMX: torch's flash attention multiplies with AMX tiles there (0.32 ms a
        layer for a 200-token prompt of the default model, eleventh round), and this kernel is unmeasured on it."""
        from llmserve import kernels

        return (self.native_decode_attention and self.dtype == torch.bfloat16
                and kernels.lowbit_linear_isa() != "amx"
                and kernels.prefill_attention_available(self.model_config.head_dim))

    def _compile(self) -> None:
        """torch.compile whole steps of two kinds, where eager PyTorch spends a large share of the time launching
        small elementwise ops (norms, rotary, residual adds, SwiGLU) that a compiled graph fuses:
        - decode-only steps of at most compile_max_decode_batch rows. Dynamic shapes give one graph for batch 1
          (torch always specializes it), one for 2 up to the low-bit row limit and one above it (the projections
          switch weights there).
        - a step that is one prompt from position 0 (whole, or its first chunk), the prefill a lone request meets
          (one graph).
        A mixed step runs as parts on these graphs (see _compiled_parts); what fits neither (later chunks, drafts,
        prompt logprobs) stays eager: each kind would be one more graph to compile.
        Every graph is compiled here, rather than under the first requests."""
        t0 = time.perf_counter()
        from llmserve import kernels

        if self.device.type == "cpu":  # their C++ packed_linear spares the graph a call into Python per projection
            kernels.load_cpu_kernels()
        # torch's on-disk graph cache keys on the graph, not on what a custom op does: a graph compiled against an
        # older build of llmserve's kernels would be reused, and call them wrongly. The kernels' digest parts the cache.
        tag = f"llmserve-kernels-{kernels.source_digest()}"
        if tag not in torch.compiler.config.cache_key_tag:
            torch.compiler.config.cache_key_tag += tag
        # Weights, KV tensors and module flags are fixed after load: guarding on them would cost time on every call.
        # The C++ wrapper launches the graph's ~450 kernels without Python in between: 16 % faster batch-1 decode in
        # the same process (docs/benchmarks.md). Built as one translation unit with the kernels, it took g++ ~100 s a
        # graph; built separately, the default model's graphs compile in 142 s instead of 385 s, and their steps take
        # the same time (docs/benchmarks.md, seventeenth round).
        # Dynamo keeps compiled graphs on the function's code object, and without the module guards a second model in
        # this process (a draft model, another LLM) would run this one's graphs on its own tensors: each runner gets
        # its own copy of forward's code, hence its own graphs.
        forward = self.model.forward.__func__
        own_forward = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                         forward.__defaults__, forward.__closure__)
        # Without inductor's runtime checks of each kernel's tensors: ~640 a decode step in the C++ wrapper, each
        # building its error message (a std::stringstream) before it checks. They check the custom ops' fake shapes,
        # which tests/test_compiled_steps.py compares with eager steps (docs/benchmarks.md, twentieth round).
        self.compiled_forward = torch.compile(types.MethodType(own_forward, self.model), options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True,
            "cpp_wrapper_build_separate": True, "size_asserts": False, "alignment_asserts": False,
            "scalar_asserts": False})
        dev = self.device
        # Trial steps, in inference mode as forward() runs (tensors made outside it would not match the guards),
        # write K/V to the first blocks, which are free at start-up. Only the batch and the lengths vary between
        # steps; every other size stays fixed in the graph.
        ctx = 2 * self.block_size + 1  # three key blocks: a one-block table would be specialized like a batch of 1
        # Batch 1, and 2 on (up to the low-bit row limit and above it, where the projections switch weights).
        batches = {1, 2} | ({self.lowbit_max_rows + 1} if self.lowbit_max_rows is not None else set())
        trials = [[(i, 1, ctx, np.zeros(3, dtype=np.int64)) for i in range(batch)]
                  for batch in sorted(b for b in batches if b <= self.compile_max_decode_batch)]
        for n in self.lone_prompt_trial_rows():
            trials.append([(0, n, n, np.arange(-(-n // self.block_size)))])
        try:
            with torch.inference_mode():
                for rows in trials:
                    batch, new = len(rows), rows[0][1]
                    positions = np.concatenate([np.arange(end - new, end) for _, _, end, _ in rows])
                    g = self._group(rows, positions)
                    meta = AttentionMetadata(slot_mapping=torch.arange(batch * new, device=dev), groups=[g])
                    args = (torch.zeros(batch * new, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev), meta,
                            torch.arange(batch, device=dev) * new + new - 1)
                    dynamic = [(g.kv_blocks, 1), (g.mask, 3)]  # key blocks and context length
                    if batch * new > 1:  # the step's tokens (size 1 is always its own graph)
                        dynamic += [(t, 0) for t in (*args[:2], meta.slot_mapping, g.src, g.dst)]
                        dynamic.append((g.token_index, 0 if new == 1 else 1))
                    if batch > 1:  # the sequences
                        dynamic += [(args[3], 0), (g.mask, 0), (g.kv_blocks, 0), (g.lengths, 0)]
                    for t, dim in dynamic:
                        if t is not None:  # a lone prompt has no mask
                            torch._dynamo.mark_dynamic(t, dim)
                    self.compiled_forward(*args)
        except Exception as e:  # inductor needs a working C++ toolchain; say so in one line
            raise InvalidRequestError(f"compile failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
                                      "it needs a C++ compiler (g++ or clang) on PATH, or leave it off", "compile") from e
        self.compile_seconds = time.perf_counter() - t0
        logger.info("compiled in %.1fs: decode steps of up to %d rows, lone prompts", self.compile_seconds,
                    self.compile_max_decode_batch)

    def _compiled_kind(self, decode: list, prefill: list, num_wanted: int) -> bool:
        """Whether this step is of a kind compiled at start-up (see _compile)."""
        if self.compiled_forward is None:
            return False
        if not prefill:  # decode rows; a step of only one-token prompts has no history to attend to and stays eager
            return (len(decode) <= self.compile_max_decode_batch and num_wanted == len(decode)
                    and any(end > 1 for _, _, end, _ in decode))
        if decode or len(prefill) != 1 or num_wanted != 1:
            return False
        _, new, end, _ = prefill[0]
        # from position 0, and on the weights the graph was traced with (a one-row prompt is a graph of its own)
        return new == end > 1 and any(self.uses_lowbit(new) == self.uses_lowbit(n) for n in self.lone_prompt_trial_rows())

    def lone_prompt_trial_rows(self) -> list[int]:
        """The prompt lengths the lone-prompt graphs are traced with: one on each side of the low-bit row limit, where
        that limit is 8 rows or more (below, such prompts run eager)."""
        limit = self.lowbit_max_rows
        return [LONE_PROMPT_TRIAL_ROWS] + ([min(limit, SHORT_PROMPT_TRIAL_ROWS)] if limit is not None and limit >= 8 else [])

    # ---- KV pool -------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.model_config.kv_bytes_per_token(self.kv_dtype) * self.block_size
        if self.config.kv_cache_memory is not None:
            budget = parse_bytes(self.config.kv_cache_memory)
        else:
            budget = int(available_memory_bytes(self.device) * self.config.kv_cache_fraction)
            if self.device.type == "cpu":  # a laptop shares this memory with everything else
                budget = min(budget, DEFAULT_CPU_KV_CAP)
        # Never more than enough for max_num_seqs full contexts: memory beyond that cannot be used.
        cap = self.config.max_num_seqs * -(-self.model_config.max_position_embeddings // self.block_size)
        num = min(budget // per_block, cap)
        if num < 1:
            raise InvalidRequestError(f"KV cache memory {budget} bytes holds no block of {per_block} bytes", "kv_cache_memory")
        return int(num)

    def _allocate_kv_cache(self) -> None:
        cfg = self.model_config
        slots = self.num_blocks * self.block_size
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                m.k_cache = torch.zeros(slots, cfg.num_key_value_heads, cfg.head_dim, dtype=self.kv_dtype, device=self.device)
                m.v_cache = torch.zeros_like(m.k_cache)
                m.block_size = self.block_size
        self.kv_cache_bytes = 2 * cfg.num_hidden_layers * slots * cfg.num_key_value_heads * cfg.head_dim * self.kv_dtype.itemsize

    def _attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.model.modules() if isinstance(m, PagedAttention)]

    def read_block(self, block: int) -> torch.Tensor:
        """One block's K and V from every layer, [layers, 2, block_size, kv_heads, head_dim]: what a spill tier stores."""
        bs = self.block_size
        return torch.stack([torch.stack((m.k_cache[block * bs:(block + 1) * bs], m.v_cache[block * bs:(block + 1) * bs]))
                            for m in self._attention_layers()])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        bs = self.block_size
        data = data.to(device=self.device, dtype=self.kv_dtype, non_blocking=True)
        for i, m in enumerate(self._attention_layers()):
            m.k_cache[block * bs:(block + 1) * bs] = data[i, 0]
            m.v_cache[block * bs:(block + 1) * bs] = data[i, 1]

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                m.k_cache[dst * bs:(dst + 1) * bs] = m.k_cache[src * bs:(src + 1) * bs]
                m.v_cache[dst * bs:(dst + 1) * bs] = m.v_cache[src * bs:(src + 1) * bs]

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> dict[str, VerifiedRow]:
        """One forward over the batch; returns, per request that samples this step, the tokens it emits:
        one for a plain row, the accepted drafts plus one for a row that speculated."""
        items: list[tuple[object, int, list[int]]] = []
        logits_rows, sampling = [], []
        spec_rows, spec_reqs = [], []  # per speculating request: its K+1 flat rows
        prompt_rows: list[int] = []  # flat token rows whose logits score the next prompt token
        prompt_owners: list[tuple[object, int]] = []  # (request, number of rows), in order
        offset = 0
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n]
            if len(tokens) < n:  # the drafts being verified follow the last real token
                tokens = tokens + req.spec_token_ids[: n - len(tokens)]
            items.append((req, n, tokens))
            if s.samples and req.spec_token_ids:
                k = len(req.spec_token_ids)
                spec_rows.append(list(range(offset + n - 1 - k, offset + n)))
                spec_reqs.append(req)
            elif s.samples:
                logits_rows.append(offset + n - 1)
                sampling.append(req)
            if req.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1; positions scored before a preemption are skipped.
                first = max(start, len(req.prompt_logprobs) - 1)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.extend(range(offset + first - start, offset + last - start))
                    prompt_owners.append((req, last - first))
            offset += n
        flat_spec = [r for rows in spec_rows for r in rows]
        logits = self.forward(items, kv, logits_rows + flat_spec + prompt_rows)
        n_plain, n_spec = len(logits_rows), len(flat_spec)
        if prompt_rows:
            self._score_prompt(logits[n_plain + n_spec:], prompt_owners)
        plain = self.sampler.sample(logits[:n_plain], sampling)
        results = {r.request_id: VerifiedRow([t], [lp], [slp], 0)
                   for r, t, lp, slp in zip(sampling, plain.token_ids, plain.logprobs, plain.sampled_logprobs)}
        if spec_reqs:
            blocks, at = [], n_plain
            for rows in spec_rows:
                blocks.append(logits[at:at + len(rows)])
                at += len(rows)
            verified = verify(self.sampler, blocks, spec_reqs, [r.spec_token_ids for r in spec_reqs],
                              [r.spec_draft_probs for r in spec_reqs])
            results.update({r.request_id: v for r, v in zip(spec_reqs, verified)})
        return results

    def forward(self, items: list[tuple[object, int, list[int]]], kv: KVCacheManager, wanted_rows: list[int]) -> torch.Tensor:
        """Computes `n` new tokens for each (sequence, n, token ids) from its num_computed_tokens on, writing their
        K/V through the sequence's block table; returns the logits of the flat rows in `wanted_rows`."""
        parts = self._compiled_parts(items, wanted_rows)
        if parts is None:
            return self._float_logits(self._forward(items, kv, wanted_rows))
        # Sequences never attend to each other, so each part computes what it would in one mixed step, up to rounding.
        starts = np.cumsum([0] + [n for _, n, _ in items])
        owner = (np.searchsorted(starts, wanted_rows, side="right") - 1).tolist()  # the item of each wanted row
        rows: list[torch.Tensor | None] = [None] * len(wanted_rows)
        for part in parts:
            local = dict(zip(part, np.cumsum([0] + [items[i][1] for i in part]).tolist()))  # item -> its first row here
            picks = [(j, local[i] + r - int(starts[i])) for j, (i, r) in enumerate(zip(owner, wanted_rows)) if i in local]
            # a part that samples nothing (a prompt's first chunk) is still run for its K/V; its one row is dropped
            logits = self._forward([items[i] for i in part], kv, [p for _, p in picks] or [sum(items[i][1] for i in part) - 1])
            for (j, _), row in zip(picks, logits):
                rows[j] = row
        return self._float_logits(torch.stack(rows) if rows else logits[:0])

    def _float_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits in float32, for the sampler. A decode batch's logits beyond glibc's mmap threshold (32 MiB,
        see keep_freed_memory: 171 rows of a 49k vocabulary) would be fresh pages every step, faulted in at ~13 ms for
        256 rows; they are written into a buffer kept across steps instead (~2 ms), valid until the next forward."""
        if logits.dtype == torch.float32:
            return logits
        if self.device.type != "cpu" or logits.numel() * 4 <= MMAP_THRESHOLD_BYTES or logits.shape[0] > self.config.max_num_seqs:
            return logits.float()  # small, or an occasional large step (prompt logprobs, drafts): not worth keeping
        if self._logits_buffer is None or self._logits_buffer.numel() < logits.numel():
            self._logits_buffer = torch.empty(logits.numel(), dtype=torch.float32, device=self.device)
        return self._logits_buffer[: logits.numel()].view(logits.shape).copy_(logits)

    def _compiled_parts(self, items, wanted_rows) -> list[list[int]] | None:
        """Under load a step mixes decode rows with new prompts (requests join as others leave). With --compile it
        runs as parts, each on a graph compiled at start-up: the decode rows as one decode-only step, each prompt
        from position 0 (whole, or its first chunk) as a lone prompt; whatever else the step holds (chunks after the
        first, drafts, rows for prompt logprobs) as one eager step. Returns the parts (item indices) or None when
        splitting gains no compiled part."""
        if self.compiled_forward is None or len(items) < 2:
            return None
        starts = np.cumsum([0] + [n for _, n, _ in items])
        wanted = set(wanted_rows)
        decode, fresh, rest = [], [], []
        for i, (seq, n, _) in enumerate(items):
            start, last = seq.num_computed_tokens, int(starts[i + 1]) - 1
            rows_wanted = wanted.intersection(range(int(starts[i]), last + 1))
            if n == 1 and start > 0 and rows_wanted == {last}:
                decode.append(i)
            elif n > 1 and start == 0 and rows_wanted <= {last} and self._compiled_kind([], [(0, n, n, None)], 1):
                fresh.append(i)
            else:
                rest.append(i)
        # each part in _group's (offset, new, end, table) form, as _compiled_kind reads it
        decode_rows = [(0, 1, items[i][0].num_computed_tokens + 1, None) for i in decode]
        if decode and not self._compiled_kind(decode_rows, [], len(decode)):
            rest, decode = sorted(rest + decode), []
        if not fresh and (not decode or not rest):
            return None  # one part: the step as it is
        return [p for p in ([decode] if decode else []) + [[i] for i in fresh] + ([rest] if rest else [])]

    def _forward(self, items: list[tuple[object, int, list[int]]], kv: KVCacheManager, wanted_rows: list[int]) -> torch.Tensor:
        input_ids, positions, slot_mapping = [], [], []
        decode, prefill = [], []
        offset = 0
        bs = self.block_size
        for seq, n, tokens in items:
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(kv.block_tables[seq.request_id])
            input_ids.extend(tokens)
            positions.append(pos)
            slot_mapping.append(table[pos // bs] * bs + pos % bs)
            (decode if n == 1 else prefill).append((offset, n, start + n, table))
            offset += n
        dev = self.device
        positions_np = np.concatenate(positions)
        compiled = self._compiled_kind(decode, prefill, len(wanted_rows))
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)).to(dev),
            groups=[self._group(g, positions_np, min_blocks=2 if compiled else 1) for g in (decode, prefill) if g],
        )
        return (self.compiled_forward if compiled else self.model)(
            torch.tensor(input_ids, device=dev),
            torch.from_numpy(positions_np).to(dev),
            meta,
            torch.tensor(wanted_rows, device=dev, dtype=torch.long),
        )

    def _score_prompt(self, logits: torch.Tensor, owners: list[tuple[object, int]]) -> None:
        """prompt_logprobs: raw log-softmax of the model (no sampling parameters applied), as vLLM."""
        logprobs = torch.log_softmax(logits[:, : self.sampler.vocab_size].float(), dim=-1)
        row = 0
        for req, count in owners:
            k = req.params.prompt_logprobs
            p0 = len(req.prompt_logprobs) - 1
            targets = torch.tensor(req.prompt_token_ids[p0 + 1 : p0 + 1 + count], device=logprobs.device)
            lp = logprobs[row : row + count]
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
            for j in range(count):
                entry = {int(targets[j]): chosen[j]}
                if k:
                    entry.update(zip(top_i[j].tolist(), top_v[j].tolist()))
                req.prompt_logprobs.append(entry)
            row += count

    def _group(self, rows: list[tuple[int, int, int, np.ndarray]], positions: np.ndarray, min_blocks: int = 1) -> AttentionGroup:
        """Pad a group of sequences to [B, Q] queries and [B, N] key blocks; keys are gathered block by block."""
        bs = self.block_size
        B = len(rows)
        Q = max(n for _, n, _, _ in rows)
        L = max(end for _, _, end, _ in rows)
        token_index = np.zeros((B, Q), dtype=np.int64)
        valid = np.zeros((B, Q), dtype=bool)
        ends = np.empty(B, dtype=np.int64)
        tables = np.zeros((B, max(-(-L // bs), min_blocks)), dtype=np.int64)
        for i, (offset, n, end, table) in enumerate(rows):
            token_index[i, :n] = np.arange(offset, offset + n)
            valid[i, :n] = True
            ends[i] = end
            tables[i, : len(table)] = table[: tables.shape[1]]
        flat_valid = valid.reshape(-1)
        covers_batch = bool(flat_valid.all()) and rows[0][0] == 0 and sum(n for _, n, _, _ in rows) == len(positions)
        fresh = all(n == ctx for _, n, ctx, _ in rows)
        mask = lengths = spans = None
        # A fresh prompt under an FP8 cache attends to its own keys, before they are rounded (as with SDPA).
        own_keys = fresh and self.native_prompt_kernel and not self.native_prefill_attention
        if not fresh and Q == 1 and self.native_decode_attention:
            lengths = torch.from_numpy(ends).to(self.device)
        elif self.native_prefill_attention or own_keys:
            spans = torch.tensor([[offset, n, end] for offset, n, end, _ in rows], dtype=torch.long, device=self.device)
            if own_keys:  # the kernel's blocks are then single keys: each key's row in this step's K and V
                tables = np.zeros((B, Q), dtype=np.int64)
                for i, (offset, n, _, _) in enumerate(rows):
                    tables[i, :n] = np.arange(offset, offset + n)
        elif not fresh:
            key_pos = np.arange(tables.shape[1] * bs)
            # A padded query gets position 0 and sees key 0 only, so no row is all -inf; its output is dropped.
            query_pos = np.where(valid, positions[token_index], 0)
            visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
            # the query heads sharing a KV head are folded into the query axis: [B, 1, G * Q, L]
            visible = np.broadcast_to(visible[:, None], (B, self.query_groups, Q, visible.shape[-1])).reshape(B, 1, -1, visible.shape[-1])
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(torch.from_numpy(~visible).to(self.device), float("-inf"))
        dev = self.device
        return AttentionGroup(
            token_index=torch.from_numpy(token_index).to(dev),
            kv_blocks=torch.from_numpy(tables).to(dev),
            mask=mask,
            src=torch.from_numpy(np.flatnonzero(flat_valid)).to(dev),
            dst=torch.from_numpy(token_index.reshape(-1)[flat_valid]).to(dev),
            covers_batch=covers_batch,
            fresh=fresh,
            lengths=lengths,
            spans=spans,
            own_keys=own_keys,
        )
