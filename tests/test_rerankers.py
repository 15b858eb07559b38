"""Rerankers: cross-encoders (a one-class *ForSequenceClassification model reading two texts as one prompt) and
language models run as rerankers through vLLM's --hf-overrides recipe (classifier_from_token), against transformers on
the same random weights and the same tokenizer; LLM.score, /score and /rerank on a real server; the errors."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch

from llmserve import LLM, PoolingParams
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.loader import load_model_files
from tests.server_fixtures import RunningServer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(300)] + ["no", "yes", "maybe"]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def save_tokenizer(path, extra_special: tuple[str, ...] = ()) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer whose pair template differs from joining the two texts, as cross-encoders' do:
    `<s> A </s>` alone, `<s> A </s> B </s>` for a pair. extra_special: more special tokens, at the vocabulary's end."""
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS + list(extra_special))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.add_special_tokens(SPECIAL + list(extra_special))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def save_model(path, cls, **config) -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerFast]:
    cfg = transformers.LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), **TINY, **config)
    model = randomize(cls(cfg))
    model.save_pretrained(path, safe_serialization=True)
    return model, save_tokenizer(path)


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 300, (n,), generator=g))


QUERY = words(1, 5)
DOCS = [words(2, 9), words(3, 3), words(4, 30)]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cross-encoder")
    model, tok = save_model(path, transformers.LlamaForSequenceClassification, num_labels=1)
    return path, model, tok


def transformers_pair_score(model, tok, first: str, second: str) -> float:
    with torch.no_grad():
        return torch.sigmoid(model(**tok(first, second, return_tensors="pt")).logits[0, 0]).item()


def test_cross_encoder_scores_pairs_as_transformers(cross_encoder):
    """A one-class classifier is a cross-encoder: LLM.score reads each pair through the tokenizer's pair template (as
    transformers' tokenizer(text, text_pair)) and gives the sigmoid of the head's score; one against many and pair by
    pair; activation=False the raw score; classify still answers on it."""
    path, model, tok = cross_encoder
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    try:
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [tok(QUERY, d)["input_ids"] for d in DOCS]
        for o, d in zip(outs, DOCS):
            assert o.outputs.score == pytest.approx(transformers_pair_score(model, tok, QUERY, d), abs=1e-5)
        pairwise = llm.score([DOCS[0], DOCS[1]], [QUERY, DOCS[2]], use_tqdm=False)
        assert pairwise[1].outputs.score == pytest.approx(transformers_pair_score(model, tok, DOCS[1], DOCS[2]),
                                                          abs=1e-5)
        raw = llm.score(QUERY, DOCS[0], pooling_params=PoolingParams(activation=False), use_tqdm=False)
        with torch.no_grad():
            logit = model(**tok(QUERY, DOCS[0], return_tensors="pt")).logits[0, 0].item()
        assert raw[0].outputs.score == pytest.approx(logit, abs=1e-4)
        # the pair's last tokens, as every pooling input is truncated
        cut = llm.score(QUERY, DOCS[2], truncate_prompt_tokens=12, use_tqdm=False)[0]
        assert cut.prompt_token_ids == tok(QUERY, DOCS[2])["input_ids"][-12:]
        assert llm.classify(QUERY, use_tqdm=False)[0].outputs.num_classes == 1
        with pytest.raises(InvalidRequestError, match="text_1 has 2 texts and text_2 3"):
            llm.score(DOCS[:2], DOCS)
        with pytest.raises(InvalidRequestError, match=r"only supports \['activation'\]"):
            llm.score(QUERY, DOCS, pooling_params=PoolingParams(normalize=True))
    finally:
        llm.engine.shutdown()


