"""Embedding engines (--runner pooling): pooled hidden states against transformers on the same weights, the pooling
types, Matryoshka dimensions, chunking, batching and preemption, and the errors."""

import json

import pytest
import torch
import torch.nn.functional as F

from llmserve import LLM, PoolingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError
from llmserve.outputs import PoolingRequestOutput
from tests.helpers import run_to_completion

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def embed(engine: LLMEngine, prompts, params=None) -> list[torch.Tensor]:
    ids = [engine.add_request(None, p, params or PoolingParams()) for p in prompts]
    outs = run_to_completion(engine)
    assert all(isinstance(outs[i], PoolingRequestOutput) for i in ids)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing held once they are done
    return [outs[i].outputs.data for i in ids]


def reference(model, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0)}[pooling]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def save_bare_decoder(path, pooling: str | None = None, normalize: bool = True, **config) -> torch.nn.Module:
    """A random-weight Qwen3Model (the bare decoder, as embedding models are saved: no LM head), with a
    sentence-transformers pooling config if `pooling` is given."""
    torch.manual_seed(0)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**TINY, head_dim=32, **config))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15 + (1.0 if p.ndim == 1 else 0.0))
    model.eval().save_pretrained(path, safe_serialization=True)
    if pooling is not None:
        flags = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, flags[pooling]: True}))
    return model


def tiny_engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **{"num_kv_blocks": 64, "block_size": 8, **kw}),
                     skip_tokenizer=True)


