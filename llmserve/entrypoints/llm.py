"""Offline Python API in vLLM's shape: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Sequence

import torch
from tqdm import tqdm

from llmserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from llmserve.config import EngineConfig, read_chat_template, speculative_settings
from llmserve.engine.llm_engine import LLMEngine
from llmserve.lora.request import LoRARequest
from llmserve.errors import InvalidRequestError
from llmserve.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from llmserve.pooling_params import PoolingParams, cross_encoder_prompt, kept_tokens, score_method, score_pairs
from llmserve.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


def _prompt_list(prompts) -> list[str | list[int]]:
    """One prompt or several, each a string, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [p["prompt_token_ids"] if isinstance(p, dict) and "prompt_token_ids" in p
            else p["prompt"] if isinstance(p, dict) else p for p in prompts]


class LLM:
    def __init__(self, model: str | None = None, speculative_config: dict | None = None, **engine_args):
        if speculative_config:  # vLLM's spelling: {"method": "ngram", "num_speculative_tokens": 4, "model": ...}
            engine_args.update(speculative_settings(speculative_config))
        unknown = set(engine_args) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            name = sorted(unknown)[0]
            close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(EngineConfig)], n=1)
            raise TypeError(f"LLM() got an unexpected engine argument {name!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's name for it."""
        return self.engine

    def get_tokenizer(self):
        if self.engine.tokenizer is None:  # vLLM's: there is none to give
            raise ValueError("there is no tokenizer: " + self.engine.no_tokenizer_reason())
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: later prompts find no prefix cached before now (the host and disk spill tiers included), e.g. to
        measure cold prefill. False if blocks held by unfinished requests kept theirs."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json sampling defaults (unless --generation-config vllm), else
        SamplingParams()'s; what generate() and chat() use when given no SamplingParams."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts. `lora_request`: one adapter for
        every prompt, or one (or None: the base model) per prompt."""
        prompts = _prompt_list(prompts)
        params = (sampling_params if isinstance(sampling_params, (list, tuple))
                  else [sampling_params or self.get_default_sampling_params()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one LoRARequest, or one per prompt")
        # Only the finished outputs are returned, so the engine need not build one per step (as vLLM's LLM does)
        params = [p or self.get_default_sampling_params() for p in params]
        final_only = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final_only[id(p)] for p in params]
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(None, prompt, p, priority=priority[i] if priority else 0,
                                                   lora_request=loras[i]))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template (the model's, the engine's --chat-template,
        or `chat_template` here: the template or a path to its file), then generated as a prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if chat_template is not None:
            tok = tok.with_chat_template(read_chat_template(chat_template))
        kwargs = dict(chat_template_kwargs or {}, **({"tools": tools} if tools is not None else {}))
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **kwargs),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt, the best params.beam_width sequences (outputs[i].sequences, best
        first; each with its tokens, text, cum_logprob and logprobs). The beams of all prompts advance together, one
        engine step's batch per token (beam_search.py)."""
        if self.engine.runner != "generate":
            raise InvalidRequestError("LLM.beam_search generates text: it needs a text engine (runner=\"generate\")",
                                      "runner")
        searches = [BeamSearch(self.engine.tokenize_prompt(p)[1], params, self.engine.eos_token_ids,
                               self.engine.max_model_len) for p in _prompt_list(prompts)]
        step = params.step_params(self.engine.max_logprobs)
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, unit="token")
        with bar:
            while not all(s.finished for s in searches):
                growing = [s for s in searches if not s.finished]
                ids = []
                try:
                    for s in growing:
                        ids += [self.engine.add_request(None, beam.tokens, step, lora_request=lora_request)
                                for beam in s.live]
                except Exception:
                    for rid in ids:
                        self.engine.abort_request(rid)
                    raise
                outs = iter(self._run(ids, use_tqdm=False))
                for s in growing:
                    s.extend([next(outs).outputs[0].logprobs[0] for _ in s.live])
                bar.update(1)
        return [s.result(self.engine.tokenizer) for s in searches]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: LoRARequest | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode on an embedding engine (runner="pooling"): each prompt's pooled hidden states (outputs.data,
        a float32 tensor), in the order of the prompts. truncate_prompt_tokens: keep each prompt's last k tokens (-1:
        as many as the context holds)."""
        prompts = _prompt_list(prompts)
        params = (list(pooling_params) if isinstance(pooling_params, (list, tuple))
                  else [pooling_params or PoolingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("give one PoolingParams, or one per prompt")
        if self.engine.runner != "pooling":
            raise InvalidRequestError("LLM.embed and LLM.encode need an embedding engine: LLM(model, runner=\"pooling\")",
                                      "runner")
        keep = kept_tokens(truncate_prompt_tokens, self.engine.max_model_len)
        if keep is not None:
            prompts = [self.engine.tokenize_prompt(p)[1][-keep:] for p in prompts]
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p, lora_request=lora_request))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRARequest | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's embedding (outputs.embedding, a list of floats), in the order of the
        prompts. Needs LLM(model, runner="pooling") (or a checkpoint without an LM head, which runs so by default)."""
        self._check_task("embed", "LLM.embed")
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify on a classifier (a *ForSequenceClassification checkpoint, which runs with
        runner="pooling" by default): each prompt's class probabilities (outputs.probs), in the order of the prompts."""
        self._check_task("classify", "LLM.classify")
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def _check_task(self, task: str, method: str) -> None:
        if self.engine.task != task:
            what = {"embed": "an embedding model: LLM(model, runner=\"pooling\")",
                    "classify": "a classifier (a *ForSequenceClassification checkpoint)"}[task]
            raise InvalidRequestError(f"{method} needs {what}; this engine's task is {self.engine.task}", "runner")

    def score(self, text_1: PromptType | Sequence[PromptType], text_2: PromptType | Sequence[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score, one text_1 against every text_2 or two lists pair by pair (outputs.score). With an
        embedding model: the cosine similarity of the two texts' embeddings. With a cross-encoder (a one-class
        classifier, e.g. a reranker): both texts in one prompt, the class probability (pooling_params.activation
        False: the raw score)."""
        method = score_method(self.engine.task, self.engine.model_config.num_labels)
        if method is None:
            raise InvalidRequestError(f"LLM.score needs an embedding model (LLM(model, runner=\"pooling\")) or a "
                                      f"cross-encoder (a classifier with one class); this engine's task is "
                                      f"{self.engine.task}" + (f" with {self.engine.model_config.num_labels} classes"
                                                               if self.engine.task == "classify" else ""), "runner")
        first, second = _prompt_list(text_1), _prompt_list(text_2)  # (texts or token ids)
        pairs = score_pairs(first, second)
        if method == "cross-encoder":
            prompts = [cross_encoder_prompt(self.engine.tokenizer, self.engine.model_config, first[i], second[j])
                       for i, j in pairs]
            outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, lora_request=lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0].item()), o.prompt_token_ids)
                    for o in outs]
        outs = self.encode(first + second, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request)
        a, b = outs[: len(first)], outs[len(first):]
        return [ScoringRequestOutput(b[j].request_id, ScoringOutput(
                    torch.nn.functional.cosine_similarity(a[i].outputs.data, b[j].outputs.data, dim=0).item()),
                    b[j].prompt_token_ids) for i, j in pairs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2, unit="req")
        with bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
