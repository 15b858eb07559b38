"""GGUF files beyond the default model's: SentencePiece vocabularies (llama.cpp's tokenizer model "llama": Llama 2,
Mistral, Gemma), Gemma 3, and every quantization type llama.cpp writes, on files written here the way llama.cpp's
converter writes them (tests/gguf_helpers.py) from tiny transformers models, against transformers and SentencePiece."""

import gguf
import numpy as np
import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.loader import load_model_files
from llmserve.loader.gguf import SUPPORTED_QUANTS, unpermute_rotary
from tests.gguf_helpers import USER_SYMBOLS, train_sentencepiece, write_gguf, write_quantized_gguf
from tests.helpers import greedy, random_prompts, run_to_completion
from tests.test_model_logits import _randomize, assert_logits_match

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

TEXTS = ["Hello world", " leading space", "two  spaces   three", "new\nline\n\n tab\tend ", "naïve café 中文 🙂",
         "digits 12345 and 3.14", "", " ", "llmserve serves models from GGUF files."]


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    return {prefix: train_sentencepiece(folder, prefix) for prefix in (True, False)}


def tiny_llama(vocab: int, hidden: int = 64, intermediate: int = 96):
    torch.manual_seed(0)
    return _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False))).eval()


@pytest.mark.parametrize("space_prefix", [True, False], ids=["llama-mistral", "gemma"])
def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path, vocabularies, space_prefix):
    """Llama 2 and Mistral add a space before the text (add_space_prefix), Gemma does not. Between special tokens
    each piece of text is tokenized on its own, with the space prefix where the model adds one (llama.cpp's rule)."""
    sp = vocabularies[space_prefix]
    model = tiny_llama(sp.get_piece_size())
    files = load_model_files(write_gguf(tmp_path / "m.gguf", model, sp, add_space_prefix=space_prefix))
    tok = files.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(ids[1:]) == sp.decode(ids[1:]), text
    start, end = (sp.piece_to_id(s) for s in USER_SYMBOLS)
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>") == \
        [sp.bos_id(), start] + sp.encode("user\nhi") + [end]
    # a model served with it: the prompt's text in, text out (byte pieces joined into characters)
    engine = LLMEngine(EngineConfig(model=files.path, dtype="float32", num_kv_blocks=32, block_size=8, device="cpu"))
    engine.add_request("a", "naïve café 中文", greedy(6, ignore_eos=True))
    out = run_to_completion(engine)["a"]
    assert out.prompt_token_ids == [sp.bos_id()] + sp.encode("naïve café 中文")
    # (a trailing byte that starts a character is held back: decode shows it as U+FFFD)
    assert tok.decode(out.outputs[0].token_ids).removesuffix("\ufffd") == out.outputs[0].text


def tiny_gemma3(vocab: int):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, max_position_embeddings=512,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    model = _randomize(transformers.Gemma3ForCausalLM(cfg)).eval()
    # llama.cpp's fixed pattern (every sixth layer full), which GGUF does not record
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    return model


def linear_rope_scaling(writer):
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(8.0)


def test_gemma3_gguf_matches_transformers(tmp_path, vocabularies):
    sp = vocabularies[False]
    model = tiny_gemma3(sp.get_piece_size())
    path = write_gguf(tmp_path / "gemma3.gguf", model, sp, add_space_prefix=False, extra=linear_rope_scaling)
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=8, device="cpu"))
    c = engine.model_config
    assert (c.architecture, c.sliding_window, c.rope_scaling) == ("gemma3", 8, {"rope_type": "linear", "factor": 8.0})
    assert sp.piece_to_id("<end_of_turn>") in c.eos_token_ids
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, sp.get_piece_size(), (n,), generator=g).tolist() for n in (5, 23, 70)]
    assert_logits_match(engine, model, prompts, max_tokens=8, atol=1e-4)
    # Q8_0 linear layers: transformers on the weights the codes stand for
    q8 = write_quantized_gguf(tmp_path / "gemma3-q8.gguf", model, sp, gguf.GGMLQuantizationType.Q8_0,
                              add_space_prefix=False, extra=linear_rope_scaling)
    engine = LLMEngine(EngineConfig(model=q8, dtype="float32", num_kv_blocks=64, block_size=8, device="cpu"))
    assert_logits_match(engine, model, prompts, max_tokens=4, atol=1e-4)


