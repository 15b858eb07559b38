"""Scheduling and memory defaults by device: what a user leaves unset, the platform fills in (CPU: 64 sequences and
1024 tokens a step, 10 % of free memory for KV; CUDA: 256, 8192 and vLLM's --gpu-memory-utilization 0.9), and what
they set is kept."""

from __future__ import annotations

import logging

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.platforms.cpu import CpuPlatform
from llmserve.platforms.cuda import CudaPlatform


def test_each_platform_fills_in_what_is_unset_and_keeps_what_is_set():
    for platform, expected in ((CpuPlatform(torch.device("cpu")), (64, 1024, 0.10, None)),
                               (CudaPlatform(torch.device("cuda", 0)), (256, 8192, None, 0.90))):
        chosen = platform.with_defaults(EngineConfig())
        assert (chosen.max_num_seqs, chosen.max_num_batched_tokens, chosen.kv_cache_fraction,
                chosen.gpu_memory_utilization) == expected
        kept = platform.with_defaults(EngineConfig(max_num_seqs=3, max_num_batched_tokens=77, kv_cache_fraction=0.5))
        assert (kept.max_num_seqs, kept.max_num_batched_tokens, kept.kv_cache_fraction,
                kept.gpu_memory_utilization) == (3, 77, 0.5, None)
        kept = platform.with_defaults(EngineConfig(gpu_memory_utilization=0.7))
        assert kept.gpu_memory_utilization == 0.7
    assert CudaPlatform(torch.device("cuda", 0)).with_defaults(EngineConfig(gpu_memory_utilization=0.7)).kv_cache_fraction is None


def test_gpu_memory_utilization_is_ignored_on_cpu_with_a_warning(default_files, caplog):
    """A command line copied from a GPU runs on a CPU (as vLLM's does) with the CPU's KV sizing (10 % of free memory,
    at most 1 GiB; not 80 % of the machine), and says so."""
    from llmserve.engine.llm_engine import LLMEngine

    cpu = CpuPlatform(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="llmserve.platforms.interface"):
        copied = cpu.kv_cache_budget(cpu.with_defaults(EngineConfig(gpu_memory_utilization=0.8)))
        plain = cpu.kv_cache_budget(cpu.with_defaults(EngineConfig()))
    assert "--gpu-memory-utilization applies to GPUs; on cpu the KV cache is --kv-cache-fraction 0.1" in caplog.text
    assert copied == pytest.approx(plain, rel=0.05)  # free memory may move a little between the two calls
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmserve.platforms.interface"):
        engine = LLMEngine(EngineConfig(device="cpu", gpu_memory_utilization=0.8), files=default_files)
    assert "--gpu-memory-utilization applies to GPUs" in caplog.text
    assert 0 < engine.executor.info.kv_cache_bytes <= 2**30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the KV pool by --gpu-memory-utilization")
def test_gpu_memory_utilization_bounds_what_is_in_use_on_the_gpu():
    """Once the pool is made, what is in use on the device stays under the share asked for, and near it; a share
    below what the weights already take is refused, naming the flag."""
    from llmserve.errors import InvalidRequestError
    from llmserve.platforms.cuda import CudaPlatform

    platform = CudaPlatform(torch.device("cuda", 0))
    free, total = torch.cuda.mem_get_info()
    in_use = total - free
    share = (in_use + 2**30) / total  # room for 1 GiB of KV
    budget = platform.kv_budget_by_utilization(share)
    assert 0.9 * 2**30 <= budget <= 2**30 + 2**20
    pool = torch.empty(budget, dtype=torch.uint8, device="cuda")
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= share * total + 64 * 2**20  # the allocator rounds up to its segments
    del pool
    with pytest.raises(InvalidRequestError, match="--gpu-memory-utilization .* no room for the KV cache"):
        platform.kv_budget_by_utilization(max(in_use - 2**30, 1) / total)


def test_the_engine_runs_with_its_devices_defaults_and_logs_them(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="llmserve.engine.llm_engine"):
        engine = make_engine(max_num_seqs=None)
    expected = engine.executor.runner.platform.with_defaults(EngineConfig())
    assert engine.config.max_num_seqs == expected.max_num_seqs
    assert engine.config.max_num_batched_tokens == expected.max_num_batched_tokens
    assert (f"steps of up to {expected.max_num_seqs} sequences and {expected.max_num_batched_tokens} tokens"
            in caplog.text)
