"""The model runner: StepInput → inputs → attention metadata → forward → logits → sampler → StepOutput.

It owns the model, the KV tensors, the per-request state that arrived in NewRequestData, and the sampler. It reads
nothing of the engine's (requests, KV manager); its one entry from the engine is `execute`, through an executor.
Where things run is the platform's choice: dtype, weight methods, attention backend, compiled graphs.
"""

from __future__ import annotations

import dataclasses

import logging
import time
from typing import Callable

import torch
from torch import nn

from llmserve.config import EngineConfig, ModelConfig, PoolerConfig
from llmserve.distributed.parallel_state import head_ranges, min_over_ranks
from llmserve.engine.step_io import PLACEHOLDER_TOKEN, ForwardPass, SampledRow, StepInput, StepOutput
from llmserve.kv_transfer.connector import KVConnectorWorker
from llmserve.layers.linear import LinearBase
from llmserve.layers.pooler import Pooler, PoolingRow
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.models import build_model
from llmserve.platforms import Platform, get_platform
from llmserve.sample.rejection import verify
from llmserve.sample.device_copy import on_device
from llmserve.sample.sampler import Sampler
from llmserve.worker.input_batch import ForwardItem, InputBatch
from llmserve.worker.kv_tensors import KVTensors, num_kv_blocks

logger = logging.getLogger(__name__)



def random_weights(model: torch.nn.Module, seed: int) -> None:
    """--load-format dummy: every parameter drawn uniformly from [-1e-3, 1e-3] (vLLM's dummy weights), from `seed`,
    so that two engines on the same config compute the same. The answers mean nothing; the speed is the model's."""
    generator = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.materialize()
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-1e-3, 1e-3, generator=generator)