def prompts_of(*lengths, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def test_default_model_embeddings_match_transformers(make_engine, hf_gguf_model, hf_gguf_tokenizer):
    """A generative model under --runner pooling: its last token's final hidden state, normalized (vLLM's embed)."""
    engine = make_engine(runner="pooling")
    assert engine.runner == "pooling"
    prompts = [hf_gguf_tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):", "1, 2, 3"]]
    ours = embed(engine, prompts)
    for prompt, vector in zip(prompts, ours):
        ref = reference(hf_gguf_model.model, prompt, "LAST")
        assert vector.shape == (576,)
        torch.testing.assert_close(vector, ref, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS", "LAST"])
def test_bare_decoder_pools_as_its_sentence_transformers_config_says(tmp_path, pooling):
    """A checkpoint without an LM head runs as an embedding model by default, pooled as its modules.json says;
    prompts longer than a step's budget are computed in chunks, batched with the others."""
    model = save_bare_decoder(tmp_path, pooling, normalize=pooling != "CLS")
    engine = tiny_engine(tmp_path, max_num_batched_tokens=32)
    assert engine.runner == "pooling"
    prompts = prompts_of(5, 23, 70)
    for prompt, vector in zip(prompts, embed(engine, prompts)):
        torch.testing.assert_close(vector, reference(model, prompt, pooling, normalize=pooling != "CLS"),
                                   atol=1e-4, rtol=1e-4)


def test_pooler_config_overrides_the_model_and_per_request_normalize(tmp_path):
    model = save_bare_decoder(tmp_path, "LAST")
    engine = tiny_engine(tmp_path, pooler_config={"pooling_type": "mean", "normalize": False})
    prompt = prompts_of(17)[0]
    plain, = embed(engine, [prompt])
    torch.testing.assert_close(plain, reference(model, prompt, "MEAN", normalize=False), atol=1e-4, rtol=1e-4)
    normalized, = embed(engine, [prompt], PoolingParams(normalize=True))
    torch.testing.assert_close(normalized, F.normalize(plain, dim=-1), atol=1e-6, rtol=1e-5)


def test_chunking_batching_and_preemption_do_not_change_embeddings(tmp_path):
    """Mean pooling reads every token: a prompt computed whole, or in chunks beside others and recomputed after
    preemption, pools the same rows. In the deterministic mode the bits are the same."""
    save_bare_decoder(tmp_path, "MEAN")
    prompts = prompts_of(60, 45, 52, seed=3)
    alone = [embed(tiny_engine(tmp_path, max_num_batched_tokens=512), [p])[0] for p in prompts]
    # 12 blocks of 8 tokens cannot hold the three prompts at once: some are preempted and recomputed
    tight = tiny_engine(tmp_path, max_num_batched_tokens=24, long_prefill_token_threshold=8, num_kv_blocks=12)
    together = embed(tight, prompts)
    assert tight.stats().num_preemptions > 0
    for a, b in zip(alone, together):
        if tight.executor.info.deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_last_pooling_keeps_prefix_caching_mean_turns_it_off(tmp_path):
    save_bare_decoder(tmp_path, "LAST")
    prompt = prompts_of(40)[0]
    for pooling, cached in (("LAST", True), ("MEAN", False)):
        engine = tiny_engine(tmp_path, pooler_config={"pooling_type": pooling})
        first = embed(engine, [prompt])[0]
        engine.add_request("again", prompt, PoolingParams())
        out = run_to_completion(engine)["again"]
        assert (out.num_cached_tokens > 0) is cached
        assert torch.equal(out.outputs.data, first) or torch.allclose(out.outputs.data, first, atol=1e-5)


def test_matryoshka_dimensions(tmp_path):
    model = save_bare_decoder(tmp_path, "MEAN", matryoshka_dimensions=[16, 32])
    engine = tiny_engine(tmp_path)
    prompt = prompts_of(12)[0]
    short, = embed(engine, [prompt], PoolingParams(dimensions=16))
    full = reference(model, prompt, "MEAN", normalize=False)
    torch.testing.assert_close(short, F.normalize(full[:16], dim=-1), atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match=r"only supports \[16, 32\] matryoshka dimensions"):
        engine.add_request(None, prompt, PoolingParams(dimensions=8))
    with pytest.raises(InvalidRequestError, match="positive integer"):
        PoolingParams(dimensions=0)


def test_embedding_errors(tmp_path, engine_f32):
    save_bare_decoder(tmp_path)
    engine = tiny_engine(tmp_path)
    with pytest.raises(InvalidRequestError, match="does not support matryoshka"):
        engine.add_request(None, [1, 2], PoolingParams(dimensions=8))
    with pytest.raises(InvalidRequestError, match="maximum context length is 512 tokens.*513 tokens"):
        engine.add_request(None, [1] * 513, PoolingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(None, [], PoolingParams())
    with pytest.raises(InvalidRequestError, match="generates no text"):
        engine.add_request(None, [1, 2, 3])  # sampling params on an embedding engine
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        engine_f32.add_request(None, [1, 2, 3], PoolingParams())  # and the other way round
    assert not engine.has_unfinished_requests() and not engine_f32.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="no LM head"):
        tiny_engine(tmp_path, runner="generate")
    with pytest.raises(InvalidRequestError, match="pooling_type must be one of LAST, MEAN, CLS"):
        EngineConfig(runner="pooling", pooler_config={"pooling_type": "STEP"})
    with pytest.raises(InvalidRequestError, match="unknown keys softmax"):
        EngineConfig(runner="pooling", pooler_config={"softmax": True})
    with pytest.raises(InvalidRequestError, match="speculative decoding is not supported"):
        EngineConfig(runner="pooling", speculative_method="ngram")
    with pytest.raises(InvalidRequestError, match="needs --runner pooling"):
        EngineConfig(runner="generate", pooler_config={"pooling_type": "MEAN"})


def test_llm_embed_and_encode(tmp_path):
    """vLLM's offline API: LLM.embed gives lists of floats, LLM.encode tensors; truncate_prompt_tokens keeps the
    last tokens."""
    model = save_bare_decoder(tmp_path, "LAST")
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8)
    prompts = prompts_of(9, 30)
    outs = llm.embed(prompts, use_tqdm=False)
    assert [o.outputs.hidden_size for o in outs] == [64, 64]
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(model, prompt, "LAST"),
                                   atol=1e-4, rtol=1e-4)
    encoded = llm.encode(prompts[1], PoolingParams(normalize=False), truncate_prompt_tokens=10, use_tqdm=False)
    torch.testing.assert_close(encoded[0].outputs.data, reference(model, prompts[1][-10:], "LAST",
                                                                  normalize=False), atol=1e-4, rtol=1e-4)
    assert encoded[0].prompt_token_ids == prompts[1][-10:]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        llm.embed(prompts, truncate_prompt_tokens=0)
    # LLM.score: cosine similarities, one against many or pair by pair
    third = prompts_of(14, seed=7)[0]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed([*prompts, third], use_tqdm=False)]
    scores = [s.outputs.score for s in llm.score(prompts[0], [prompts[1], third], use_tqdm=False)]
    assert scores == pytest.approx([F.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]], abs=1e-5)
    assert len(llm.score([prompts[0], prompts[1]], [third, third], use_tqdm=False)) == 2
    with pytest.raises(InvalidRequestError, match="give one text_1"):
        llm.score([prompts[0], prompts[1]], [third] * 3)
    with pytest.raises(InvalidRequestError, match="generates no text"):
        llm.generate(prompts[0], use_tqdm=False)


