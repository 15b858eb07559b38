"""The OpenAI response bodies that the routes share: usage (with cost), logprobs in the completions and chat shapes,
and the server-sent-events framing of a stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable

from llmserve.server import errors
from llmserve.server.cost import RequestPricer


_json = json.JSONEncoder(ensure_ascii=False)  # json.dumps with options builds an encoder per call (~1 µs a chunk)


def sse(obj) -> str:
    return f"data: {_json.encode(obj)}\n\n"


def sse_events(base: dict, per_chunk: dict) -> Callable[[dict], str]:
    """sse({**base, **chunk, **per_chunk}) for a stream's every chunk (whose keys are not base's), with `base` (id,
    object, created, model) encoded once: a loaded server writes a chunk per stream per step."""
    head = "data: " + _json.encode(base)[:-1] + ", " if base else "data: {"

    def event(chunk: dict) -> str:
        rest = {**chunk, **per_chunk}
        return head + _json.encode(rest)[1:] + "\n\n" if rest else sse(base)
    return event


class ResponseFormatter:
    def __init__(self, tokenizer, pricer: RequestPricer, tokens_as_ids: bool = False):
        self.tok, self.pricer = tokenizer, pricer
        self.tokens_as_ids = tokens_as_ids  # vLLM's --return-tokens-as-token-ids: logprobs name "token_id:N"

    def usage(self, prompt_lens: list[int], outs) -> dict:
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        prompt = sum(prompt_lens)
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}
        transfers = [o.kv_transfer for o in outs if o.kv_transfer is not None]
        if transfers:  # disaggregated serving: where the prompts were prefilled, and what moving their KV cost
            out["prompt_tokens_details"].update(
                prefilled_remotely=sum(t.prefilled_remotely for t in transfers),
                kv_transfer_bytes=sum(t.bytes for t in transfers),
                kv_transfer_seconds=round(sum(t.seconds for t in transfers), 6))
        cost = self.pricer.cost(outs)
        if cost is not None:  # OpenRouter's extension fields: `cost` in USD, with its parts
            out["cost"] = cost.total
            out["cost_details"] = {**cost.as_usage_details(), "basis": self.pricer.basis}
        return out

    def prompt_logprobs(self, prompt: list[int], logprobs: list[dict[int, float] | None] | None, k: int) -> list:
        """vLLM's prompt_logprobs field: per prompt token (the first has none: null), its own logprob and the top k,
        keyed by token id, each with its rank among them (1: the most likely; null for a token below the top k) and
        its text."""
        out: list = []
        for token, lp in zip(prompt, logprobs or [None] * len(prompt)):
            if lp is None:
                out.append(None)
                continue
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            rank = {t: r for r, (t, _) in enumerate(top, 1)}
            entries = dict(top)
            entries[token] = lp[token]
            out.append({str(t): {"logprob": v, "rank": rank.get(t), "decoded_token": self.token_str(t)}
                        for t, v in entries.items()})
        return out

    def token_str(self, t: int) -> str:
        if self.tokens_as_ids:  # a byte-level token may be half a character: its id says exactly which it is
            return f"token_id:{t}"
        return self.tok.decode([t], skip_special_tokens=False)

    def completion_logprobs(self, token_ids, logprobs, start_offset: int, prompt: tuple | None = None) -> dict:
        """/v1/completions' logprobs object; with `prompt` (its ids and logprobs, for echo) the prompt's come first."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start_offset
        entries = list(zip(prompt[0], prompt[1])) if prompt else []
        entries += list(zip(token_ids, logprobs))
        for t, lp in entries:
            s = self.token_str(t)
            tokens.append(s)
            token_lps.append(None if lp is None else lp[t])
            tops.append(None if lp is None else {self.token_str(k): v for k, v in lp.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, token_ids, logprobs, k: int) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            s = self.token_str(t)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": s, "logprob": lp[t], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.token_str(a), "logprob": b,
                                              "bytes": list(self.token_str(a).encode())} for a, b in top]})
        return {"content": content}

    async def stream(self, agen: AsyncIterator, make_chunks: Callable[[int, object], Iterable[dict]],
                     include_usage: bool, prompt_lens: list[int], base: dict, first_chunks=(),
                     continuous_usage: bool = False):
        """SSE events: `first_chunks`, then make_chunks' for each output of agen ((prompt index, RequestOutput)
        pairs), the usage if asked for, and [DONE]. After the first byte an error travels as an SSE event.
        continuous_usage (vLLM's continuous_usage_stats): every chunk carries the token counts so far."""
        finals = {}
        generated: dict[int, int] = {}  # per prompt: tokens generated so far, all its samples together
        prompt = sum(prompt_lens)
        continuous_usage = continuous_usage and include_usage
        event = sse_events(base, {"usage": None} if include_usage and not continuous_usage else {})

        def counted(chunk: dict) -> dict:
            done = sum(generated.values())
            return {**chunk, "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                       "total_tokens": prompt + done}}
        try:
            for chunk in first_chunks:
                yield event(counted(chunk) if continuous_usage else chunk)
            async for i, out in agen:
                if continuous_usage:
                    generated[i] = sum(len(c.token_ids) for c in out.outputs)
                for chunk in make_chunks(i, out):
                    yield event(counted(chunk) if continuous_usage else chunk)
                if out.finished:
                    finals[i] = out
            if include_usage:
                yield sse({**base, "choices": [], "usage": self.usage(prompt_lens, list(finals.values()))})
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - after the first byte, errors travel as an SSE event
            yield errors.sse_error(e)
        finally:
            await agen.aclose()
        yield "data: [DONE]\n\n"
