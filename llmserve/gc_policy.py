"""When Python's cyclic garbage collector runs in llmserve's processes.

Two costs, both measured under load (docs/benchmarks.md, "Garbage collection in the server's processes"):
- Young-generation passes. Python makes one every 700 container allocations (its default), and a step over hundreds
  of sequences allocates thousands (rows, outputs, token lists): at 256 sequences those passes took ~10 % of a step.
- Full passes. They traverse every object the process holds, and a process that has imported torch, transformers and
  FastAPI holds a few hundred thousand: each pass stopped the server's process for ~140 ms, every few seconds at
  256 streams, and all its streams with it.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # container allocations between young-generation passes (Python's default: 700)


def collect_less_often() -> None:
    """Fewer young-generation passes, where the threshold is still Python's default. Safe in a user's process (the
    offline `LLM`): cyclic garbage is still collected, a little later."""
    young, middle, old = gc.get_threshold()
    if young == 700:
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def freeze_startup_heap() -> None:
    """For a process that llmserve owns (the server's, the engine's, a tensor-parallel rank's), once it has started:
    what start-up built (modules, the model, the tokenizer, the app) lives as long as the process, so it moves to
    the collector's permanent generation and full passes stop traversing it. vLLM freezes its processes' heaps the
    same way. Not for a library's caller: cyclic garbage frozen there would never be collected."""
    collect_less_often()
    gc.collect()
    gc.freeze()