def tiny_gemma(arch: str, vocab: int):
    """Gemma 1, or Gemma 2 with its score cap (small enough to matter on these weights) and llama.cpp's fixed
    alternation of windowed and full layers."""
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    if arch == "gemma":
        return _randomize(transformers.GemmaForCausalLM(transformers.GemmaConfig(**shape, hidden_act="gelu"))).eval()
    cfg = transformers.Gemma2Config(**shape, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=1.0,
                                    final_logit_softcapping=3.0)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    return _randomize(transformers.Gemma2ForCausalLM(cfg)).eval()


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_gemma_and_gemma2_gguf_match_transformers(tmp_path, vocabularies, arch):
    sp = vocabularies[False]
    model = tiny_gemma(arch, sp.get_piece_size())
    path = write_gguf(tmp_path / f"{arch}.gguf", model, sp, add_space_prefix=False)
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=8, device="cpu"))
    c = engine.model_config
    assert c.architecture == arch
    if arch == "gemma2":
        assert (c.sliding_windows(), c.attn_logit_softcapping, c.final_logit_softcapping) == ((8,), 1.0, 3.0)
    assert sp.piece_to_id("<end_of_turn>") in c.eos_token_ids
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=6, atol=1e-4)


def auto_engine(path: str) -> LLMEngine:
    """A float32 engine under --decode-quantization auto (the file's 4-bit layers in the int4 kernel)."""
    return LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=8, device="cpu",
                                  decode_quantization="auto", deterministic=False))


@pytest.mark.parametrize("kind", ["plain", "longrope"])
def test_phi3_gguf_matches_transformers(tmp_path, vocabularies, kind):
    """Phi-3's file: q/k/v and gate/up fused (split by the model as for its Hugging Face tensors), the rotary
    dimensions per head (partial rotary), the window, and LongRoPE's factors as tensors."""
    from tests.test_phi3 import LONGROPE, SHAPES

    sp = vocabularies[True]
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(**{**SHAPES, "vocab_size": sp.get_piece_size()},
                                  **(LONGROPE if kind == "longrope" else {}))
    model = _randomize(transformers.Phi3ForCausalLM(cfg)).eval()
    engine = LLMEngine(EngineConfig(model=write_gguf(tmp_path / "phi3.gguf", model, sp), dtype="float32",
                                    num_kv_blocks=64, block_size=8, device="cpu"))
    c = engine.model_config
    if kind == "longrope":
        assert (c.rotary_dim, c.max_position_embeddings, c.sliding_window) == (12, 128, 16)
        assert c.rope_scaling["short_factor"] == pytest.approx(LONGROPE["rope_parameters"]["short_factor"])
    else:
        assert (c.rotary_dim, c.sliding_window, c.rope_scaling) == (16, None, None)
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size(), lengths=(5, 23, 60)), max_tokens=6,
                        atol=1e-4)


def test_phi3_q4_0_gguf_keeps_its_fused_codes_under_auto(tmp_path, vocabularies):
    """Q4_0 fused q/k/v and gate/up tensors: auto holds their codes in the int4 kernel (each part's grid split from
    the fused one), within the kernel's float16 scales of transformers on the weights the codes stand for. (Written by
    the gguf package as llama.cpp writes Q4_0: a block's scale is negative where its largest magnitude is.)"""
    from tests.test_phi3 import SHAPES

    sp = vocabularies[True]
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(**{**SHAPES, "vocab_size": sp.get_piece_size()})
    model = _randomize(transformers.Phi3ForCausalLM(cfg)).eval()
    path = write_quantized_gguf(tmp_path / "phi3-q4_0.gguf", model, sp, gguf.GGMLQuantizationType.Q4_0)
    engine = auto_engine(path)
    methods = engine.executor.info.weights.methods
    assert methods["model.layers.0.self_attn.qkv_proj"].startswith("int4")
    assert methods["model.layers.0.mlp.gate_up_proj"].startswith("int4")
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size(), lengths=(5, 23)), max_tokens=4,
                        atol=2e-2)


