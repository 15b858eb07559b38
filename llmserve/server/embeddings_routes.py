"""The APIs of a pooling engine (--runner pooling). An embedding model's: OpenAI's /v1/embeddings, and vLLM's /score
and /rerank (Jina's and Cohere's shape) over the same embeddings. A classifier's: vLLM's /classify, and for a
cross-encoder (one class: a reranker) /score and /rerank too. Each input's prompt is computed, batched with the others,
and pooled (layers/pooler.py). Scores are, as vLLM's: with an embedding model, the cosine similarity of two texts'
vectors; with a cross-encoder, its probability for the two texts read as one prompt."""

from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request

from llmserve.outputs import PoolingRequestOutput
from llmserve.pooling_params import PoolingParams, cross_encoder_prompt, kept_tokens, score_method, score_pairs
from llmserve.server.errors import APIError
from llmserve.server.protocol import (ChatCompletionRequest, ClassificationRequest, EmbeddingRequest, RerankRequest,
                                     ScoreRequest)
from llmserve.server.request_streams import collect_finals

if TYPE_CHECKING:  # the vectors arrive as tensors (torch loads to unpickle them); the other routes need no torch
    import torch

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


def embedding_value(vector: torch.Tensor, encoding_format: str):
    """An embedding as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes (what the
    openai SDK asks for unless told otherwise, and decodes itself)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


def install_embeddings_routes(app: FastAPI, engine, cfg, check_auth, admitted, render_chat, request_outputs) -> None:
    tok = engine.tokenizer

    def served_as(adapter) -> str:
        """The model an answer names: the adapter the request asked for, else the base model."""
        return adapter.lora_name if adapter is not None else cfg.served_model_name

    def fitted(prompts: list[list[int]], keep: int | None, param: str) -> list[list[int]]:
        prompts = [p[-keep:] for p in prompts] if keep is not None else prompts
        longest = max(len(p) for p in prompts)
        if longest > engine.max_model_len:
            raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
                                f"requested {longest} tokens in the input for embedding generation. Please reduce the "
                                "length of the input.", param=param, code="context_length_exceeded")
        return prompts

    def texts_to_ids(texts: list[str], param: str, add_special_tokens: bool = True) -> list[list[int]]:
        if any(not isinstance(t, str) or not t for t in texts):
            raise APIError(400, f"{param} must not contain empty strings", param=param)
        return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def input_ids(req: EmbeddingRequest | ClassificationRequest) -> list[list[int]]:
        """A pooling request's inputs as token ids: strings tokenized (with the model's special tokens, unless
        add_special_tokens is false), token ids checked, or the chat form's messages through the template."""
        if (req.input is None) == (req.messages is None):
            raise APIError(400, "give input (a string, a list of strings, or token ids), or messages", param="input")
        if req.messages is not None:
            # the template places the special tokens (vLLM's chat form adds none of its own by default either)
            return [render_chat(ChatCompletionRequest(messages=req.messages,
                                                      add_generation_prompt=req.add_generation_prompt))]
        x = [req.input] if isinstance(req.input, str) else req.input
        if not x:
            raise APIError(400, "input must not be empty", param="input")
        if len(x) > MAX_INPUTS:
            raise APIError(400, f"input has {len(x)} items; at most {MAX_INPUTS} are allowed in one request",
                           param="input")
        if isinstance(x[0], str):
            return texts_to_ids(x, "input", req.add_special_tokens)
        prompts = [list(x)] if isinstance(x[0], int) else [list(p) for p in x]
        vocab = engine.model_config.vocab_size
        if any(not p for p in prompts):
            raise APIError(400, "input must not contain empty token lists", param="input")
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise APIError(400, f"input has token ids outside the vocabulary [0, {vocab})", param="input")
        return prompts

    async def vectors(req, raw: Request, prompts: list[list[int]], params: PoolingParams, slot, adapter,
                      kind: str) -> tuple[str, list[torch.Tensor]]:
        """Every prompt's embedding, computed together; the request's id with them."""
        rid = f"{kind}-{uuid.uuid4().hex}"
        finals = await collect_finals(raw, request_outputs(req, prompts, params, rid, slot, None, adapter))
        out = []
        for i in range(len(prompts)):
            final = finals[i]
            if not isinstance(final, PoolingRequestOutput):  # ended before its prompt was computed
                reason = final.outputs[0].finish_reason
                if reason == "timeout":
                    raise APIError(503, "the request timed out (its timeout, or the server's --request-timeout) "
                                        "before its embeddings were computed", code="request_timeout")
                raise APIError(503, f"the request ended ({reason}) before its embeddings were computed")
            out.append(final.outputs.data)
        return rid, out

    @app.post("/v1/embeddings", dependencies=[Depends(check_auth)])
    async def embeddings(req: EmbeddingRequest, raw: Request):
        async with admitted(req, task="embed") as (slot, adapter):
            prompts = fitted(input_ids(req), kept_tokens(req.truncate_prompt_tokens, engine.max_model_len), "input")
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
            params.validate_for_model(engine.model_config.hidden_size, engine.model_config.matryoshka_dimensions,
                                      cfg.served_model_name, "embed")
            slot.add_tokens(sum(len(p) for p in prompts))
        rid, vecs = await vectors(req, raw, prompts, params, slot, adapter, "embd")
        tokens = sum(len(p) for p in prompts)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": served_as(adapter),
                "data": [{"index": i, "object": "embedding", "embedding": embedding_value(v, req.encoding_format)}
                         for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # how this engine scores two texts (/score, /rerank): a cross-encoder reads each pair as one prompt; an embedding
    # model embeds each text once and compares the vectors
    cross_encoder = score_method(engine.task, engine.model_config.num_labels) == "cross-encoder"

    def score_prompts(req, first: list[str], second: list[str], pairs, names: tuple[str, str]) -> list[list[int]]:
        keep = kept_tokens(req.truncate_prompt_tokens, engine.max_model_len)
        if not cross_encoder:
            return fitted(texts_to_ids(first, names[0]), keep, names[0]) + \
                fitted(texts_to_ids(second, names[1]), keep, names[1])
        for texts, name in zip((first, second), names):
            if any(not isinstance(t, str) or not t for t in texts):
                raise APIError(400, f"{name} must not contain empty strings", param=name)
        return fitted([cross_encoder_prompt(tok, engine.model_config, first[i], second[j]) for i, j in pairs], keep,
                      names[1])

    def score_params(req) -> PoolingParams:
        if cross_encoder:
            return PoolingParams(activation=req.activation)
        if req.activation is not None:
            raise APIError(400, "activation applies to a cross-encoder's scores; this model scores two texts by the "
                                "cosine similarity of their embeddings", param="activation")
        return PoolingParams()

    async def pair_scores(req, raw, prompts, params, pairs, num_first: int, slot, adapter, kind):
        rid, vecs = await vectors(req, raw, prompts, params, slot, adapter, kind)
        if cross_encoder:
            return rid, [v[0].item() for v in vecs]
        a, b = vecs[:num_first], vecs[num_first:]
        import torch.nn.functional as F

        return rid, [F.cosine_similarity(a[i], b[j], dim=0).item() for i, j in pairs]

    async def score(req: ScoreRequest, raw: Request):
        async with admitted(req, task="score") as (slot, adapter):
            first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
            second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
            pairs = score_pairs(first, second)
            prompts = score_prompts(req, first, second, pairs, ("text_1", "text_2"))
            params = score_params(req)
            slot.add_tokens(sum(len(p) for p in prompts))
        rid, scores = await pair_scores(req, raw, prompts, params, pairs, len(first), slot, adapter, "score")
        tokens = sum(len(p) for p in prompts)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": served_as(adapter),
                "data": [{"index": k, "object": "score", "score": value} for k, value in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    async def rerank(req: RerankRequest, raw: Request):
        async with admitted(req, task="score") as (slot, adapter):
            pairs = [(0, j) for j in range(len(req.documents))]
            prompts = score_prompts(req, [req.query], req.documents, pairs, ("query", "documents"))
            params = score_params(req)
            slot.add_tokens(sum(len(p) for p in prompts))
        rid, scores = await pair_scores(req, raw, prompts, params, pairs, 1, slot, adapter, "rerank")
        order = sorted(range(len(scores)), key=lambda j: -scores[j])[: req.top_n or None]
        results = [{"index": j, "relevance_score": scores[j],
                    **({"document": {"text": req.documents[j]}} if req.return_documents else {})} for j in order]
        return {"id": rid, "model": served_as(adapter), "results": results,
                "usage": {"total_tokens": sum(len(p) for p in prompts)}}

    async def classify(req: ClassificationRequest, raw: Request):
        async with admitted(req, task="classify") as (slot, adapter):
            prompts = fitted(input_ids(req), kept_tokens(req.truncate_prompt_tokens, engine.max_model_len), "input")
            params = PoolingParams(activation=req.activation)
            slot.add_tokens(sum(len(p) for p in prompts))
        rid, vecs = await vectors(req, raw, prompts, params, slot, adapter, "classify")
        names = engine.model_config.id2label
        data = []
        for i, probs in enumerate(vecs):
            best = int(probs.argmax())
            data.append({"index": i, "label": names.get(best, f"LABEL_{best}"), "probs": probs.tolist(),
                         "num_classes": len(probs)})
        tokens = sum(len(p) for p in prompts)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": served_as(adapter),
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    for path in ("/classify", "/v1/classify"):
        app.post(path, dependencies=[Depends(check_auth)])(classify)
    for path in ("/score", "/v1/score"):
        app.post(path, dependencies=[Depends(check_auth)])(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, dependencies=[Depends(check_auth)])(rerank)
