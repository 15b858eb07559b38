"""Load shapes: fixed concurrency, or Poisson/gamma arrivals at a rate (optionally capped), swept over levels."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

from tqdm import tqdm

from llmserve.bench.backends import RequestRecord
from llmserve.bench.metrics import SLO, summarize
from llmserve.bench.workloads import Session


@dataclass(frozen=True)
class LoadLevel:
    concurrency: int | None = None  # most sessions in flight; None = no cap
    request_rate: float = math.inf  # sessions started per second; inf = as fast as the cap allows
    burstiness: float = 1.0  # gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier

    @property
    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if not math.isinf(self.request_rate):
            parts.append(f"rate {self.request_rate:g}/s" + (f" burstiness {self.burstiness:g}" if self.burstiness != 1 else ""))
        return ", ".join(parts) or "all at once"

    def as_dict(self) -> dict:
        return {"concurrency": self.concurrency, "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
                "burstiness": self.burstiness}


def arrival_offsets(n: int, level: LoadLevel, seed: int) -> list[float]:
    """Start times in seconds; gamma(shape=burstiness, mean=1/rate) gaps, as vLLM's benchmark draws them."""
    if math.isinf(level.request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (level.request_rate * level.burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(level.burstiness, theta)
    return out


async def run_sessions(backend, sessions: list[tuple[int, Session]], offsets: list[float], concurrency: int | None,
                       duration_limit: float | None, clock: Callable[[], float], bar=None) -> list[RequestRecord]:
    """Sends each (index, session) at its offset on `clock`, at most `concurrency` sessions at a time; every request's
    record, in the order they were made."""
    records: list[RequestRecord] = []
    cap = asyncio.Semaphore(concurrency) if concurrency else None

    def advance(n: int) -> None:
        if bar is not None:
            bar.update(n)

    async def run_session(i: int, s: Session) -> None:
        history: list[dict] = [{"role": "system", "content": s.system}] if s.system else []
        history_text = ""
        for t, turn in enumerate(s.turns):
            rec = RequestRecord(index=len(records), session=i, turn=t)
            records.append(rec)
            if turn.messages is not None:
                messages = history + turn.messages if len(s.turns) > 1 or s.system else turn.messages
                await backend.send(rec, None, messages, turn.max_tokens, clock)
                history = messages + [{"role": "assistant", "content": rec.text}]
            else:
                prompt = history_text + turn.prompt
                await backend.send(rec, prompt, None, turn.max_tokens, clock)
                history_text = prompt + rec.text
            advance(1)
            if rec.status != "ok":
                advance(len(s.turns) - t - 1)
                return

    async def launch(i: int, s: Session, at: float) -> None:
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if duration_limit is not None and clock() >= duration_limit:
            advance(len(s.turns))
            return
        if cap is None:
            await run_session(i, s)
            return
        async with cap:
            if duration_limit is not None and clock() >= duration_limit:
                advance(len(s.turns))
                return
            await run_session(i, s)

    await asyncio.gather(*(launch(i, s, at) for (i, s), at in zip(sessions, offsets)))
    return records


async def run_level(backend, sessions: list[Session], level: LoadLevel, slo: SLO, duration_limit: float | None = None,
                    seed: int = 0, progress: bool = True, count_tokens: Callable[[str], int] | None = None,
                    clients: ClientProcesses | None = None) -> dict:
    """Runs the sessions under one load level; returns the summary and every request's record.

    count_tokens covers servers that send no usage: output tokens are then counted from the text. clients: client
    processes to share the sessions out to (this process then only waits for their records).
    """
    offsets = arrival_offsets(len(sessions), level, seed)
    spec_before = await backend.spec_counters()
    indexed = list(enumerate(sessions))
    started = time.perf_counter()
    if clients is not None and clients.count > 1:
        records = await clients.run(indexed, offsets, level.concurrency, duration_limit)
    else:
        bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=level.label, unit="req", disable=not progress,
                   leave=False)
        records = await run_sessions(backend, indexed, offsets, level.concurrency, duration_limit,
                                     lambda: time.perf_counter() - started, bar)
        bar.close()
    spec_after = await backend.spec_counters()
    if count_tokens is not None:
        for rec in records:
            if rec.status == "ok" and rec.output_tokens is None:
                rec.output_tokens = count_tokens(rec.text)
                rec.input_tokens = sessions[rec.session].turns[rec.turn].input_tokens
    duration = max((r.done for r in records if r.done is not None), default=time.perf_counter() - started)
    first = min((r.sent for r in records), default=0.0)
    records.sort(key=lambda r: r.sent)
    summary = summarize(records, duration - first, slo)
    if spec_before is not None and spec_after is not None:
        summary.update(spec_summary(spec_before, spec_after))
    return {"load": level.as_dict(), "label": level.label, "summary": summary,
            "requests": [_record_dict(r, first) for r in records]}


class ClientProcesses:
    """Client processes that share each level's sessions (`llmserve bench --client-processes N`). One process's event
    loop can stream and stamp only so many chunks a second (~30,000 tokens/s on a recent core, docs/benchmarks.md);
    past that the client, not the server, would be measured. Each process gets every Nth session with its own
    arrival time, and 1/N of the concurrency cap; all start the level at the same wall-clock instant, so their
    records share one clock. Started once per sweep; each keeps its connections and event loop between levels."""

    def __init__(self, count: int, backend_args: tuple):
        import multiprocessing

        self.count = count
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._processes = [], []
        for k in range(count):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_client_process, args=(theirs, backend_args), name=f"llmserve-bench-client-{k}",
                                  daemon=True)
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._processes.append(process)
        for conn in self._conns:
            reply = self._recv(conn)
            if isinstance(reply, BaseException):
                self.close()
                raise reply

    def _recv(self, conn):
        try:
            return conn.recv()
        except EOFError:
            raise RuntimeError("a benchmark client process exited") from None

    async def run(self, sessions: list[tuple[int, Session]], offsets: list[float], concurrency: int | None,
                  duration_limit: float | None) -> list[RequestRecord]:
        n = min(self.count, concurrency or self.count)  # no more processes than places: each needs one of its own
        start_at = time.time() + 0.2  # the processes read their share and wait for the same instant
        for k, conn in enumerate(self._conns):
            cap = None if concurrency is None else max(1, concurrency // n + (k < concurrency % n))
            share = (sessions[k::n], offsets[k::n]) if k < n else ([], [])
            conn.send((*share, cap, duration_limit, start_at))
        loop = asyncio.get_running_loop()
        shares = await asyncio.gather(*(loop.run_in_executor(None, self._recv, conn) for conn in self._conns))
        records = [rec for share in shares for rec in share]
        for k, rec in enumerate(records):
            rec.index = k
        return records

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _client_process(conn, backend_args: tuple) -> None:
    """One client process: its own HTTP backend and event loop; runs each share it is sent, sends back the records."""
    from llmserve.bench.backends import HTTPBackend
    from llmserve.gc_policy import freeze_startup_heap

    async def main() -> None:
        backend = HTTPBackend(*backend_args)
        try:
            await backend.start()
        except BaseException as e:  # noqa: BLE001 - reported by the parent
            conn.send(e)
            return
        freeze_startup_heap()  # as the main process does: full collections would stall its streams (gc_policy.py)
        conn.send("ready")
        loop = asyncio.get_running_loop()
        try:
            while (order := await loop.run_in_executor(None, conn.recv)) is not None:
                sessions, offsets, concurrency, duration_limit, start_at = order
                await asyncio.sleep(max(0.0, start_at - time.time()))
                t0 = time.perf_counter() - (time.time() - start_at)  # this process's clock starts at start_at
                conn.send(await run_sessions(backend, sessions, offsets, concurrency, duration_limit,
                                             lambda: time.perf_counter() - t0))
        finally:
            await backend.close()

    event_loop_runner()(main())


def event_loop_runner():
    """uvloop's where uvicorn[standard] brought it (not on Windows), as the server runs: hundreds of streams are mostly
    the event loop's work, and uvloop's costs less CPU per chunk (docs/benchmarks.md, "The benchmark's client")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return getattr(uvloop, "run", asyncio.run)  # uvloop.run: 0.18 and later


def spec_summary(before: dict, after: dict) -> dict:
    """Speculative decoding over the level: acceptance rate, mean accepted length (accepted drafts + 1 per round)."""
    drafts = after["drafts"] - before["drafts"]
    proposed = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = {p: after["per_position"].get(p, 0) - before["per_position"].get(p, 0) for p in after["per_position"]}
    return {
        "spec_drafts": drafts, "spec_draft_tokens": proposed, "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / proposed if proposed else None,
        "spec_mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "spec_acceptance_per_position": {p: v / drafts for p, v in sorted(per_pos.items(), key=lambda kv: int(kv[0]))} if drafts else None,
    }


def _record_dict(r: RequestRecord, first: float) -> dict:
    d = asdict(r)
    d.pop("text")
    d["sent"] -= first
    d["done"] = None if r.done is None else r.done - first
    d["chunk_times"] = [t - first for t in r.chunk_times]
    d.update(ttft=r.ttft, ttfvt=r.ttfvt, tpot=r.tpot, e2e=r.e2e)
    return d


async def run_sweep(backend, make_sessions: Callable[[int], list[Session]], levels: list[LoadLevel], slo: SLO,
                    warmup: int, duration_limit: float | None, seed: int, progress: bool = True, on_level=None,
                    count_tokens: Callable[[str], int] | None = None, clients: ClientProcesses | None = None) -> list[dict]:
    """Warm-up requests first (not counted, from this process), then each level with fresh sessions from
    make_sessions(level index), from the client processes if given."""
    if warmup:
        warm = make_sessions(-1)[:warmup]
        await run_level(backend, warm, LoadLevel(concurrency=max(1, min(warmup, levels[0].concurrency or warmup))), SLO(),
                        progress=False)
    results = []
    for k, level in enumerate(levels):
        result = await run_level(backend, make_sessions(k), level, slo, duration_limit, seed + k, progress, count_tokens,
                                 clients)
        results.append(result)
        if on_level:
            on_level(result)
    return results