def test_embeddings_on_two_tensor_parallel_ranks(tmp_path):
    """The hidden states after the last all-reduce are whole on every rank: rank 0's pooled rows are the model's."""
    model = save_bare_decoder(tmp_path, "MEAN")
    llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64, block_size=8)
    try:
        prompts = prompts_of(9, 40)
        for prompt, out in zip(prompts, llm.encode(prompts, use_tqdm=False)):
            torch.testing.assert_close(out.outputs.data, reference(model, prompt, "MEAN"), atol=1e-4, rtol=1e-4)
    finally:
        llm.engine.shutdown()


def save_classifier(path, num_labels: int, vocab: int = TINY["vocab_size"], **config) -> torch.nn.Module:
    """A random-weight LlamaForSequenceClassification (a classifier or, with one label, a reward model)."""
    torch.manual_seed(0)
    labels = {i: f"class_{i}" for i in range(num_labels)}
    cfg = transformers.LlamaConfig(**{**TINY, "vocab_size": vocab}, num_labels=num_labels, id2label=labels,
                                   label2id={v: k for k, v in labels.items()}, pad_token_id=0, **config)
    model = transformers.LlamaForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15 + (1.0 if p.ndim == 1 else 0.0))
    model.eval().save_pretrained(path, safe_serialization=True)
    return model


def classifier_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("num_labels, problem_type", [(3, None), (1, None), (2, "regression")])
def test_classifier_matches_transformers(tmp_path, num_labels, problem_type):
    """A *ForSequenceClassification checkpoint runs as a classifier: the last token's state through its head, as
    probabilities (softmax; sigmoid for one label, a reward model), raw for regression or activation=False; in chunks
    and batched as any prompt."""
    model = save_classifier(tmp_path, num_labels, **({"problem_type": problem_type} if problem_type else {}))
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    assert llm.engine.task == "classify"
    prompts = prompts_of(6, 50)
    outs = llm.classify(prompts, use_tqdm=False)
    raw = llm.classify(prompts, pooling_params=PoolingParams(activation=False), use_tqdm=False)
    for prompt, out, plain in zip(prompts, outs, raw):
        logits = classifier_logits(model, prompt)
        expected = (logits if problem_type == "regression" else torch.sigmoid(logits) if num_labels == 1
                    else torch.softmax(logits, -1))
        assert out.outputs.num_classes == num_labels
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(plain.outputs.probs), logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="LLM.embed needs an embedding model"):
        llm.embed(prompts)
    with pytest.raises(InvalidRequestError, match=r"Task classify only supports \['activation'\]"):
        llm.encode(prompts[0], PoolingParams(normalize=True))
    with pytest.raises(InvalidRequestError, match="pools LAST or CLS, not MEAN"):
        tiny_engine(tmp_path, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(InvalidRequestError, match="no LM head \\(a classifier\\)"):
        tiny_engine(tmp_path, runner="generate")


def test_lora_adapters_on_an_embedding_engine(tmp_path):
    """Embeddings through LoRA adapters, as vLLM serves them: each request's vector is its adapter's merged model's,
    with requests of two adapters and the base model in one batch."""
    from llmserve import LoRARequest
    from tests.lora_helpers import make_adapter, tiny_base

    base = tiny_base(tmp_path / "base")
    merged = [make_adapter(base, tmp_path / f"a{i}", seed=i) for i in (1, 2)]
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "base"), runner="pooling", enable_lora=True, max_loras=2,
                                    dtype="float32", num_kv_blocks=64, block_size=8), skip_tokenizer=True)
    prompt = prompts_of(21)[0]
    loras = [None, LoRARequest("a1", 1, str(tmp_path / "a1")), LoRARequest("a2", 2, str(tmp_path / "a2"))]
    for i, lora in enumerate(loras):
        engine.add_request(f"r{i}", prompt, PoolingParams(), lora_request=lora)
    outs = run_to_completion(engine)
    for i, model in enumerate([base, *merged]):
        torch.testing.assert_close(outs[f"r{i}"].outputs.data, reference(model.model, prompt, "LAST"), atol=1e-4,
                                   rtol=1e-4)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and engine.lora_users(1) == engine.lora_users(2) == 0
