"""Offline Python API in vLLM's shape: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm import tqdm

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError
from llmserve.lora.request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, speculative_config: dict | None = None, **engine_args):
        if speculative_config:  # vLLM's spelling: {"method": "ngram", "num_speculative_tokens": 4, "model": ...}
            names = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens", "model": "draft_model",
                     "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max"}
            unknown = set(speculative_config) - set(names)
            if unknown:
                raise InvalidRequestError(f"unknown speculative_config keys: {', '.join(sorted(unknown))}", "speculative_config")
            engine_args.update({names[k]: v for k, v in speculative_config.items()})
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts. `lora_request`: one adapter for
        every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [p["prompt_token_ids"] if isinstance(p, dict) and "prompt_token_ids" in p
                   else p["prompt"] if isinstance(p, dict) else p for p in prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one LoRARequest, or one per prompt")
        # Only the finished outputs are returned, so the engine need not build one per step (as vLLM's LLM does)
        params = [p or SamplingParams() for p in params]
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
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

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