class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, vocab_size: int | None = None,
                 platform: Platform | None = None):
        self.platform = platform = platform or get_platform(config.device)
        # Decided once here, so that every platform hook below sees a plain bool.
        self.deterministic = platform.resolve_deterministic(config)
        self.config = config = dataclasses.replace(platform.with_defaults(config), deterministic=self.deterministic)
        self.model_config = model_config
        self.device = platform.device
        self.dtype = platform.resolve_dtype(config)
        self.kv_dtype = platform.resolve_kv_dtype(config)
        platform.prepare_process()
        t0 = time.perf_counter()
        # an embedding engine (--runner pooling, resolved by the engine) pools hidden states and samples nothing
        self.pooler = Pooler(config.pooler_config or PoolerConfig()) if config.runner == "pooling" else None
        model = build_model(model_config, lm_head=self.pooler is None)
        plan = platform.weight_plan(config, model_config, self.dtype)  # low-bit codes from the float32 weights

        def layer_loaded(name: str, layer: LinearBase) -> None:
            """A linear layer's every part is in: its method now, and what stays float narrowed to the serving
            dtype, so that the float32 copy is freed before the next layer is read (the same values as a cast of the
            whole model afterwards)."""
            plan.apply(name, layer)
            for param in ("weight", "bias"):
                tensor = getattr(layer, param)
                if tensor is not None and tensor.numel() and tensor.dtype != self.dtype:
                    setattr(layer, param, nn.Parameter(tensor.data.to(self.dtype), requires_grad=False))

        if config.load_format == "dummy":
            random_weights(model, config.seed)
        else:
            model.load_weights(weights(), on_layer_loaded=layer_loaded)
        for name, m in model.named_modules():  # layers not loaded on their own (a tied LM head), and dummy weights
            if isinstance(m, LinearBase):
                plan.apply(name, m)
        self.weights = plan.summary
        # Rotary tables stay float32 (a bf16 round trip would blur the angles at long positions).
        tables = {m: (m.cos, m.sin) for m in model.modules() if isinstance(m, RotaryEmbedding)}
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        for m, (cos, sin) in tables.items():
            m.cos, m.sin = cos.to(self.device), sin.to(self.device)
        platform.finish_weights(self.model, config, self.weights)
        self.weights.methods = {n: m.method.describe() for n, m in self.model.named_modules()
                                if isinstance(m, LinearBase)}
        self.weights.float_weight_bytes = sum(m.weight.numel() * m.weight.element_size()
                                              for m in self.model.modules() if isinstance(m, LinearBase))
        platform.after_load()
        self.lora = None
        if config.enable_lora:
            from llmserve.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, model_config, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, self.dtype, self.device)
        self.load_seconds = time.perf_counter() - t0

        self.block_size = config.block_size
        q_heads, kv_heads = head_ranges(model_config.num_attention_heads, model_config.num_key_value_heads)
        self.attention = platform.attention_backend(config, model_config, self.dtype, self.kv_dtype, len(q_heads),
                                                    len(kv_heads))
        # every rank holds the same blocks (the scheduler's), whatever memory each found free
        blocks = min_over_ranks(num_kv_blocks(config, model_config, self.kv_dtype, platform.kv_cache_budget(config)))
        self.kv = KVTensors(self.model, self.attention, blocks)
        self.kv_connector = KVConnectorWorker()  # loads KV that a prefill instance sent (disaggregated decode)
        self.kv_connector.register_kv_caches(self.kv)
        self.input_batch = InputBatch(config.max_num_batched_tokens, self.block_size, self.device,
                                      platform.device_is_host)
        self.sampler = Sampler(vocab_size or model_config.vocab_size, self.device, seed=config.seed,
                               argmax=platform.argmax_rows)
        self._logits_buffer: torch.Tensor | None = None
        self._passes: list[ForwardPass] = []
        self._previous_rows: dict[str, int] = {}  # async scheduling: each request's row in the last step's tokens
        self.logits_observers: list = []  # callbacks(request ids, logits) of plain sampled rows (executor.watch_logits)
        # compiled graphs and CUDA graphs are of decode steps (and lone prompts' logits): an embedding engine has none
        self.graphs = platform.graph_runner(self) if config.compile and self.pooler is None else None
        if self.graphs is not None:
            self.graphs.capture()
        # CUDA graphs of decode steps (graphs/cuda_graphs.py), where the platform and the attention backend allow
        self.cuda_graphs = None if config.compile or self.pooler is not None else platform.decode_graphs(self)
        if self.cuda_graphs is not None:
            self.cuda_graphs.capture()

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    # ---- one step ---------------------------------------------------------------------------
    def execute(self, step: StepInput) -> StepOutput:
        """One forward over the step's rows; returns, per row that samples, the tokens it emits: one for a plain
        row, the accepted drafts plus one for a row that speculated."""
        return self.execute_deferred(step)()

    @torch.inference_mode()
    def execute_deferred(self, step: StepInput) -> Callable[[], StepOutput]:
        """execute in two halves: this call queues the step's work on the device (on a GPU it returns while the
        device computes), the call it returns waits for the sampled tokens and gives the StepOutput. With async
        scheduling the next step's first half may come before this step's second (its rows then read this step's
        tokens on the device); otherwise the second comes first."""
        batch = self.input_batch
        for rid in step.finished_request_ids:
            batch.remove(rid)
            self.sampler.release(rid)
        for new in step.new_requests:
            batch.add(new)
        for src, dst in step.block_copies:
            self.kv.copy_block(src, dst)
        if step.kv_loads:
            self.kv_connector.start_load_kv(step.kv_loads)
        out = StepOutput()
        self._passes = out.forward_passes
        if not step.rows:
            return lambda: out
        rows = self._order_by_adapter(step.rows) if self.lora is not None else step.rows
        if self.pooler is not None:
            out.pooled = self._pool(rows)
            return lambda: out
        items: list[ForwardItem] = []
        plain_rows, plain = [], []  # flat rows whose logits sample one token, and their requests
        spec_rows, spec = [], []  # per speculating request: its K+1 flat rows
        prompt_rows, prompt_owners = [], []  # flat rows whose logits score the next prompt token
        offset = 0
        for row in rows:
            n = row.num_tokens
            tokens = row.token_ids
            if tokens[-1] == PLACEHOLDER_TOKEN:  # async scheduling: the previous step's token, read on the device
                tokens = tokens[:-1] + [-1 - self._previous_rows[row.request_id]]
            items.append(ForwardItem(tokens, row.start, row.block_table))
            if row.samples and row.spec_token_ids:
                k = len(row.spec_token_ids)
                spec_rows.append(list(range(offset + n - 1 - k, offset + n)))
                spec.append(row)
            elif row.samples:
                plain_rows.append(offset + n - 1)
                plain.append(row)
            if row.prompt_logprob_range is not None:
                first, last = row.prompt_logprob_range
                prompt_rows.extend(range(offset + first - row.start, offset + last - row.start))
                prompt_owners.append((row.request_id, first, last))
            offset += n
        flat_spec = [r for rows in spec_rows for r in rows]
        logits = self.compute_logits(items, plain_rows + flat_spec + prompt_rows)
        n_plain, n_spec = len(plain_rows), len(flat_spec)
        if prompt_rows:
            out.prompt_logprobs = self._score_prompt(logits[n_plain + n_spec:], prompt_owners)
        sampling = [batch.sampling_row(r.request_id, r.num_output_tokens, r.grammar_bitmask) for r in plain]
        for observe in self.logits_observers:
            observe([r.request_id for r in plain], logits[:n_plain])
        sampled_to_host = self.sampler.sample_deferred(logits[:n_plain], sampling)
        if self.config.async_scheduling:  # the next step may be built before these tokens reach the host
            self.input_batch.previous_tokens = self.sampler.last_tokens if plain else None
            self._previous_rows = {r.request_id: i for i, r in enumerate(plain)}
        if not spec:
            return lambda: self._finish_step(out, sampling, sampled_to_host)
        self._finish_step(out, sampling, sampled_to_host)  # verification reads the tokens on the host anyway
        blocks, at = [], n_plain
        for rows in spec_rows:
            blocks.append(logits[at:at + len(rows)])
            at += len(rows)
        views = [batch.sampling_row(r.request_id, r.num_output_tokens, r.grammar_bitmask) for r in spec]
        verified = verify(self.sampler, blocks, views, [r.spec_token_ids for r in spec],
                          [r.spec_draft_probs for r in spec])
        out.sampled.update({r.request_id: v for r, v in zip(spec, verified)})
        return lambda: out

    @staticmethod
    @torch.inference_mode()
    def _finish_step(out: StepOutput, sampling: list, sampled_to_host) -> StepOutput:
        sampled = sampled_to_host()
        out.sampled = {r.request_id: SampledRow([t], [lp], [slp], 0) for r, t, lp, slp in
                       zip(sampling, sampled.token_ids, sampled.logprobs, sampled.sampled_logprobs)}
        return out

    def compute_logits(self, items: list[ForwardItem], wanted_rows: list[int]) -> torch.Tensor:
        """Computes each item's tokens from its start position on, writing their K/V through its block table;
        returns float32 logits of the flat rows in `wanted_rows` (valid until the next call)."""
        graphs = self.graphs or self.cuda_graphs
        if graphs is not None and not (self.lora is not None and self.lora.state.segments):
            logits = graphs.run(items, wanted_rows)  # compiled steps run the base model only
            if logits is not None:
                return self._float_logits(logits)
        return self._float_logits(self.forward(items, wanted_rows))

    def record_pass(self, num_tokens: int, compiled: bool) -> None:
        """A forward of the current step, for its StepOutput (how the step ran)."""
        self._passes.append(ForwardPass(num_tokens, compiled))

    def forward(self, items: list[ForwardItem], wanted_rows: list[int], compiled=None,
                min_blocks: int = 1) -> torch.Tensor:
        """One forward of the model (or the given compiled graph) over the items; logits in the model's dtype."""
        inputs = self.input_batch.prepare(items)
        self.record_pass(len(inputs.positions_np), compiled is not None)
        meta = self.attention.build_metadata(inputs.spans, inputs.positions_np, inputs.slot_mapping, min_blocks)
        return (compiled or self.model)(inputs.input_ids, inputs.positions, meta,
                                        on_device(wanted_rows, self.device, torch.long))

    def _pool(self, rows) -> dict[str, torch.Tensor]:
        """--runner pooling: one forward to the last layer's hidden states; each row's share of them, for its pooling
        (`samples` marks the row whose chunk ends the prompt)."""
        inputs = self.input_batch.prepare([ForwardItem(r.token_ids, r.start, r.block_table) for r in rows])
        self.record_pass(len(inputs.positions_np), False)
        meta = self.attention.build_metadata(inputs.spans, inputs.positions_np, inputs.slot_mapping, 1)
        hidden = self.model.hidden_states(inputs.input_ids, inputs.positions, meta)
        pooling, offset = [], 0
        for r in rows:
            pooling.append(PoolingRow(r.request_id, offset, r.num_tokens, r.start, r.samples))
            offset += r.num_tokens
        return self.pooler.select(hidden, pooling, self.model.score)  # (score: a classifier's head, else None)

    def _order_by_adapter(self, rows):
        """The step's rows grouped by adapter (base rows first), so that each adapter's tokens are one segment of the
        flat batch (layers/lora.py), with the step's adapters in their slots."""
        requests = self.input_batch.requests
        order = self.lora.prepare_step([(requests[r.request_id].lora_request, r.num_tokens) for r in rows])
        return [rows[i] for i in order]

    # ---- LoRA adapters (host memory and slots: lora/manager.py) ------------------------------------
    def add_lora(self, request) -> int:
        """Reads and checks the adapter into host memory (raises LoRAError, keeping nothing, if it is bad); returns
        its size in bytes."""
        if self.lora is None:
            raise RuntimeError("LoRA is not enabled on this runner")
        return self.lora.add(request).nbytes

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def _float_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits in float32, for the sampler. On a CPU a decode batch's logits beyond glibc's mmap threshold
        (32 MiB: 171 rows of a 49k vocabulary) would be fresh pages every step, faulted in at ~13 ms for 256 rows; they
        are written into a buffer kept across steps instead (~2 ms), valid until the next forward."""
        if logits.dtype == torch.float32:
            return logits
        threshold = self.platform.logits_buffer_min_bytes
        if threshold is None or logits.numel() * 4 <= threshold or logits.shape[0] > self.config.max_num_seqs:
            return logits.float()  # small, or an occasional large step (prompt logprobs, drafts): not worth keeping
        if self._logits_buffer is None or self._logits_buffer.numel() < logits.numel():
            self._logits_buffer = torch.empty(logits.numel(), dtype=torch.float32, device=self.device)
        return self._logits_buffer[: logits.numel()].view(logits.shape).copy_(logits)

    def _score_prompt(self, logits: torch.Tensor, owners: list[tuple[str, int, int]]) -> dict[str, list[dict]]:
        """prompt_logprobs: raw log-softmax of the model (no sampling parameters applied), as vLLM."""
        logprobs = torch.log_softmax(logits[:, : self.sampler.vocab_size].float(), dim=-1)
        out, row = {}, 0
        for rid, first, last in owners:
            state = self.input_batch.requests[rid]
            k, count = state.params.prompt_logprobs, last - first
            targets = torch.tensor(state.prompt_token_ids[first + 1: last + 1], device=logprobs.device)
            lp = logprobs[row: row + count]
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
            entries = []
            for j in range(count):
                entry = {int(targets[j]): chosen[j]}
                if k:
                    entry.update(zip(top_i[j].tolist(), top_v[j].tolist()))
                entries.append(entry)
            out[rid] = entries
            row += count
        return out

    # ---- KV blocks (copy-on-write, spill tiers) ------------------------------------------------
    def read_block(self, block: int) -> torch.Tensor:
        return self.kv.read_block(block)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        self.kv.write_block(block, data)