def test_yarn_gguf_matches_transformers(tmp_path, vocabularies):
    """A Qwen3 file with llama.cpp's YaRN keys (type, factor, original context): its context the original one times
    the factor, its logits transformers'."""
    sp = vocabularies[True]
    torch.manual_seed(0)
    model = _randomize(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}))).eval()
    engine = LLMEngine(EngineConfig(model=write_gguf(tmp_path / "yarn.gguf", model, sp), dtype="float32",
                                    num_kv_blocks=64, block_size=8, device="cpu"))
    assert (engine.model_config.rope_scaling["rope_type"], engine.model_config.max_position_embeddings) == ("yarn", 256)
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=5, atol=1e-4)


@pytest.mark.parametrize("kind", ["olmo2", "olmo3"])
def test_olmo_gguf_matches_transformers(tmp_path, vocabularies, kind):
    """llama.cpp's olmo2 files (OLMo 2 and 3): post-block norms, q/k norms over every head, no Q/K interleaving; OLMo
    3's windowed layers from the file's sliding_window_pattern."""
    sp = vocabularies[True]
    torch.manual_seed(0)
    shape = dict(vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
    if kind == "olmo2":
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**shape))
    else:
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **shape, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    model = _randomize(model).eval()
    engine = LLMEngine(EngineConfig(model=write_gguf(tmp_path / f"{kind}.gguf", model, sp), dtype="float32",
                                    num_kv_blocks=64, block_size=8, device="cpu"))
    assert engine.model_config.sliding_windows() == (() if kind == "olmo2" else (8,))
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=5, atol=1e-4)


def test_granite_gguf_matches_transformers(tmp_path, vocabularies):
    """llama.cpp's granite files: Llama's tensors with the four scales in the metadata."""
    sp = vocabularies[True]
    torch.manual_seed(0)
    model = _randomize(transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, embedding_multiplier=3.0, residual_multiplier=0.4,
        attention_multiplier=0.3, logits_scaling=2.5))).eval()
    engine = LLMEngine(EngineConfig(model=write_gguf(tmp_path / "granite.gguf", model, sp), dtype="float32",
                                    num_kv_blocks=64, block_size=8, device="cpu"))
    c = engine.model_config
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == pytest.approx((3.0, 0.4, 2.5))
    assert c.attention_scale == pytest.approx(0.3)
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=6, atol=1e-4)


def test_smollm3_gguf_matches_transformers(tmp_path, vocabularies):
    """llama.cpp's smollm3 files: Llama's tensors (Q/K rows interleaved), every fourth layer without rotary embeddings
    (fixed in llama.cpp, not in the file)."""
    sp = vocabularies[True]
    torch.manual_seed(0)
    cfg = transformers.SmolLM3Config(vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert cfg.no_rope_layers == [1, 1, 1, 0]
    model = _randomize(transformers.SmolLM3ForCausalLM(cfg)).eval()
    engine = LLMEngine(EngineConfig(model=write_gguf(tmp_path / "smollm3.gguf", model, sp), dtype="float32",
                                    num_kv_blocks=64, block_size=8, device="cpu"))
    assert (engine.model_config.architecture, engine.model_config.no_rope_layers) == ("smollm3", [3])
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=6, atol=1e-4)


def tiny_moe(kind: str, vocab: int):
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, intermediate_size=64, num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=False))
    elif kind == "qwen2moe":  # a shared expert; the picked weights not renormalized
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **shape, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=True))
    return _randomize(model).eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe", "qwen2moe"])
def test_moe_gguf_matches_transformers(tmp_path, vocabularies, kind):
    """llama.cpp's mixtures of experts: Mixtral as a llama file with a 2-D tensor per expert (older files), Qwen3-MoE
    with each layer's experts in 3-D ffn_*_exps tensors; the router (ffn_gate_inp) float."""
    sp = vocabularies[True]
    model = tiny_moe(kind, sp.get_piece_size())
    engine = LLMEngine(EngineConfig(model=write_gguf(tmp_path / f"{kind}.gguf", model, sp), dtype="float32",
                                    num_kv_blocks=64, block_size=8, device="cpu"))
    c = engine.model_config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == {
        "mixtral": (6, 2, 64, 0), "qwen3moe": (8, 3, 32, 0), "qwen2moe": (8, 2, 32, 48)}[kind]
    assert c.norm_topk_prob == (kind != "qwen2moe")
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=5, atol=1e-4)


