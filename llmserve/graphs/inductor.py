"""torch.compile of whole steps, where eager PyTorch spends a large share of the time launching small elementwise ops
(norms, rotary, residual adds, SwiGLU) that a compiled graph fuses. Two kinds of step are compiled at start-up:
- decode-only steps of at most compile_max_decode_batch rows. Dynamic shapes give one graph for batch 1 (torch always
  specializes it), one for 2 up to the low-bit row limit and one above it (the projections switch weights there);
- a step that is one prompt from position 0 (whole, or its first chunk), the prefill a lone request meets.
A mixed step runs as parts on these graphs; what fits neither (later chunks, drafts, prompt logprobs) stays eager:
each kind would be one more graph to compile. Every graph is compiled at start-up rather than under the first
requests, so serving never stalls on a recompile.
"""

from __future__ import annotations

import logging
import time
import types

import numpy as np
import torch

from llmserve import kernels
from llmserve.attention.backend import AttentionMetadata, SeqSpan
from llmserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)
# The lone-prompt graph's trial length: unlike any model dimension, which torch would otherwise assume equal to it.
LONE_PROMPT_TRIAL_ROWS = 97
# Where the low-bit row limit leaves room for prompts of 8 rows or more on the low-bit weights, a second lone-prompt
# graph is traced with this many rows (or the limit, if smaller), so that they run compiled too.
SHORT_PROMPT_TRIAL_ROWS = 37
# With SDPA, compiled decode steps above 4 rows measured no faster than eager (docs/benchmarks-history.md).
SDPA_COMPILE_MAX_DECODE_BATCH = 4


def compiled_decode_batch_limit(config, attention_backend: str) -> int:
    """Decode-only steps of up to this many rows run compiled: all of them (max_num_seqs) with the native attention
    kernel, 4 with SDPA, unless compile_max_decode_batch says otherwise."""
    default = config.max_num_seqs if attention_backend == "native" else SDPA_COMPILE_MAX_DECODE_BATCH
    return config.compile_max_decode_batch or default


