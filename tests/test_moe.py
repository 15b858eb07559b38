"""Mixtures of experts (Mixtral, Qwen3-MoE) against transformers on tiny random-weight checkpoints, and a request's
logits not depending on its batch in the deterministic mode (a batch changes which rows each expert runs on)."""

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from tests.helpers import assert_each_request_as_if_alone, greedy, random_prompts, run_to_completion, save_randomized
from tests.test_model_logits import assert_logits_match

transformers = pytest.importorskip("transformers")

SHAPES = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6)


def save_moe(path, kind: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **SHAPES, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=False))
    else:  # Qwen3-MoE, renormalized or not, its first layer dense
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SHAPES, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=kind == "qwen3_moe", mlp_only_layers=[0]))
    return save_randomized(model, path)


prompts = random_prompts


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalized"])
def test_moe_checkpoints_match_transformers(tmp_path, kind):
    model = save_moe(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8),
                       skip_tokenizer=True)
    assert engine.model_config.num_experts == (6 if kind == "mixtral" else 8)
    assert_logits_match(engine, model, prompts(), max_tokens=5, atol=1e-4)


def test_moe_request_is_batch_invariant_in_deterministic_mode(tmp_path):
    save_moe(tmp_path, "qwen3_moe")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=128, block_size=8,
                                    deterministic=True, device="cpu"), skip_tokenizer=True)
    assert_each_request_as_if_alone(engine, prompts())


def test_experts_take_low_bit_codes_and_the_router_stays_float(tmp_path):
    save_moe(tmp_path, "qwen3_moe")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8,
                                    decode_quantization="int8", device="cpu"), skip_tokenizer=True)
    methods = engine.executor.info.weights.methods
    assert methods["model.layers.1.mlp.experts.7.down_proj"].startswith("int8/")
    assert methods["model.layers.1.mlp.gate"].startswith("float")
    engine.add_request("a", prompts()[1], greedy(4, ignore_eos=True))
    assert len(run_to_completion(engine)["a"].outputs[0].token_ids) == 4
