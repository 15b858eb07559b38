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
    elif kind == "qwen2_moe":  # a shared expert beside the routed ones, behind its own sigmoid gate; QKV bias
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **SHAPES, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0]))
    else:  # Qwen3-MoE, renormalized or not, its first layer dense
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SHAPES, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=kind == "qwen3_moe", mlp_only_layers=[0]))
    return save_randomized(model, path)


prompts = random_prompts


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalized", "qwen2_moe"])
def test_moe_checkpoints_match_transformers(tmp_path, kind):
    model = save_moe(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8),
                       skip_tokenizer=True)
    assert engine.model_config.num_experts == (6 if kind == "mixtral" else 8)
    assert engine.model_config.shared_expert_intermediate_size == (48 if kind == "qwen2_moe" else 0)
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



def test_lora_on_a_moe_model_adapts_attention_and_dense_mlps_and_refuses_experts(tmp_path):
    """An adapter on Qwen3-MoE's attention serves as peft's merged model does; one naming an MLP projection of a layer
    that is a mixture of experts, or the experts themselves (peft's target for gate/up/down on such a model), is
    refused at load in one line naming the field, and the engine goes on."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file

    from llmserve.errors import InvalidRequestError
    from llmserve.lora.request import LoRARequest
    from tests.lora_helpers import make_adapter

    base = save_moe(tmp_path / "base", "qwen3_moe")
    merged = make_adapter(base, tmp_path / "attn", seed=5, targets=["q_proj", "v_proj"])
    make_adapter(base, tmp_path / "experts", seed=6, targets=["q_proj", "gate_proj", "up_proj", "down_proj"])
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "base"), dtype="float32", num_kv_blocks=64, block_size=8,
                                    enable_lora=True, device="cpu"), skip_tokenizer=True)
    prompt = prompts()[1]
    attn = LoRARequest("attn", 1, str(tmp_path / "attn"))
    engine.add_request("a", prompt, greedy(4, ignore_eos=True), lora_request=attn)
    generated = run_to_completion(engine)["a"].outputs[0].token_ids
    with torch.no_grad():
        ref = merged(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
    assert generated == ref.argmax(-1).tolist()

    # the attention adapter with a dense-MLP pair of tensors on layer 1, which is a mixture of experts
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((tmp_path / "attn" / "adapter_config.json").read_text())
    tensors = load_file(tmp_path / "attn" / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"] = torch.zeros(96, 8)
    save_file(tensors, bad / "adapter_model.safetensors")
    for name, folder, message in (("bad", bad, "layer 1's MLP, which is a mixture of experts"),
                                  ("experts", tmp_path / "experts", "LoRA on a mixture of experts' experts")):
        with pytest.raises(InvalidRequestError, match=message) as err:
            engine.add_request(name, prompt, greedy(2), lora_request=LoRARequest(name, 2, str(folder)))
        assert err.value.param == "target_modules"
    engine.add_request("after", prompt, greedy(4, ignore_eos=True), lora_request=attn)
    assert run_to_completion(engine)["after"].outputs[0].token_ids == generated
