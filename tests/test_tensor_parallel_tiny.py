"""Tensor parallelism on tiny Llama, Qwen2 and Qwen3 checkpoints (float32) and with speculative decoding: two ranks
give what one gives. Each test builds its own two-rank engine and shuts it down (torch allows one process group per
process at a time), so these run apart from test_tensor_parallel.py's shared engine."""

from __future__ import annotations

import os

import pytest

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from tests.helpers import assert_same_generation, generate_with_logits, greedy
from tests.lora_helpers import tiny_base

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoints_on_two_ranks_match_one(tmp_path, kind):
    pytest.importorskip("transformers")
    tiny_base(tmp_path, kind, seed=3)
    prompts = [[5, 17, 33, 2, 61, 40, 8, 90, 12, 3], [7, 7, 100, 250, 31], list(range(40, 80))]
    params = [greedy(12)] * 3
    config = dict(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    ref = generate_with_logits(LLMEngine(EngineConfig(**config), skip_tokenizer=True), prompts, params)
    two = LLMEngine(EngineConfig(**config, tensor_parallel_size=2), skip_tokenizer=True)
    try:
        assert two.executor.info.tensor_parallel_size == 2
        got = generate_with_logits(two, prompts, params)
    finally:
        two.shutdown()
    assert_same_generation(*got, *ref)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "phi3", "gemma2"])
def test_other_architectures_on_two_ranks_match_one(tmp_path, kind):
    """A mixture of experts (each expert split like a dense MLP, the block's sum all-reduced once; Qwen2-MoE's shared
    expert's part in that sum), Phi-3 (fused
    q/k/v and gate/up tensors split into each rank's heads and rows) and Gemma 2 (sliding windows, capped scores)."""
    pytest.importorskip("transformers")
    from tests import test_moe, test_phi3, test_sliding_window

    save, prompts = {"qwen3_moe": (test_moe.save_moe, test_moe.prompts),
                     "qwen2_moe": (test_moe.save_moe, test_moe.prompts),
                     "phi3": (test_phi3.save_phi3, test_phi3.prompts),
                     "gemma2": (test_sliding_window.save, test_sliding_window.prompts)}[kind]
    save(tmp_path, kind if kind != "phi3" else "longrope")
    params = [greedy(8)] * 3
    config = dict(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    ref = generate_with_logits(LLMEngine(EngineConfig(**config), skip_tokenizer=True), prompts(), params)
    two = LLMEngine(EngineConfig(**config, tensor_parallel_size=2), skip_tokenizer=True)
    try:
        got = generate_with_logits(two, prompts(), params)
    finally:
        two.shutdown()
    assert_same_generation(*got, *ref)


def test_speculative_decoding_on_two_ranks(make_engine, engine_f32):
    """Draft rows cross to the other rank with the step; verified output is what one rank decodes without drafts."""
    prompt = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
    engine = make_engine(tensor_parallel_size=2, speculative_method="ngram", num_speculative_tokens=3)
    try:
        (out,), _ = generate_with_logits(engine, [prompt], [greedy(24, logprobs=1)])
        assert engine.speculator.stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()
    (ref,), _ = generate_with_logits(engine_f32, [prompt], [greedy(24, logprobs=1)])
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for lp, ref_lp in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert lp.keys() == ref_lp.keys() and all(abs(lp[t] - ref_lp[t]) < 1e-4 for t in lp)


def test_shared_memory_and_gloo_all_reduces_give_the_same_bits(tmp_path, monkeypatch):
    """Spawned CPU ranks all-reduce through shared memory; with LLMSERVE_TP_SHM=0, or where the segment cannot be
    made (no room), through gloo. The same sums in the same order: equal logits, bit for bit. The segment's name is
    gone once the ranks have mapped it."""
    import glob

    import torch

    from llmserve.distributed import shm_collectives

    pytest.importorskip("transformers")
    tiny_base(tmp_path, "qwen3", seed=4)
    prompts = [[5, 17, 33, 2, 61, 40, 8, 90, 12, 3], list(range(40, 100))]
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
                          tensor_parallel_size=2)
    before = set(glob.glob("/dev/shm/llmserve-tp-*"))
    runs = []
    for transport in ("1", "0", "no room"):
        monkeypatch.setenv("LLMSERVE_TP_SHM", "0" if transport == "0" else "1")
        if transport == "no room":  # the segment cannot be created: the ranks keep gloo
            monkeypatch.setattr(shm_collectives, "segment_path", lambda: str(tmp_path / "missing" / "segment"))
        engine = LLMEngine(config, skip_tokenizer=True)
        try:
            assert set(glob.glob("/dev/shm/llmserve-tp-*")) == before
            runs.append(generate_with_logits(engine, prompts, [greedy(10)] * 2))
        finally:
            engine.shutdown()
    (shm_outs, shm_logits), *others = runs
    for outs, logits in others:
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in shm_outs]
        for a, b in zip(logits, shm_logits):
            assert torch.equal(a, b)


def test_a_model_whose_norms_span_every_head_refuses_two_ranks(tmp_path):
    """OLMo 2's q/k norms average over every head, which the ranks would split: refused in one line, naming the
    field."""
    transformers = pytest.importorskip("transformers")
    from llmserve.errors import UnsupportedModelError
    from tests.helpers import save_randomized

    save_randomized(transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0)), tmp_path)
    with pytest.raises(UnsupportedModelError, match="tensor parallelism is not supported") as err:
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=16,
                               tensor_parallel_size=2), skip_tokenizer=True)
    assert err.value.param == "tensor_parallel_size"
