"""Suffix proposer: frequency tables over this request's history and recent requests' outputs.

For every context of 1..depth tokens seen, count which token came next. To propose, take the longest
context matching the end of the sequence and follow its most frequent continuation, token by token,
while it stays likely enough. Recent requests' outputs make repeated answers (agents re-emitting the same
tool calls, templates) fast even when the current prompt does not contain them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class _Index:
    def __init__(self, depth: int):
        self.depth = depth
        self.next: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: list[int], start: int) -> None:
        """Index the continuations of positions start..len(tokens)-1."""
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            for d in range(1, min(self.depth, i) + 1):
                self.next.setdefault(tuple(tokens[i - d:i]), Counter())[nxt] += 1


class SuffixProposer:
    def __init__(self, depth: int = 8, min_probability: float = 0.1, max_recent_tokens: int = 200_000):
        self.depth = depth
        self.min_probability = min_probability
        self.requests: dict[str, tuple[_Index, int]] = {}  # request -> (index, tokens indexed)
        self.recent = _Index(depth)  # outputs of finished requests
        self.recent_outputs: OrderedDict[str, list[int]] = OrderedDict()
        self.recent_tokens = 0
        self.max_recent_tokens = max_recent_tokens

    def _index_for(self, request_id: str, tokens: list[int]) -> _Index:
        index, done = self.requests.get(request_id, (None, 0))
        if index is None:
            index = _Index(self.depth)
        index.add(tokens, done)
        self.requests[request_id] = (index, len(tokens))
        return index

    def propose(self, tokens: list[int], k: int, request_id: str) -> list[int]:
        if k < 1:
            return []
        own = self._index_for(request_id, tokens)
        out: list[int] = []
        ctx = list(tokens[-self.depth:])
        for _ in range(k):
            choice = None
            for d in range(min(self.depth, len(ctx)), 0, -1):
                key = tuple(ctx[-d:])
                counts = Counter(own.next.get(key, {})) + Counter(self.recent.next.get(key, {}))
                if counts:
                    token, n = counts.most_common(1)[0]
                    if n / sum(counts.values()) >= self.min_probability:
                        choice = token
                    break
            if choice is None:
                break
            out.append(choice)
            ctx.append(choice)
        return out

    def release(self, request_id: str, output_token_ids: list[int] | None = None) -> None:
        """A request ended: forget its own index, keep its output among the recent ones."""
        self.requests.pop(request_id, None)
        if output_token_ids:
            self.recent.add(output_token_ids, 0)
            self.recent_outputs[request_id] = list(output_token_ids)
            self.recent_tokens += len(output_token_ids)
            if self.recent_tokens > self.max_recent_tokens:  # rebuild from the newer half
                while self.recent_tokens > self.max_recent_tokens // 2:
                    _, old = self.recent_outputs.popitem(last=False)
                    self.recent_tokens -= len(old)
                self.recent = _Index(self.depth)
                for toks in self.recent_outputs.values():
                    self.recent.add(toks, 0)
