"""Per-request controls of a pooling (embedding) request, in vLLM's names: what LLM.embed and /v1/embeddings take
where LLM.generate takes SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.errors import InvalidRequestError
from llmserve.sampling_params import RequestOutputKind


@dataclass
class PoolingParams:
    """dimensions: keep the embedding's first this many values (Matryoshka models only: other models' prefixes mean
    nothing, so vLLM refuses them and so does llmserve); normalize: scale it to unit length (None: as the pooler
    config says, on by default)."""

    dimensions: int | None = None
    normalize: bool | None = None
    # classifiers: turn the head's scores into probabilities (softmax; sigmoid for one class or multi-label);
    # None: yes, unless the model is a regression (its problem_type)
    activation: bool | None = None
    # a pooling request has one output, when its prompt has been computed (read where requests carry a kind)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    structured_outputs: None = None  # no grammar: nothing is sampled

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {d!r}", "dimensions")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be true or false, got {value!r}", name)

    def validate_for_model(self, hidden_size: int, matryoshka_dimensions: list[int] | None, model_name: str,
                           task: str = "embed") -> None:
        """Checked against the model: each task takes its own parameters (embed: dimensions, normalize; classify:
        activation); `dimensions` only for a Matryoshka-trained model, whose prefixes mean something, and only of the
        sizes it was trained at when its config lists them (vLLM's rules and messages)."""
        own = {"embed": ("dimensions", "normalize"), "classify": ("activation",)}[task]
        other = [n for n in ("dimensions", "normalize", "activation") if n not in own and getattr(self, n) is not None]
        if other:
            raise InvalidRequestError(f"Task {task} only supports {list(own)} parameters, does not support "
                                      f"{other} parameters", other[0])
        d = self.dimensions
        if d is None:
            return
        if matryoshka_dimensions is None:
            raise InvalidRequestError(f'Model "{model_name}" does not support matryoshka representation, changing '
                                      "output dimensions will lead to poor results.", "dimensions")
        if matryoshka_dimensions and d not in matryoshka_dimensions:
            raise InvalidRequestError(f'Model "{model_name}" only supports {matryoshka_dimensions} matryoshka '
                                      f"dimensions, using other output dimensions will lead to poor results.",
                                      "dimensions")
        if d > hidden_size:
            raise InvalidRequestError(f"dimensions must be at most the model's hidden size {hidden_size}, got {d}",
                                      "dimensions")


def score_pairs(text_1: list, text_2: list) -> list[tuple[int, int]]:
    """Which texts a score request compares (vLLM's pairing for /score and LLM.score): one text_1 against every
    text_2, or two lists of the same length pair by pair. Returns (index in text_1, index in text_2) per score."""
    if not text_1 or not text_2:
        raise InvalidRequestError("text_1 and text_2 must not be empty", "text_1" if not text_1 else "text_2")
    if len(text_1) == 1:
        return [(0, j) for j in range(len(text_2))]
    if len(text_1) != len(text_2):
        raise InvalidRequestError(f"text_1 has {len(text_1)} texts and text_2 {len(text_2)}: give one text_1, or as "
                                  "many as text_2", "text_2")
    return [(i, i) for i in range(len(text_1))]


def score_method(task: str, num_labels: int) -> str | None:
    """How vLLM's score APIs (/score, /rerank, LLM.score) compare two texts on an engine: "cosine" (an embedding model:
    each text embedded alone, then the cosine similarity of the two vectors), "cross-encoder" (a one-class classifier:
    both texts in one prompt, its class probability the score), or None (neither: no score API)."""
    if task == "embed":
        return "cosine"
    return "cross-encoder" if task == "classify" and num_labels == 1 else None


def cross_encoder_prompt(tokenizer, model_config, first: str | list[int], second: str | list[int]) -> list[int]:
    """A cross-encoder's one prompt for two texts: the tokenizer's pair template (transformers' tokenizer(text,
    text_pair)), or the two joined as one text where the model reads its prompt format from them (an LLM converted into
    a reranker: config use_pad_token false, as Qwen3-Reranker's recipe sets). Token ids are joined as they are."""
    if not isinstance(first, str) or not isinstance(second, str):
        ids = [tokenizer.encode(t) if isinstance(t, str) else list(t) for t in (first, second)]
        return ids[0] + ids[1]
    if model_config.score_pair_template:
        return tokenizer.encode_pair(first, second)
    return tokenizer.encode(first + second)


def kept_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens, read: how many of each input's last tokens to keep (None: all of them); -1 means
    as many as the context holds."""
    keep = truncate_prompt_tokens
    if keep is None or keep == -1:
        return None if keep is None else max_model_len
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep!r}",
                                  "truncate_prompt_tokens")
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) is more than the model's maximum context length "
                                  f"({max_model_len})", "truncate_prompt_tokens")
    return keep