def test_moe_gguf_experts_keep_their_q4_0_codes_under_auto(tmp_path, vocabularies):
    """Each expert's slice of a Q4_0 3-D tensor hands its grid to the int4 kernel; the router stays float."""
    sp = vocabularies[True]
    model = tiny_moe("qwen3moe", sp.get_piece_size())
    path = write_quantized_gguf(tmp_path / "q4.gguf", model, sp, gguf.GGMLQuantizationType.Q4_0)
    engine = auto_engine(path)
    methods = engine.executor.info.weights.methods
    assert methods["model.layers.1.mlp.experts.7.down_proj"].startswith("int4")
    assert methods["model.layers.1.mlp.experts.0.gate_up_proj"].startswith("int4")
    assert methods["model.layers.1.mlp.gate"].startswith("float")
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size(), lengths=(5, 23)), max_tokens=4,
                        atol=2e-2)


def test_a_files_sliding_window_pattern_sets_the_windowed_layers(tmp_path, vocabularies):
    """Newer files list each layer's kind (sliding_window_pattern, True where windowed): it overrides llama.cpp's
    fixed alternation."""
    sp = vocabularies[False]
    torch.manual_seed(0)
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    model = _randomize(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        query_pre_attn_scalar=16, sliding_window=8, layer_types=types))).eval()
    path = write_gguf(tmp_path / "pattern.gguf", model, sp, add_space_prefix=False,
                      extra=lambda w: w.add_sliding_window_pattern([t == "sliding_attention" for t in types]))
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=64, block_size=8, device="cpu"))
    assert engine.model_config.layer_types == types
    assert_logits_match(engine, model, random_prompts(sp.get_piece_size()), max_tokens=5, atol=1e-4)


# the types llama.cpp quantizes weights to, each written as random codes (finite scales)
QUANTS = sorted((q for q in SUPPORTED_QUANTS if q not in (gguf.GGMLQuantizationType.F32,)), key=lambda q: q.name)


