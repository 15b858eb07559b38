"""The tokenizer we rebuild from GGUF metadata against the one transformers builds from the same file."""

import pytest

from llmserve.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "    leading spaces and\ttabs\t\tand trailing   ",
    "naïve café — “quotes” and emoji 🎉🚀 and CJK 你好世界 and Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x" * 50 + " " * 17 + "\n" * 5,
    "URL: https://example.com/path?q=1&r=2#frag",
    "Mixed123numbers456and789letters 0 00 000",
    "I'm sure you'll say they've done it, we'd agree.",
    "",
]


@pytest.fixture(scope="module")
def ours(default_files) -> Tokenizer:
    return default_files.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(ours, hf_gguf_tokenizer, text):
    expected = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == expected
    assert ours.decode(expected, skip_special_tokens=False) == hf_gguf_tokenizer.decode(expected, skip_special_tokens=False)


def test_chat_template_matches_transformers(ours, hf_gguf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    for add in (True, False):
        expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_special_tokens(ours, default_files):
    assert default_files.config.bos_token_id == 1 and default_files.config.eos_token_ids == [2]
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert ours.decode([2, 28120], skip_special_tokens=True) == ours.decode([28120])


def test_incremental_detokenizer_never_emits_broken_characters(ours):
    from llmserve.engine.detokenizer import IncrementalDetokenizer
    from llmserve.engine.request import Request
    from llmserve.sampling_params import SamplingParams

    text = "Emoji 🎉🚀👩‍👩‍👧 and CJK 你好世界, accents naïve, math ∑∫√"
    ids = ours.encode(text, add_special_tokens=False)
    assert any("\ufffd" in ours.decode([t]) for t in ids)  # some tokens really are partial characters
    detok = IncrementalDetokenizer(ours, Request("r", [1], SamplingParams(), [2]))
    deltas = [detok.update(t, finished=False)[0] for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
