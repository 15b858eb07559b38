"""OpenAI's embeddings API (/v1/embeddings) on an embedding engine (--runner pooling): each input's prompt is computed,
batched with the others, and pooled to one vector (layers/pooler.py)."""

from __future__ import annotations

import base64
import time
import uuid

from fastapi import Depends, FastAPI, Request

from llmserve.outputs import PoolingRequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, EmbeddingRequest
from llmserve.server.request_streams import collect_finals

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


def embedding_value(vector, encoding_format: str):
    """An embedding as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes (what the
    openai SDK asks for unless told otherwise, and decodes itself)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


def install_embeddings_routes(app: FastAPI, engine, cfg, check_auth, admitted, render_chat, request_outputs) -> None:
    tok = engine.tokenizer

    def prompts_of(req: EmbeddingRequest) -> list[list[int]]:
        """The request's inputs as token ids: strings tokenized (with the model's special tokens, unless
        add_special_tokens is false), token ids checked, or the chat form's messages through the template."""
        if (req.input is None) == (req.messages is None):
            raise APIError(400, "give input (a string, a list of strings, or token ids), or messages", param="input")
        if req.messages is not None:
            # the template places the special tokens (vLLM's chat form adds none of its own by default either)
            return [render_chat(ChatCompletionRequest(messages=req.messages,
                                                      add_generation_prompt=req.add_generation_prompt))]
        x = req.input
        if isinstance(x, str):
            x = [x]
        if not x:
            raise APIError(400, "input must not be empty", param="input")
        if len(x) > MAX_INPUTS:
            raise APIError(400, f"input has {len(x)} items; at most {MAX_INPUTS} are allowed in one request",
                           param="input")
        special = req.add_special_tokens
        if isinstance(x[0], str):
            if any(not s for s in x):
                raise APIError(400, "input must not contain empty strings", param="input")
            return [tok.encode(s, add_special_tokens=special) for s in x]
        prompts = [list(x)] if isinstance(x[0], int) else [list(p) for p in x]
        vocab = engine.model_config.vocab_size
        if any(not p for p in prompts):
            raise APIError(400, "input must not contain empty token lists", param="input")
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise APIError(400, f"input has token ids outside the vocabulary [0, {vocab})", param="input")
        return prompts

    def truncated(req: EmbeddingRequest, prompts: list[list[int]]) -> list[list[int]]:
        keep = req.truncate_prompt_tokens
        if keep is None:
            return prompts
        if keep == -1:
            keep = engine.max_model_len
        elif keep < 1:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                           param="truncate_prompt_tokens")
        elif keep > engine.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens ({keep}) is more than the model's maximum context length "
                                f"({engine.max_model_len})", param="truncate_prompt_tokens")
        return [p[-keep:] for p in prompts]

    @app.post("/v1/embeddings", dependencies=[Depends(check_auth)])
    async def embeddings(req: EmbeddingRequest, raw: Request):
        async with admitted(req, task="embed") as (slot, adapter):
            prompts = truncated(req, prompts_of(req))
            longest = max(len(p) for p in prompts)
            if longest > engine.max_model_len:
                raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. However, "
                                    f"you requested {longest} tokens in the input for embedding generation. Please "
                                    "reduce the length of the input.", param="input", code="context_length_exceeded")
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
            params.validate_for_model(engine.model_config.hidden_size, engine.model_config.matryoshka_dimensions,
                                      cfg.served_model_name)
            slot.add_tokens(sum(len(p) for p in prompts))
        rid = f"embd-{uuid.uuid4().hex}"
        finals = await collect_finals(raw, request_outputs(req, prompts, params, rid, slot, None, adapter))
        data = []
        for i in range(len(prompts)):
            out = finals[i]
            if not isinstance(out, PoolingRequestOutput):  # ended before its prompt was computed
                reason = out.outputs[0].finish_reason
                if reason == "timeout":
                    raise APIError(503, "the request timed out (its timeout, or the server's --request-timeout) "
                                        "before its embeddings were computed", code="request_timeout")
                raise APIError(503, f"the request ended ({reason}) before its embeddings were computed")
            data.append({"index": i, "object": "embedding",
                         "embedding": embedding_value(out.outputs.data, req.encoding_format)})
        tokens = sum(len(p) for p in prompts)
        return {"id": rid, "object": "list", "created": int(time.time()),
                "model": cfg.served_model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
