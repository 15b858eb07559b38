"""CUDA graphs for decode steps.

A decode step of a small model launches a few hundred kernels (per layer: norms, projections, rotary, the KV write,
attention, SwiGLU), each a few microseconds of Python and driver work, so at small batches the GPU waits on the CPU.
A CUDA graph records a step's launches once and replays them with one call.

A graph replays on the memory it was captured with, so everything a decode step reads lives at fixed addresses: the
token ids, positions and KV slots here, the attention metadata in the backend's DecodeGraphBuffers. Graphs are
captured at start-up for batch-size buckets (1, 2, 4, then multiples of 8, as vLLM's), largest first, in one memory
pool; a step of n sequences runs the smallest bucket that holds it, its n rows written first and the rest padding:
token 0 at position 0, writing its K/V into the scratch slot the KV tensors keep outside the pool, attending one key,
its logits dropped.

What runs eagerly instead: prompts and chunks, speculative verification rows, steps with LoRA adapters, steps of
more sequences than the largest bucket, and everything under --enforce-eager.

Off CUDA (the test suite, under Triton's interpreter) the same padded steps run eagerly on the same fixed buffers,
which checks everything but the capture itself.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from llmserve.worker.input_batch import ForwardItem, decode_row_inputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default largest bucket


def capture_sizes(max_batch: int) -> list[int]:
    """The batch-size buckets for decode steps of up to max_batch sequences: 1, 2, 4, then every multiple of 8, and
    max_batch itself."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes) | {max_batch})


class CudaGraphRunner:
    def __init__(self, runner):
        self.runner = runner
        config = runner.config
        self.max_batch = min(config.max_num_seqs, config.max_cudagraph_capture_size or MAX_CAPTURE_SIZE)
        self.sizes = capture_sizes(self.max_batch)
        self.block_size = runner.block_size
        max_len = config.max_model_len or runner.model_config.max_position_embeddings
        self.max_blocks = -(-max_len // self.block_size)
        pin = runner.platform.pin_host_memory and runner.device.type == "cuda"
        self.attention = runner.attention.decode_graph_buffers(self.max_batch, self.max_blocks, pin)
        if self.attention is None:
            raise ValueError(f"the {runner.attention.name} attention backend cannot be captured in CUDA graphs")
        device = runner.device
        # token ids, positions and KV slots: host staging (page-locked on a GPU) and their device copies, one
        # contiguous buffer each so that a step's rows are one plain copy
        self.host = [torch.zeros(self.max_batch, dtype=torch.long, pin_memory=pin) for _ in range(3)]
        self.host_np = [t.numpy() for t in self.host]
        self.inputs = [t.to(device) for t in self.host]
        self.logits_index = torch.arange(self.max_batch, device=device)
        self.scratch_slot = runner.kv.scratch_slot
        self.replays = device.type == "cuda"  # elsewhere the padded steps run eagerly (tests)
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's copies from the staging buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def bucket(self, batch: int) -> int:
        return self.sizes[int(np.searchsorted(self.sizes, batch))]

    def _write(self, items: list[ForwardItem], size: int) -> None:
        """The step's sequences into the first rows of the fixed buffers, padding after them up to `size`."""
        n = len(items)
        if self._copied is not None:
            # The staging buffers are page-locked, so the previous step's copies read them when the device gets to
            # them: with async scheduling that step may not have started yet. Its copies are at its front, so this
            # waits microseconds, not for the step.
            self._copied.synchronize()
        ids, positions, slots = self.host_np
        ids[:n], positions[:n], slots[:n] = decode_row_inputs(items, self.block_size)
        ids[n:size], positions[n:size], slots[n:size] = 0, 0, self.scratch_slot
        self.attention.write(positions[:n] + 1, [it.block_table for it in items], size)
        if self.inputs[0].data_ptr() != self.host[0].data_ptr():
            for device_buffer, host_buffer in zip(self.inputs, self.host):
                device_buffer[:size].copy_(host_buffer[:size], non_blocking=True)
            if self.replays:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self.runner.input_batch.fill_placeholders(ids[:n], self.inputs[0][:n])

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, slots = (t[:size] for t in self.inputs)
        meta = self.attention.metadata(size, slots)
        return self.runner.model(ids, positions, meta, self.logits_index[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        if self.replays:
            pool = None
            stream = torch.cuda.Stream(self.runner.device)
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
                self._write([], size)
                # once eagerly on a side stream, as torch's capture needs: Triton compiles, cuBLAS sets up
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
            torch.cuda.synchronize(self.runner.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1fs", len(self.graphs),
                    self.max_batch, self.capture_seconds)

    def run(self, items: list[ForwardItem], wanted_rows: list[int]) -> torch.Tensor | None:
        """A decode-only step's logits (each item one token, each sampled) from its bucket's graph; None for any
        other step (the caller runs it eagerly)."""
        n = len(items)
        if not 0 < n <= self.max_batch or wanted_rows != list(range(n)) or any(len(it.token_ids) != 1 for it in items):
            return None
        size = self.bucket(n)
        self._write(items, size)
        self.runner.record_pass(n, compiled=True)
        if self.replays:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._forward(size)
        return logits[:n]