class InductorGraphRunner:
    def __init__(self, runner):
        self.runner = runner
        self.lowbit_max_rows = runner.weights.lowbit_max_rows
        self.max_decode_batch = compiled_decode_batch_limit(runner.config, runner.attention.name)
        self.compiled_forward = None
        self.compile_seconds = 0.0

    def lone_prompt_trial_rows(self) -> list[int]:
        """The prompt lengths the lone-prompt graphs are traced with: one on each side of the low-bit row limit, where
        that limit is 8 rows or more (below, such prompts run eager)."""
        limit = self.lowbit_max_rows
        return [LONE_PROMPT_TRIAL_ROWS] + ([min(limit, SHORT_PROMPT_TRIAL_ROWS)] if limit is not None and limit >= 8
                                          else [])

    def capture(self) -> None:
        t0 = time.perf_counter()
        runner = self.runner
        runner.platform.prepare_compile()
        # torch's on-disk graph cache keys on the graph, not on what a custom op does: a graph compiled against an
        # older build of llmserve's kernels would be reused, and call them wrongly. The kernels' digest parts the cache.
        tag = f"llmserve-kernels-{kernels.source_digest()}"
        if tag not in torch.compiler.config.cache_key_tag:
            torch.compiler.config.cache_key_tag += tag
        # Weights, KV tensors and module flags are fixed after load: guarding on them would cost time on every call.
        # The C++ wrapper launches the graph's ~450 kernels without Python in between (16 % faster batch-1 decode);
        # built separately from the kernels, the graphs compile in 142 s instead of 385 s and run as fast.
        # Dynamo keeps compiled graphs on the function's code object, and without the module guards a second model in
        # this process (a draft model, another LLM) would run this one's graphs on its own tensors: each runner gets
        # its own copy of forward's code, hence its own graphs.
        forward = runner.model.forward.__func__
        own_forward = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                         forward.__defaults__, forward.__closure__)
        # Without inductor's runtime checks of each kernel's tensors (~640 a decode step in the C++ wrapper, each
        # building its error message before it checks): they check the custom ops' fake shapes, which
        # tests/test_compiled_steps.py compares with eager steps.
        self.compiled_forward = torch.compile(types.MethodType(own_forward, runner.model), options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True,
            "cpp_wrapper_build_separate": True, "size_asserts": False, "alignment_asserts": False,
            "scalar_asserts": False})
        dev, bs = runner.device, runner.block_size
        # Trial steps, in inference mode as forward() runs (tensors made outside it would not match the guards),
        # write K/V to the first blocks, which are free at start-up. Only the batch and the lengths vary between
        # steps; every other size stays fixed in the graph.
        ctx = 2 * bs + 1  # three key blocks: a one-block table would be specialized like a batch of 1
        batches = {1, 2} | ({self.lowbit_max_rows + 1} if self.lowbit_max_rows is not None else set())
        trials = [[SeqSpan(i, 1, ctx, np.zeros(3, dtype=np.int64)) for i in range(batch)]
                  for batch in sorted(b for b in batches if b <= self.max_decode_batch)]
        for n in self.lone_prompt_trial_rows():
            trials.append([SeqSpan(0, n, n, np.arange(-(-n // bs)))])
        try:
            with torch.inference_mode():
                for spans in trials:
                    batch, new = len(spans), spans[0].num_queries
                    positions = np.concatenate([np.arange(s.num_keys - new, s.num_keys) for s in spans])
                    group = runner.attention.build_group(spans, positions, 1)
                    meta = AttentionMetadata(slot_mapping=torch.arange(batch * new, device=dev), groups=[group])
                    args = (torch.zeros(batch * new, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev),
                            meta, torch.arange(batch, device=dev) * new + new - 1)
                    dynamic = group.dynamic_dims(per_token=batch * new > 1, per_sequence=batch > 1)
                    if batch * new > 1:  # the step's tokens (size 1 is always its own graph)
                        dynamic += [(t, 0) for t in (*args[:2], meta.slot_mapping)]
                    if batch > 1:  # the sequences
                        dynamic.append((args[3], 0))
                    for t, dim in dynamic:
                        torch._dynamo.mark_dynamic(t, dim)
                    self.compiled_forward(*args)
        except Exception as e:  # inductor needs a working C++ toolchain; say so in one line
            raise InvalidRequestError(f"compile failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
                                      "it needs a C++ compiler (g++ or clang) on PATH, or leave it off", "compile") from e
        self.compile_seconds = time.perf_counter() - t0
        logger.info("compiled in %.1fs: decode steps of up to %d rows, lone prompts", self.compile_seconds,
                    self.max_decode_batch)

    def is_compiled_kind(self, items, num_wanted: int) -> bool:
        """Whether a step of these items is of a kind compiled at start-up."""
        decode = [it for it in items if len(it.token_ids) == 1]
        if len(decode) == len(items):  # decode rows; a step of only one-token prompts has no history and stays eager
            return (len(decode) <= self.max_decode_batch and num_wanted == len(decode)
                    and any(it.start > 0 for it in decode))
        if decode or len(items) != 1 or num_wanted != 1:
            return False
        prompt = items[0]
        # from position 0, and on the weights the graph was traced with (a one-row prompt is a graph of its own)
        new = len(prompt.token_ids)
        uses_lowbit = self.runner.weights.uses_lowbit
        return prompt.start == 0 and new > 1 and any(uses_lowbit(new) == uses_lowbit(n)
                                                     for n in self.lone_prompt_trial_rows())

    def _forward(self, items, wanted_rows) -> torch.Tensor:
        if self.is_compiled_kind(items, len(wanted_rows)):
            return self.runner.forward(items, wanted_rows, compiled=self.compiled_forward, min_blocks=2)
        return self.runner.forward(items, wanted_rows)

    def run(self, items, wanted_rows) -> torch.Tensor:
        """The step's logits (model dtype), each part on its compiled graph where it has one."""
        parts = self.parts(items, wanted_rows)
        if parts is None:
            return self._forward(items, wanted_rows)
        # Sequences never attend to each other, so each part computes what it would in one mixed step, up to rounding.
        starts = np.cumsum([0] + [len(it.token_ids) for it in items])
        owner = (np.searchsorted(starts, wanted_rows, side="right") - 1).tolist()  # the item of each wanted row
        rows: list[torch.Tensor | None] = [None] * len(wanted_rows)
        logits = None
        for part in parts:
            local = dict(zip(part, np.cumsum([0] + [len(items[i].token_ids) for i in part]).tolist()))
            picks = [(j, local[i] + r - int(starts[i])) for j, (i, r) in enumerate(zip(owner, wanted_rows)) if i in local]
            # a part that samples nothing (a prompt's first chunk) is still run for its K/V; its one row is dropped
            logits = self._forward([items[i] for i in part],
                                   [p for _, p in picks] or [sum(len(items[i].token_ids) for i in part) - 1])
            for (j, _), row in zip(picks, logits):
                rows[j] = row
        return torch.stack(rows) if rows else logits[:0]

    def parts(self, items, wanted_rows) -> list[list[int]] | None:
        """Under load a step mixes decode rows with new prompts (requests join as others leave). It runs as parts,
        each on a graph compiled at start-up: the decode rows as one decode-only step, each prompt from position 0
        (whole, or its first chunk) as a lone prompt; whatever else the step holds (chunks after the first, drafts,
        rows for prompt logprobs) as one eager step. Returns the parts (item indices) or None when splitting gains no
        compiled part."""
        if len(items) < 2:
            return None
        starts = np.cumsum([0] + [len(it.token_ids) for it in items])
        wanted = set(wanted_rows)
        decode, fresh, rest = [], [], []
        for i, it in enumerate(items):
            n, last = len(it.token_ids), int(starts[i + 1]) - 1
            rows_wanted = wanted.intersection(range(int(starts[i]), last + 1))
            if n == 1 and it.start > 0 and rows_wanted == {last}:
                decode.append(i)
            elif n > 1 and it.start == 0 and rows_wanted <= {last} and self.is_compiled_kind([it], 1):
                fresh.append(i)
            else:
                rest.append(i)
        if decode and not self.is_compiled_kind([items[i] for i in decode], len(decode)):
            rest, decode = sorted(rest + decode), []
        if not fresh and (not decode or not rest):
            return None  # one part: the step as it is
        return ([decode] if decode else []) + [[i] for i in fresh] + ([rest] if rest else [])
