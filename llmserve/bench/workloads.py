"""What a benchmark sends: sessions of one or more turns, built from a tokenizer, a dataset or a shape.

A session is the unit of load: one request for the synthetic, dataset and shared-prefix workloads,
several dependent turns for the multi-turn one (turn k+1 resends the history, the model's answers
included, so it can only start when turn k has finished).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from llmserve.errors import InvalidRequestError


@dataclass
class Turn:
    max_tokens: int
    prompt: str | None = None  # completions endpoint
    messages: list[dict] | None = None  # chat endpoint; for multi-turn, only this turn's new user message
    input_tokens: int | None = None  # as built here (before any chat template)


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None  # multi-turn: a system message that opens the history
    tags: dict = field(default_factory=dict)  # e.g. which shared prefix a request used


class WordSource:
    """Draws text of an exact token length: whole-word vocabulary entries (" word") re-tokenize one-to-one."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        words = []
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.decode([i], skip_special_tokens=False)
            if len(piece) >= 4 and piece[0] == " " and piece[1:].isascii() and piece[1:].isalpha() and piece[1:].islower():
                words.append(piece)
        if len(words) < 100:
            raise InvalidRequestError("this tokenizer has too few whole-word tokens to build synthetic prompts; use --dataset", "tokenizer")
        self.words = words

    def text(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        for _ in range(20):
            text = "".join(self.rng.choice(self.words) for _ in range(num_tokens))
            if len(self.tokenizer.encode(text, add_special_tokens=False)) == num_tokens:
                return text
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]  # rare merges across words: cut to length
        return self.tokenizer.decode(ids)

    def length(self, mean: int, range_ratio: float) -> int:
        lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
        return max(1, self.rng.randint(lo, hi)) if hi > lo else max(1, mean)


def synthetic(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int, chat: bool) -> list[Session]:
    src = WordSource(tokenizer, seed)
    sessions = []
    for _ in range(num):
        n_in, n_out = src.length(input_len, range_ratio), src.length(output_len, range_ratio)
        sessions.append(Session([_turn(src.text(n_in), n_out, n_in, chat)]))
    return sessions


def shared_prefix(tokenizer, num_prefixes: int, questions_per_prefix: int, prefix_len: int, question_len: int,
                  output_len: int, seed: int, chat: bool) -> list[Session]:
    """P system prompts x Q questions each, shuffled: the prefix-caching workload."""
    src = WordSource(tokenizer, seed)
    sessions = []
    for p in range(num_prefixes):
        system = src.text(prefix_len)
        for _ in range(questions_per_prefix):
            question = src.text(question_len)
            if chat:
                turn = Turn(output_len, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                            input_tokens=prefix_len + question_len)
            else:
                turn = Turn(output_len, prompt=system + question, input_tokens=prefix_len + question_len)
            sessions.append(Session([turn], tags={"prefix": p}))
    random.Random(seed).shuffle(sessions)
    return sessions


def multi_turn(tokenizer, num_sessions: int, turns: int, system_len: int, user_len: int, output_len: int, seed: int) -> list[Session]:
    """Agent-like sessions: every turn resends the whole history, so most of each prompt was seen before."""
    src = WordSource(tokenizer, seed)
    return [Session([Turn(output_len, messages=[{"role": "user", "content": src.text(user_len)}], input_tokens=user_len)
                     for _ in range(turns)], system=src.text(system_len) if system_len else None)
            for _ in range(num_sessions)]


def _turn(text: str, max_tokens: int, input_tokens: int | None, chat: bool) -> Turn:
    if chat:
        return Turn(max_tokens, messages=[{"role": "user", "content": text}], input_tokens=input_tokens)
    return Turn(max_tokens, prompt=text, input_tokens=input_tokens)


def from_jsonl(path: str, output_len: int) -> list[Session]:
    """One request per line: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens" (or "output_len").

    A line with "turns": [{"messages"|"prompt": ..., "max_tokens": ...}, ...] is a multi-turn session.
    """
    sessions = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InvalidRequestError(f"cannot read dataset {path}: {e.strerror}", "dataset") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{where}: not valid JSON ({e.msg})", "dataset") from None
            if not isinstance(row, dict):
                raise InvalidRequestError(f"{where}: expected a JSON object", "dataset")
            if "turns" in row:
                if not isinstance(row["turns"], list) or not row["turns"]:
                    raise InvalidRequestError(f"{where}: \"turns\" must be a non-empty list", "dataset")
                sessions.append(Session([_row_turn(t, where, output_len) for t in row["turns"]], system=row.get("system")))
            else:
                sessions.append(Session([_row_turn(row, where, output_len)]))
    if not sessions:
        raise InvalidRequestError(f"dataset {path} has no requests", "dataset")
    return sessions


def _row_turn(row, where: str, output_len: int) -> Turn:
    if not isinstance(row, dict):
        raise InvalidRequestError(f"{where}: each turn must be a JSON object", "dataset")
    max_tokens = row.get("max_tokens", row.get("output_len", output_len))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequestError(f"{where}: max_tokens must be a positive integer", "dataset")
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return Turn(max_tokens, prompt=row["prompt"])
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return Turn(max_tokens, messages=messages)
    raise InvalidRequestError(f"{where}: needs a non-empty \"prompt\" string or a \"messages\" list of {{role, content}}", "dataset")
