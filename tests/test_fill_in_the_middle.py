"""OpenAI's `suffix` on /v1/completions: a fill-in-the-middle prompt in the model's own FIM tokens (a code model's),
answered as that prompt is; a model without FIM tokens refuses it (it was once ignored)."""

from __future__ import annotations

import httpx
import pytest

from llmserve.loader import load_model_files
from tests.server_fixtures import RunningServer

transformers = pytest.importorskip("transformers")

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def test_suffix_fills_in_the_middle(tmp_path, default_files):
    from tests.test_rerankers import SPECIAL, TINY, WORDS, randomize, save_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS) + len(FIM), **TINY)
    randomize(transformers.LlamaForCausalLM(cfg)).save_pretrained(tmp_path, safe_serialization=True)
    tok = save_tokenizer(tmp_path, FIM)
    pre, suf, mid = tok.convert_tokens_to_ids(list(FIM))
    server = RunningServer(load_model_files(str(tmp_path)), {}, {})
    try:
        body = {"prompt": "w1 w2 w3", "suffix": "w7 w8", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(server.base_url + "/v1/completions", json=body).json()
        # the tokenizer's own special tokens around the prefix-suffix-middle order
        expected = tok(f"{FIM[0]}w1 w2 w3{FIM[1]}w7 w8{FIM[2]}")["input_ids"]
        assert expected[1:4] == [pre] + tok.convert_tokens_to_ids(["w1", "w2"]) and mid in expected
        assert r["choices"][0]["prompt_token_ids"] == expected
        plain = httpx.post(server.base_url + "/v1/completions", json={**body, "prompt": expected, "suffix": None}).json()
        assert r["choices"][0]["text"] == plain["choices"][0]["text"]
        assert r["usage"]["prompt_tokens"] == len(expected) and suf in expected
        many = httpx.post(server.base_url + "/v1/completions", json={**body, "prompt": ["w1", "w2 w3"]}).json()
        assert len(many["choices"]) == 2
        ids = httpx.post(server.base_url + "/v1/completions", json={**body, "prompt": [5, 6]})
        assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
        server.wait_idle()
    finally:
        server.stop()
    server = RunningServer(default_files, {}, {})
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "def f(", "suffix": "return x",
                                                                  "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        assert "trained to fill in the middle" in r.json()["error"]["message"]
    finally:
        server.stop()
