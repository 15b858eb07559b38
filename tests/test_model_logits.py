"""Our forward (paged KV cache, flattened batches) against Hugging Face transformers on the same weights."""

import json

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from tests.helpers import LogitsRecorder, greedy, randomize_weights, run_to_completion

transformers = pytest.importorskip("transformers")


def assert_logits_match(engine, hf_model, prompts, max_tokens=6, atol=2e-3):
    with LogitsRecorder(engine) as rec:
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", p, greedy(max_tokens, ignore_eos=True))
        outs = run_to_completion(engine)
    for i, p in enumerate(prompts):
        generated = outs[f"p{i}"].outputs[0].token_ids
        full = torch.tensor([p + generated[:-1]])
        with torch.no_grad():
            ref = hf_model(full).logits[0, len(p) - 1 :].float()
        ours = torch.stack(rec.logits[f"p{i}"]).cpu()  # the engine may run on a GPU; the reference runs on CPU
        assert ours.shape == ref.shape
        # the prefill row (last prompt position) and every decode step
        torch.testing.assert_close(ours, ref, atol=atol, rtol=1e-3)
        assert generated == ref.argmax(-1).tolist()


def test_default_model_matches_transformers(engine_f32, hf_gguf_model, hf_gguf_tokenizer):
    prompts = [hf_gguf_tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4,"]]
    assert_logits_match(engine_f32, hf_gguf_model, prompts, max_tokens=8)


_randomize = randomize_weights  # (the name other test modules import)


TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


@pytest.mark.parametrize("kind", ["llama", "llama3_rope_untied", "qwen2", "qwen3", "mistral", "smollm3", "granite",
                                  "olmo2"])
def test_tiny_checkpoints_match_transformers(tmp_path, kind, capsys):
    torch.manual_seed(0)
    if kind.startswith("llama"):
        extra = {}
        if kind == "llama3_rope_untied":
            extra = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}, tie_word_embeddings=False, rope_theta=500000.0)
        else:
            extra = dict(tie_word_embeddings=True)
        cfg = transformers.LlamaConfig(**TINY, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=None))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=True))
    elif kind == "granite":  # Llama with IBM's scales (each far from 1 here, so that each shows)
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **TINY, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5))
    elif kind == "olmo2":  # norms after each block, q/k norms over every head together
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**TINY, pad_token_id=0))
    elif kind == "smollm3":  # its second layer without rotary embeddings (NoPE), and windowed as transformers does
        model = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
            **TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8, pad_token_id=0))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False))
    model = _randomize(model).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8), skip_tokenizer=True)
    if kind == "smollm3":
        assert (engine.model_config.no_rope_layers, engine.model_config.sliding_windows()) == ([1], (8,))
    if kind in ("smollm3", "granite"):  # `llmserve info` says what sets them apart
        from llmserve.cli import main

        assert main(["info", str(tmp_path), "--device", "cpu"]) == 0
        shown = capsys.readouterr().out
        assert ("NoPE" in shown and "on 1 of 2 layers" in shown) if kind == "smollm3" else (
            "embeddings x3, block outputs x0.4, attention scores x0.3, logits / 2.5" in shown)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 23, 70)]
    assert_logits_match(engine, model, prompts, max_tokens=5, atol=1e-4)


# rope scalings as configs spell them in their older form ("type", rope_theta beside), which transformers still reads
OLD_STYLE_ROPE = {
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # Qwen's long-context recipe
    "linear": {"type": "linear", "factor": 2.0},  # Llama 2 era fine-tunes
    "dynamic": {"type": "dynamic", "factor": 2.0},  # the default's rotation within the model's context
}


@pytest.mark.parametrize("kind", list(OLD_STYLE_ROPE))
def test_rope_scalings_match_transformers(tmp_path, kind):
    """YaRN (its ramp between interpolated and kept frequencies, its attention factor; the context then the original
    one times the factor, as vLLM serves it), linear and dynamic NTK, written as older configs and Qwen's docs write
    them; an unknown type is refused in one line."""
    torch.manual_seed(0)
    rope = {k: v for k, v in OLD_STYLE_ROPE[kind].items() if k != "type"}
    model = _randomize(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **TINY, head_dim=32, rope_parameters={"rope_type": kind, "rope_theta": 10000.0, **rope}))).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_theta": 10000.0, "rope_scaling": OLD_STYLE_ROPE[kind]}))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8),
                       skip_tokenizer=True)
    assert engine.model_config.max_position_embeddings == (256 if kind == "yarn" else 512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 23, 70)]
    assert_logits_match(engine, model, prompts, max_tokens=5, atol=1e-4)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "ntk-by-parts", "factor": 2}}))
    from llmserve.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="rope scaling 'ntk-by-parts' is not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64), skip_tokenizer=True)


