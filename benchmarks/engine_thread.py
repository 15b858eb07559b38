"""Decode step time depending on which thread steps the engine.

    .venv/bin/python benchmarks/engine_thread.py

Why the server loads the model inside its engine thread (llmserve/server/async_engine.py): on CPU,
stepping torch from a thread other than the first one that ran torch ops was much slower. Cases 1 and 2
share one process and engine; case 3 is a fresh process whose main thread never runs torch.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from llmserve import LLM, SamplingParams


def decode_ms(engine, tag: str) -> float:
    tok = engine.tokenizer
    engine.add_request(tag, tok.encode("the quick brown fox " * 50)[:200], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    t, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    return (time.perf_counter() - t) / n * 1000


def in_thread(fn):
    box = {}
    th = threading.Thread(target=lambda: box.update(value=fn()))
    th.start()
    th.join()
    return box["value"]


def main():
    llm = LLM()
    same = decode_ms(llm.engine, "main")
    other = in_thread(lambda: decode_ms(llm.engine, "other-thread"))
    own = float(subprocess.run([sys.executable, __file__, "--fresh-thread"], capture_output=True, text=True, check=True).stdout)
    print(f"loaded and stepped in the main thread:                       {same:.1f} ms/step")
    print(f"loaded in main, stepped in another thread:                   {other:.1f} ms/step ({other / same:.2f}x)")
    print(f"fresh process, loaded and stepped in one non-main thread:    {own:.1f} ms/step ({own / same:.2f}x)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--fresh-thread"]:
        print(in_thread(lambda: decode_ms(LLM().engine, "loaded-in-thread")))
    else:
        main()
