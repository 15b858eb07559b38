"""Draft-model proposer: a smaller model with the same tokenizer, in the same engine, with its own KV cache.

Per speculating request the draft keeps the tokens whose K/V it holds. Each round it first catches up on
what the target accepted since (rolling back past any of its own drafts that were rejected), then runs
K single-token steps, batched over requests. Greedy rows propose the draft's argmax; sampled rows draw
from the draft's distribution at the request's temperature and hand that distribution q to the verifier.
"""

from __future__ import annotations

import dataclasses

import torch

from llmserve.distributed.parallel_state import single_rank
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.errors import InvalidRequestError
from llmserve.loader import load_model_files
from llmserve.sampling_params import GREEDY_TEMPERATURE
from llmserve.worker.input_batch import ForwardItem

DRAFT_KV_FRACTION = 0.25  # of the target's KV memory


class _DraftSeq:
    """What the draft model has computed for one request."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.all_token_ids: list[int] = []
        self.num_computed_tokens = 0


class DraftModelProposer:
    def __init__(self, config, engine):
        # The drafter runs its own model runner in this process (as vLLM's drafter lives beside the target's worker).
        from llmserve.worker.model_runner import ModelRunner

        files = load_model_files(config.draft_model)
        target_tok, draft_tok = engine.tokenizer, files.tokenizer
        if target_tok is not None and draft_tok is not None:
            if target_tok.tokenizer.get_vocab(with_added_tokens=True) != draft_tok.tokenizer.get_vocab(with_added_tokens=True):
                raise InvalidRequestError(f"draft model {files.name} has a different tokenizer from {engine.model_name}; "
                                          "a drafter must share the target's vocabulary", "draft_model")
        elif files.config.vocab_size != engine.model_config.vocab_size:
            raise InvalidRequestError(f"draft model vocabulary ({files.config.vocab_size}) differs from the target's "
                                      f"({engine.model_config.vocab_size})", "draft_model")
        kv_bytes = max(int(engine.executor.info.kv_cache_bytes * DRAFT_KV_FRACTION), 1 << 20)
        draft_config = dataclasses.replace(config, model=config.draft_model, kv_cache_memory=kv_bytes, num_kv_blocks=None,
                                           speculative_method=None, draft_model=None, enable_prefix_caching=False,
                                           kv_offload_memory=None, kv_offload_dir=None, enable_lora=False,
                                           tensor_parallel_size=1)
        with single_rank():  # whole on rank 0, beside a target split over tensor-parallel ranks
            self.runner = ModelRunner(draft_config, files.config, files.weights,
                                      vocab_size=engine.model_config.vocab_size)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size)
        self.vocab_size = engine.model_config.vocab_size
        self.seqs: dict[str, _DraftSeq] = {}
        self.generator = torch.Generator(device=self.runner.device)
        self.generator.manual_seed(config.seed + 1)

    def _catch_up(self, seq: _DraftSeq, tokens: list[int]) -> int:
        """Roll back to the longest prefix the draft shares with the target's tokens; returns tokens to compute."""
        common = 0
        limit = min(seq.num_computed_tokens, len(tokens))
        if seq.all_token_ids[:limit] == tokens[:limit]:
            common = limit
        else:
            while common < limit and seq.all_token_ids[common] == tokens[common]:
                common += 1
        common = min(common, len(tokens) - 1)  # the last token is always run: its logits give the first draft
        seq.num_computed_tokens = common
        seq.all_token_ids = list(tokens)
        self.kv.trim(seq, common)
        return len(tokens) - common

    @torch.inference_mode()
    def propose_batch(self, requests: list, ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        seqs, todo = [], []
        for r in requests:
            seq = self.seqs.setdefault(r.request_id, _DraftSeq(r.request_id))
            n = self._catch_up(seq, r.all_token_ids)
            if not self.kv.allocate_slots(seq, n + max(ks) - 1):
                self.release(r.request_id)  # the draft pool is full: this request does not speculate now
                seqs.append(None)
                continue
            seqs.append(seq)
            todo.append(n)
        out_tokens: list[list[int]] = [[] for _ in requests]
        out_probs: list[list[torch.Tensor]] = [[] for _ in requests]
        live = [i for i, s in enumerate(seqs) if s is not None]
        news = dict(zip(live, todo))
        for step in range(max(ks) if live else 0):
            items = []
            for i in live:
                seq = seqs[i]
                n = news[i] if step == 0 else 1
                start = seq.num_computed_tokens
                items.append(ForwardItem(seq.all_token_ids[start:start + n], start, self.kv.block_tables[seq.request_id]))
            rows, at = [], 0
            for item in items:
                at += len(item.token_ids)
                rows.append(at - 1)
            logits = self.runner.compute_logits(items, rows)[:, : self.vocab_size]
            next_live = []
            for j, i in enumerate(live):
                seq, r = seqs[i], requests[i]
                seq.num_computed_tokens += len(items[j].token_ids)
                p = r.params
                if p.temperature < GREEDY_TEMPERATURE:
                    token = int(logits[j].argmax())
                else:
                    q = torch.softmax(logits[j] / p.temperature, dim=-1)
                    token = int(torch.multinomial(q, 1, generator=self.generator))
                    out_probs[i].append(q)
                out_tokens[i].append(token)
                seq.all_token_ids.append(token)
                if len(out_tokens[i]) < ks[i]:
                    next_live.append(i)
            live = next_live
        results = []
        for i, r in enumerate(requests):
            probs = torch.stack(out_probs[i]) if out_probs[i] else None
            results.append((out_tokens[i], probs))
        return results

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