def test_score_and_rerank_served_by_a_cross_encoder(cross_encoder):
    """/score and /rerank on a cross-encoder server: each pair's score as transformers computes it, the documents
    ranked by it; `activation`; usage counts the pairs' tokens; no KV block held afterwards."""
    path, model, tok = cross_encoder
    server = RunningServer(load_model_files(str(path)), {}, {})
    try:
        expected = [transformers_pair_score(model, tok, QUERY, d) for d in DOCS]
        scored = httpx.post(server.base_url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
        assert scored["usage"]["prompt_tokens"] == sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
        ranked = httpx.post(server.base_url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
        best = sorted(range(3), key=lambda j: -expected[j])[:2]
        assert [r["index"] for r in ranked["results"]] == best
        assert ranked["results"][0]["relevance_score"] == pytest.approx(expected[best[0]], abs=1e-5)
        assert ranked["results"][0]["document"] == {"text": DOCS[best[0]]}
        raw = httpx.post(server.base_url + "/v2/rerank", json={"query": QUERY, "documents": DOCS[:1],
                                                                "activation": False}).json()
        logit = torch.logit(torch.tensor(expected[0], dtype=torch.float64)).item()
        assert raw["results"][0]["relevance_score"] == pytest.approx(logit, abs=1e-3)
        bad = httpx.post(server.base_url + "/score", json={"text_1": QUERY, "text_2": ["", DOCS[0]]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
        r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "w1"})
        assert r.status_code == 400 and "/classify, /score, /rerank" in r.json()["error"]["message"]
        server.wait_idle()
    finally:
        server.stop()


def test_score_needs_an_embedding_model_or_a_cross_encoder(tmp_path):
    """A classifier of several classes has no score: LLM.score and /score say what would."""
    save_model(tmp_path, transformers.LlamaForSequenceClassification, num_labels=3)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, block_size=8)
    try:
        with pytest.raises(InvalidRequestError, match="or a cross-encoder .* task is classify with 3 classes"):
            llm.score(QUERY, DOCS)
    finally:
        llm.engine.shutdown()
    server = RunningServer(load_model_files(str(tmp_path)), {}, {})
    try:
        for route, body in (("/score", {"text_1": QUERY, "text_2": DOCS}), ("/rerank", {"query": QUERY,
                                                                                       "documents": DOCS})):
            r = httpx.post(server.base_url + route, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
            assert "a cross-encoder (a classifier of one class)" in r.json()["error"]["message"]
    finally:
        server.stop()


RECIPE = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
          "is_original_qwen3_reranker": True}


def test_a_language_model_as_a_reranker_through_hf_overrides(tmp_path):
    """vLLM's recipe for rerankers trained as language models (Qwen3-Reranker): with classifier_from_token
    ["no", "yes"] the score is the probability of "yes" against "no" after the two texts joined as one prompt
    (the texts carry the model's prompt format), from the LM head's two rows; the vocabulary-sized head is not built."""
    model, tok = save_model(tmp_path, transformers.LlamaForCausalLM)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8, hf_overrides=RECIPE)
    try:
        assert llm.engine.task == "classify"
        query = f"{QUERY} maybe\n"  # as the recipe's prompts end the query's part
        outs = llm.score(query, DOCS, use_tqdm=False)
        for o, d in zip(outs, DOCS):
            ids = tok(query + d)["input_ids"]  # joined: no pair template
            assert "<unk>" not in tok.convert_ids_to_tokens(ids)
            assert o.prompt_token_ids == ids
            with torch.no_grad():
                last = model(torch.tensor([ids])).logits[0, -1]
            assert o.outputs.score == pytest.approx(torch.softmax(last[[no, yes]], -1)[1].item(), abs=1e-5)
    finally:
        llm.engine.shutdown()


def test_convert_classify_rows_as_classes(tmp_path):
    """--convert classify of a generative model, classifier_from_token listing more than two tokens (method
    no_post_processing): one class per token, softmax over their logits, labelled by the tokens."""
    model, tok = save_model(tmp_path, transformers.LlamaForCausalLM, tie_word_embeddings=True)
    tokens = ["no", "maybe", "yes"]
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=8, convert="classify",
              hf_overrides={"classifier_from_token": tokens})
    try:
        ids = tok(DOCS[0])["input_ids"]
        out = llm.classify(DOCS[0], use_tqdm=False)[0]
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(last[tok.convert_tokens_to_ids(tokens)], -1)
        assert out.outputs.probs == pytest.approx(expected.tolist(), abs=1e-5)
        assert llm.engine.model_config.id2label == dict(enumerate(tokens))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("overrides, convert, message", [
    ({"classifier_from_token": ["no", "yes"]}, "auto", "needs the \\*ForSequenceClassification architecture"),
    ({**RECIPE, "classifier_from_token": ["nope", "yes"]}, "auto", "'nope' is not a token"),
    ({**RECIPE, "classifier_from_token": ["no", "yes", "maybe"]}, "auto", "from_2_way_softmax compares two tokens; "
     "classifier_from_token has 3"),
    ({"classifier_from_token": "yes"}, "classify", "must be a list of token strings"),
    ({"classifier_from_token": ["yes"], "method": "softmax"}, "classify", "method must be one of"),
])
def test_reranker_recipe_errors(tmp_path, overrides, convert, message):
    save_model(tmp_path, transformers.LlamaForCausalLM)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, hf_overrides=overrides, convert=convert)


def test_bad_settings_are_refused_at_the_edge(tmp_path, default_gguf):
    with pytest.raises(InvalidRequestError, match="needs --runner pooling"):
        LLM(str(tmp_path), convert="classify", runner="generate")
    with pytest.raises(InvalidRequestError, match="hf_overrides must be a JSON object"):
        LLM(str(tmp_path), hf_overrides=["architectures"])
    r = subprocess.run([sys.executable, "-m", "llmserve", "info", default_gguf, "--hf-overrides", json.dumps(RECIPE)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "error: --hf-overrides applies to a Hugging Face folder's config.json" in r.stderr
    save_model(tmp_path, transformers.LlamaForCausalLM)
    r = subprocess.run([sys.executable, "-m", "llmserve", "info", str(tmp_path), "--hf-overrides", json.dumps(RECIPE)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "a one-class classifier: a cross-encoder (reranker)" in r.stdout
