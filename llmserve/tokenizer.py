"""Tokenizers as `tokenizers.Tokenizer`, from tokenizer.json or rebuilt from GGUF metadata, plus chat templates."""

from __future__ import annotations

import json
import os
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from llmserve.config import ModelConfig
from llmserve.errors import InvalidRequestError, UnsupportedModelError

# Pre-tokenizer split patterns that llama.cpp names in `tokenizer.ggml.pre` (the same as the models' tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPM_SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk_id: int,
                       add_space_prefix: bool) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (llama.cpp's tokenizer model "llama": Llama 2, Mistral, Gemma), whose GGUF keeps
    the pieces and their scores but no merges: SentencePiece merges the adjacent pair whose joined piece scores
    highest, so every split of a piece into two pieces is a merge ranked by that piece's score. Text is normalized as
    SentencePiece does (spaces to U+2581, a leading one where the model adds it); bytes outside the vocabulary become
    <0xNN> pieces."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _TOKEN_TYPE_NORMAL}
    ranked = []
    for piece, pid in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[pid], pid, normal[left], normal[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id], fuse_unk=True,
                                 byte_fallback=True))
    replace = normalizers.Replace(" ", _SPM_SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace]) if add_space_prefix else replace
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def _byte_level_pre_tokenizer(pre: str):
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = _LLAMA3_SPLIT
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = _QWEN2_SPLIT
    else:  # "gpt2", "default" and others: GPT-2's own regex inside ByteLevel
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# fill-in-the-middle tokens (prefix, suffix, middle) as code models spell them: Qwen2.5-Coder's, StarCoder(2)'s and
# SantaCoder's, DeepSeek-Coder's
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, bos_token: str | None, eos_token: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = None

    def with_chat_template(self, chat_template: str) -> "Tokenizer":
        """This tokenizer with another chat template (the vocabulary is shared, not copied)."""
        return type(self)(self.tokenizer, chat_template, self.bos_token, self.eos_token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_metadata(cls, field_value, config: ModelConfig) -> "Tokenizer":
        """From a GGUF file's tokenizer.ggml.* metadata; field_value(key, default=None) reads one field."""
        kind = field_value("tokenizer.ggml.model")
        tokens = field_value("tokenizer.ggml.tokens")
        types = field_value("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in field_value("tokenizer.ggml.merges")]
            vocab = {t: i for i, t in enumerate(tokens)}
            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
            tok.pre_tokenizer = _byte_level_pre_tokenizer(field_value("tokenizer.ggml.pre") or "default")
            tok.decoder = decoders.ByteLevel()
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, field_value("tokenizer.ggml.scores"), types,
                                     field_value("tokenizer.ggml.unknown_token_id", 0),
                                     field_value("tokenizer.ggml.add_space_prefix", True))
        else:
            raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE), "
                                        "llama (SentencePiece BPE)", "model")
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        bos_id, eos_id = config.bos_token_id, (config.eos_token_ids or [None])[0]
        bos = tokens[bos_id] if bos_id is not None else None
        if field_value("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        return cls(tok, field_value("tokenizer.chat_template"), bos, tokens[eos_id] if eos_id is not None else None)

    @classmethod
    def from_hf_folder(cls, folder: str) -> "Tokenizer":
        tok = HFTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        tc = {}
        tc_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(tc_path):
            with open(tc_path, encoding="utf-8") as f:
                tc = json.load(f)
        template = tc.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        processor_path = os.path.join(folder, "chat_template.json")  # a multimodal model's processor's (Gemma 3)
        if template is None and os.path.isfile(processor_path):
            with open(processor_path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

        def token_text(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(tok, template, token_text(tc.get("bos_token")), token_text(tc.get("eos_token")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True) -> list[int]:
        """Two texts as one input, through the tokenizer's pair template (what transformers' tokenizer(text,
        text_pair) gives: a cross-encoder's input)."""
        return self.tokenizer.encode(text, pair, add_special_tokens=add_special_tokens).ids

    def fill_in_the_middle(self, prefix: str, suffix: str) -> list[int] | None:
        """A fill-in-the-middle prompt (prefix, suffix, then the model writes the middle) in the spelling of the
        model's own FIM tokens, as code models are trained (prefix-suffix-middle order), with the special tokens the
        tokenizer adds (a BOS); None: the vocabulary has no FIM tokens (a model not trained for it)."""
        for pre, suf, mid in FIM_TOKENS:
            if all(self.tokenizer.token_to_id(t) is not None for t in (pre, suf, mid)):
                return self.encode(f"{pre}{prefix}{suf}{suffix}{mid}")
        return None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """Incremental decoding: `stream.step(self.tokenizer, id)` gives each token's text once it is whole (None
        while a UTF-8 character is still split across tokens)."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` if it is one special token of this vocabulary (a control token such as Mistral's
        `[TOOL_CALLS]`, which decoding drops unless asked to keep special tokens), else None."""
        token_id = self.tokenizer.token_to_id(text)
        if token_id is None:
            return None
        added = self.tokenizer.get_added_tokens_decoder().get(token_id)
        return token_id if added is not None and added.special else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render as Hugging Face does: sandboxed Jinja2, trim_blocks and lstrip_blocks, raise_exception()."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use a plain completion prompt", "messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message):
                raise TemplateError(message)

            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", "messages") from e
