"""Scheduling and memory defaults by device: what a user leaves unset, the platform fills in (CPU: 64 sequences and
1024 tokens a step, 10 % of free memory for KV; CUDA: 256, 8192 and 90 %, as vLLM's), and what they set is kept."""

from __future__ import annotations

import logging

import torch

from llmserve.config import EngineConfig
from llmserve.platforms.cpu import CpuPlatform
from llmserve.platforms.cuda import CudaPlatform


def test_each_platform_fills_in_what_is_unset_and_keeps_what_is_set():
    for platform, expected in ((CpuPlatform(torch.device("cpu")), (64, 1024, 0.10)),
                               (CudaPlatform(torch.device("cuda", 0)), (256, 8192, 0.90))):
        chosen = platform.with_defaults(EngineConfig())
        assert (chosen.max_num_seqs, chosen.max_num_batched_tokens, chosen.kv_cache_fraction) == expected
        kept = platform.with_defaults(EngineConfig(max_num_seqs=3, max_num_batched_tokens=77, kv_cache_fraction=0.5))
        assert (kept.max_num_seqs, kept.max_num_batched_tokens, kept.kv_cache_fraction) == (3, 77, 0.5)


def test_the_engine_runs_with_its_devices_defaults_and_logs_them(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="llmserve.engine.llm_engine"):
        engine = make_engine(max_num_seqs=None)
    expected = engine.executor.runner.platform.with_defaults(EngineConfig())
    assert engine.config.max_num_seqs == expected.max_num_seqs
    assert engine.config.max_num_batched_tokens == expected.max_num_batched_tokens
    assert (f"steps of up to {expected.max_num_seqs} sequences and {expected.max_num_batched_tokens} tokens"
            in caplog.text)