def test_pickled_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    from llmserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ModelLoadError, match="pickled"):
        LLMEngine(EngineConfig(model=str(tmp_path / "pytorch_model.bin")))


def test_bf16_prepacked_projections_change_nothing(make_cpu_engine, default_files):
    """CPU bf16 keeps projections in oneDNN's packed layout: the same products in another memory layout. Here (2 threads)
    the logits are equal to plain F.linear's bit for bit, but oneDNN may split the sums differently on other CPUs: a
    16-core host differed by up to 0.74 in a logit. So: logits within the bf16 mode's bound, tokens equal up to a
    near-tie (after which the two runs see different contexts)."""
    from tests.test_precision_modes import LOGIT_TOL, TIE_TOL

    from llmserve.platforms.cpu import cpu_has_fast_bf16

    if not cpu_has_fast_bf16():  # oneDNN cannot pack bf16 here: plain F.linear serves, and nothing is dropped
        engine = make_cpu_engine(dtype="bfloat16", cpu_prepack=True, decode_quantization="none")
        assert engine.executor.info.weights.num_packed == 0
        return
    tok = default_files.tokenizer
    prompts = [tok.encode(t) for t in ["The capital of France is", "Write a poem about the sea."]]

    def run(prepack):
        engine = make_cpu_engine(dtype="bfloat16", cpu_prepack=prepack, decode_quantization="none")
        assert (engine.executor.info.weights.num_packed == 4 * 30 + 1) == prepack  # + the LM head
        with LogitsRecorder(engine) as rec:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, greedy(12, ignore_eos=True))
            outs = run_to_completion(engine)
        return outs, rec.logits

    outs_a, logits_a = run(True)
    outs_b, logits_b = run(False)
    for rid in outs_a:
        tokens_a, tokens_b = outs_a[rid].outputs[0].token_ids, outs_b[rid].outputs[0].token_ids
        same = next((j for j, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), len(tokens_a))
        torch.testing.assert_close(torch.stack(logits_a[rid][: same + 1]), torch.stack(logits_b[rid][: same + 1]),
                                   atol=LOGIT_TOL["bf16"], rtol=0)
        if same < len(tokens_a):
            row = logits_b[rid][same]
            assert row[tokens_a[same]] >= row.max() - TIE_TOL, (rid, same)


@pytest.mark.parametrize("lengths", [(9, 9, 9), (1, 1), (12, 3, 12)])
def test_prompts_batched_in_one_step_match_transformers(tmp_path, lengths):
    """Whole prompts that share a step (equal lengths fill the padded batch exactly; 1-token prompts are decode-shaped)."""
    model = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8), skip_tokenizer=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in lengths]
    assert_logits_match(engine, model, prompts, max_tokens=3, atol=1e-4)


def test_float32_is_the_reference_mode(default_files, hf_gguf_model):
    """dtype float32 with every other setting at its default is float32 arithmetic throughout (on a CPU, the file's
    int4 codes against float32 activations: its weights exactly). The first token's logprobs for the issue's prompt
    are transformers' float32 within float32 summation order, and over 4 prompts x 24 greedy tokens every token is
    transformers' argmax on the same context, unless its top two are within 1e-3 nats (a near-tie)."""
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="256MiB"), files=default_files)
    assert engine.executor.info.dtype == "float32"
    encode = default_files.tokenizer.encode
    texts = ["The three primary colors of light are", "The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village,"]
    with LogitsRecorder(engine) as rec:
        for i, text in enumerate(texts):
            engine.add_request(str(i), encode(text), greedy(24, ignore_eos=True))
        outs = run_to_completion(engine)
    for i, text in enumerate(texts):
        ids, tokens = encode(text), outs[str(i)].outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_gguf_model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].double(), -1)
        ours = torch.log_softmax(torch.stack(rec.logits[str(i)]).cpu().double(), -1)
        if i == 0:  # the prompt: its first token's whole distribution
            assert (ours[0] - ref[0]).abs().max() < 1e-3
        for pos, token in enumerate(tokens):
            if token != int(ref[pos].argmax()):
                top2 = ref[pos].topk(2).values
                assert top2[0] - top2[1] <= 1e-3, (text, pos)