def random_codes(rows: int, cols: int, qtype, rng) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    # bytes below 0x40: every float16 and bfloat16 scale among them is finite and under 2
    return rng.integers(0, 0x40, size=(rows, cols // block * size), dtype=np.uint8)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_torch_decoding_gives_the_gguf_packages_floats_bit_for_bit(qtype):
    """The loader decodes these formats in torch (loader/gguf_blocks.py); on any bytes (subnormal, infinite and NaN
    scales too) each weight is the package's dequantize, bit for bit, and other types are left to the package."""
    from llmserve.loader.gguf_blocks import decode

    qtype = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(5)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    for shape in ((3, 512 // block * size), (2, 64, 256 // block * size)):  # a layer's rows; one expert's of three
        raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
        for data in ([raw[1]] if raw.ndim == 3 else [raw]):
            with np.errstate(all="ignore"):
                expected = gguf.quants.dequantize(data, qtype)
            ours = decode(data, qtype).numpy()
            assert ours.shape == expected.shape and ours.dtype == np.float32
            finite = np.isfinite(expected)
            assert np.array_equal(np.isnan(ours), np.isnan(expected)) and np.array_equal(ours[~finite & ~np.isnan(
                expected)], expected[~finite & ~np.isnan(expected)])
            assert np.array_equal(ours[finite].view(np.uint32), expected[finite].view(np.uint32))  # (-0.0 too)
    assert decode(rng.integers(0, 64, size=(2, 22), dtype=np.uint8), gguf.GGMLQuantizationType.Q5_0) is None


def test_every_llama_cpp_quantization_type_loads_as_the_gguf_package_dequantizes_it(tmp_path):
    """Each type's codes become the float weights the gguf package (llama.cpp's reference in Python) decodes, and a
    model of them serves."""
    model = tiny_llama(320, hidden=256, intermediate=256)
    rng = np.random.default_rng(0)
    for qtype in QUANTS:
        path = tmp_path / f"{qtype.name}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        cfg = model.config
        for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 128),
                           (writer.add_embedding_length, 256), (writer.add_feed_forward_length, 256),
                           (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                           (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps), (writer.add_vocab_size, 320)):
            add(value)
        codes = {}
        writer.add_tensor("token_embd.weight", rng.standard_normal((320, 256)).astype(np.float32) * 0.1)
        writer.add_tensor("output.weight", rng.standard_normal((320, 256)).astype(np.float32) * 0.1)
        for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
            writer.add_tensor(f"{name}.weight", np.ones(256, dtype=np.float32))
        for name, rows in (("attn_q", 256), ("attn_k", 128), ("attn_v", 128), ("attn_output", 256),
                           ("ffn_gate", 256), ("ffn_up", 256), ("ffn_down", 256)):
            codes[name] = random_codes(rows, 256, qtype, rng)
            writer.add_tensor(f"blk.0.{name}.weight", codes[name], raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files = load_model_files(str(path), load_tokenizer=False)
        weights = dict(files.weights())
        q = gguf.quants.dequantize(codes["attn_q"], qtype).astype(np.float32)
        assert np.array_equal(weights["model.layers.0.self_attn.q_proj.weight"].numpy(), unpermute_rotary(q, 4)), qtype
        down = gguf.quants.dequantize(codes["ffn_down"], qtype).astype(np.float32)
        assert np.array_equal(weights["model.layers.0.mlp.down_proj.weight"].numpy(), down), qtype
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, block_size=8, device="cpu"),
                       skip_tokenizer=True)
    engine.add_request("a", [1, 2, 3], greedy(3, ignore_eos=True))
    assert len(run_to_completion(engine)["a"].outputs[0].token_ids) == 3


def write_mixed_gguf(path, types: dict[str, "gguf.GGMLQuantizationType"], rng, codes=None) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF (hidden 256) whose linear layers have the given types (random codes; F16/F32 layers
    random floats), as a Q4_K_M file mixes Q4_K, Q6_K and others. Returns each layer's dequantized weight.
    codes(rows, cols, qtype, rng): a layer's raw blocks, instead of random bytes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 128), (writer.add_embedding_length, 256),
                       (writer.add_feed_forward_length, 256), (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_vocab_size, 320)):
        add(value)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(
        rng.standard_normal((320, 256)).astype(np.float32) * 0.1, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(256, dtype=np.float32))
    weights = {}
    for name, rows in (("attn_q", 256), ("attn_k", 128), ("attn_v", 128), ("attn_output", 256), ("ffn_gate", 256),
                       ("ffn_up", 256), ("ffn_down", 256)):
        qtype = types.get(name, gguf.GGMLQuantizationType.Q4_K)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w = (rng.standard_normal((rows, 256)) * 0.05).astype(np.float32 if qtype.name == "F32" else np.float16)
            writer.add_tensor(f"blk.0.{name}.weight", w)
            weights[name] = w.astype(np.float32)
        else:
            raw = (codes or (lambda *a: random_codes(*a) // 8))(rows, 256, qtype, rng)  # // 8: smaller scales
            writer.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=qtype)
            weights[name] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def file_nibbles(raw: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 or Q4_1 tensor's codes [rows, cols], d and m per 32 columns (Q4_0: m = -8 d), read from its bytes as
    llama.cpp lays them out: d (and m) as float16, then 16 bytes holding code j in the low nibble of byte j and code
    j + 16 in its high nibble."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if size == 20 else -8 * d
    packed = blocks[:, size - 16:]
    codes = np.concatenate([packed & 15, packed >> 4], axis=1)
    rows = raw.shape[0]
    return codes.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1)


def q4_1_off_the_extremes(rows, cols, qtype, rng) -> np.ndarray:
    """Q4_1 blocks whose codes stay within 2..13 (as llama.cpp's importance-matrix quantization may leave a block:
    it searches for the grid that fits its weighted values best, not the one spanning their min and max)."""
    n = rows * cols // 32
    d = rng.uniform(0.002, 0.006, n).astype(np.float16)
    m = (-8 * d.astype(np.float32) + rng.uniform(-0.002, 0.002, n)).astype(np.float16)
    codes = rng.integers(2, 14, (n, 32), dtype=np.uint8)
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), m.view(np.uint8).reshape(n, 2), packed], 1).reshape(rows, -1)


