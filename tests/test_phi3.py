"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM) against transformers on tiny random-weight checkpoints: q/k/v and gate/up
stored fused, LongRoPE (its short factors and attention factor, the context capped at the original length), partial
rotary (Phi-4-mini) and a sliding window (Phi-3-mini-4k)."""

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import LLMServeError
from tests.helpers import random_prompts, save_randomized
from tests.test_model_logits import assert_logits_match

transformers = pytest.importorskip("transformers")

SHAPES = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = dict(original_max_position_embeddings=128, partial_rotary_factor=0.75, sliding_window=16,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0] * 6})


def save_phi3(path, kind: str = "longrope"):
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPES, **(LONGROPE if kind == "longrope" else {})))
    return save_randomized(model, path)


prompts = random_prompts


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("kind", ["plain", "longrope"])
def test_phi3_checkpoints_match_transformers(tmp_path, kind, backend):
    model = save_phi3(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8, device="cpu",
                                    attention_backend=backend), skip_tokenizer=True)
    if kind == "longrope":
        c = engine.model_config
        assert (c.rotary_dim, c.max_position_embeddings, c.sliding_window) == (12, 128, 16)
    assert_logits_match(engine, model, prompts(), max_tokens=8, atol=1e-4)


def test_longrope_context_is_capped_at_the_original_length(tmp_path):
    """Past original_max_position_embeddings transformers rotates every position with the long factors; llmserve
    serves the contexts the short ones cover and says so at the door."""
    save_phi3(tmp_path, "longrope")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8, device="cpu"),
                       skip_tokenizer=True)
    with pytest.raises(LLMServeError, match="maximum context length is 128 tokens"):
        engine.add_request("long", list(range(3, 140)), None)