def test_4_bit_layers_bring_their_own_codes(tmp_path):
    """Q4_0, Q4_1 and Q4_K tensors come with the file's own codes and the grid they sit on (Q4_1's d and m, Q4_0's d
    and -8 d: exact in the int4 kernel's float16), unpermuted as the weight is (llama's q/k rows); the weight is
    what they stand for, the one the gguf package decodes (test_every_llama_cpp_quantization_type_loads_as...)."""
    Q = gguf.GGMLQuantizationType
    path = tmp_path / "m.gguf"
    expected = write_mixed_gguf(path, {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "ffn_up": Q.Q4_0,
                                       "ffn_down": Q.Q4_K, "ffn_gate": Q.Q6_K}, np.random.default_rng(3))
    reader = gguf.GGUFReader(str(path))
    raw = {t.name.split(".")[2]: (t.data, t.tensor_type) for t in reader.tensors if t.name.startswith("blk.0.attn")
           or t.name.startswith("blk.0.ffn")}
    loaded = dict(load_model_files(str(path), load_tokenizer=False).weights())
    for layer, gguf_name, heads in (("self_attn.q_proj", "attn_q", 4), ("self_attn.k_proj", "attn_k", 2),
                                    ("self_attn.v_proj", "attn_v", 0), ("mlp.up_proj", "ffn_up", 0)):
        prefix = f"model.layers.0.{layer}"
        codes, d, m = (unpermute_rotary(x, heads) if heads else x for x in file_nibbles(*raw[gguf_name]))
        assert loaded[f"{prefix}.weight_int4_codes"].dtype == torch.uint8
        assert np.array_equal(loaded[f"{prefix}.weight_int4_codes"].numpy(), codes), layer
        scale, offset = loaded[f"{prefix}.weight_int4_scale"], loaded[f"{prefix}.weight_int4_offset"]
        assert np.array_equal(scale.numpy(), d) and np.array_equal(offset.numpy(), m), layer
        assert torch.equal(scale.half().float(), scale) and torch.equal(offset.half().float(), offset), layer
        assert np.array_equal(loaded[f"{prefix}.weight"].numpy(),
                              unpermute_rotary(expected[gguf_name], heads) if heads else expected[gguf_name])
        w = loaded[f"{prefix}.weight"].view(-1, 32)
        if raw[gguf_name][1] == Q.Q4_1:
            assert torch.equal(w, torch.from_numpy(codes).view(-1, 32).float() * scale.view(-1, 1)
                               + offset.view(-1, 1)), layer
    down = "model.layers.0.mlp.down_proj"  # Q4_K: its grid is d * sc and -dmin * m, not exact in float16
    codes, scale, offset = (loaded[f"{down}.weight_int4_{p}"] for p in ("codes", "scale", "offset"))
    assert torch.equal(loaded[f"{down}.weight"].view(-1, 32), codes.view(-1, 32).float() * scale.view(-1, 1)
                       + offset.view(-1, 1))
    assert "model.layers.0.mlp.gate_proj.weight_int4_scale" not in loaded  # Q6_K: no 4-bit grid


def test_q4_1_blocks_off_the_extremes_keep_their_own_weights(tmp_path):
    """A Q4_1 file whose blocks do not reach codes 0 and 15 (importance-matrix quantization) is multiplied by its own
    codes and grid: the int4 engine's logits are the float32 engine's on the same weights but for the order of
    sums. (Found from the float weights, a block's min and max would give it another grid and rounded codes.)"""
    from llmserve import kernels
    from tests.helpers import LogitsRecorder

    if kernels.build_error() or not kernels.lowbit_linear_isa():
        pytest.skip(f"no low-bit kernel here ({kernels.build_error() or 'no route on this CPU'})")
    Q = gguf.GGMLQuantizationType
    path = tmp_path / "m.gguf"
    write_mixed_gguf(path, {name: Q.Q4_1 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                      "ffn_up", "ffn_down")},
                     np.random.default_rng(4), codes=q4_1_off_the_extremes)

    def logits(mode):
        e = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, block_size=8, device="cpu",
                                   decode_quantization=mode, deterministic=False), skip_tokenizer=True)
        with LogitsRecorder(e) as rec:
            e.add_request("a", list(range(1, 40)), greedy(4, ignore_eos=True))
            run_to_completion(e)
        return e.executor.info.weights, torch.stack(rec.logits["a"])

    info, int4 = logits("auto")
    assert info.decode_quantization == "int4" and info.methods["model.layers.0.mlp.down_proj"].startswith("int4")
    _, reference = logits("none")
    assert (int4 - reference).abs().max() < 1e-4 * reference.abs().max()


def test_auto_keeps_each_gguf_layer_at_its_own_precision(tmp_path):
    """A Q4_K_M-like file: --decode-quantization auto gives its 4-bit layers int4 codes (the file's), its 6-bit
    layers (and a merged layer with one) int8, its float layers float; the logits stay within the kernel's float16
    scales of the float32 weights the file stands for."""
    Q = gguf.GGMLQuantizationType
    write_mixed_gguf(tmp_path / "m.gguf", {"attn_q": Q.Q4_0, "attn_v": Q.Q6_K, "attn_output": Q.F16,
                                           "ffn_down": Q.Q5_K}, np.random.default_rng(2))

    def run(mode):
        e = LLMEngine(EngineConfig(model=str(tmp_path / "m.gguf"), dtype="float32", num_kv_blocks=16, block_size=8,
                                   device="cpu", decode_quantization=mode, deterministic=False), skip_tokenizer=True)
        from tests.helpers import LogitsRecorder

        with LogitsRecorder(e) as rec:
            e.add_request("a", list(range(1, 40)), greedy(4, ignore_eos=True))
            run_to_completion(e)
        return e.executor.info.weights, torch.stack(rec.logits["a"])

    info, logits = run("auto")
    methods = info.methods
    assert methods["model.layers.0.self_attn.qkv_proj"].startswith("int8")  # q Q4_0, k Q4_K, v Q6_K
    assert methods["model.layers.0.mlp.gate_up_proj"].startswith("int4")  # Q4_K
    assert methods["model.layers.0.mlp.down_proj"].startswith("int8")  # Q5_K
    assert methods["model.layers.0.self_attn.o_proj"].startswith("float")  # F16
    assert methods["lm_head"].startswith("int8")  # the tied Q8_0 embedding
    assert info.decode_quantization == "int4+int8"
    _, reference = run("none")
    assert (logits - reference).abs().max() < 2e-2


@pytest.mark.parametrize("file", ["default", "big-endian"])
def test_the_loaders_reader_reads_what_the_gguf_package_reads(tmp_path, default_gguf, file):
    """The loader parses metadata through a plain view of the memory map and reads
    arrays whole (PlainViewReader: 18x faster on the default model's vocabulary); every field and tensor is the
    package's own reader's, in either byte order."""
    from llmserve.loader.gguf import PlainViewReader

    path = default_gguf
    if file == "big-endian":
        path = str(tmp_path / "big.gguf")
        writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
        writer.add_token_list(["<s>", "a", "héllo", ""])
        writer.add_array("test.numbers", [1, 2, 300000])
        writer.add_array("test.nothing", [])
        writer.add_uint32("llama.block_count", 2)
        writer.add_float32("test.float", 0.25)
        writer.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4).byteswap(), raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    ours, theirs = PlainViewReader(path), gguf.GGUFReader(path)
    assert ours.byte_order == theirs.byte_order == ("S" if file == "big-endian" else "I")
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.types == field.types, name
        assert str(mine.contents()) == str(field.contents()), name
        if field.types[0] != gguf.GGUFValueType.ARRAY or field.types[-1] == gguf.GGUFValueType.STRING:
            # scalars and strings as the package holds them (a number array is one part here, not one per item)
            assert mine.data == field.data, name
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) and a.tensor_type == b.tensor_type
               for a, b in zip(ours.tensors, theirs.tensors))
