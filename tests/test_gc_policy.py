"""The garbage collector's settings: a library caller's are left alone; processes llmserve owns freeze their start-up
heap (gc_policy.py; what it buys is in docs/benchmarks.md, "Garbage collection in the server's processes")."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_an_engine_in_a_users_process_keeps_their_collector_settings_and_freezes_nothing(default_gguf):
    out = run_python(f"""
        import gc
        from llmserve import LLM, SamplingParams
        gc.set_threshold(500, 5, 5)  # the user's own choice
        llm = LLM({default_gguf!r}, kv_cache_memory="16MiB")
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        print(gc.get_threshold(), gc.get_freeze_count())
    """)
    assert out == "(500, 5, 5) 0"


def test_python_defaults_are_raised_and_a_frozen_heap_is_skipped_by_full_passes():
    out = run_python("""
        import gc
        from llmserve.gc_policy import YOUNG_THRESHOLD, collect_less_often, freeze_startup_heap
        assert gc.get_threshold()[0] == 700
        collect_less_often()
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        startup = [[i] for i in range(50_000)]  # what start-up built
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= 50_000, frozen
        garbage = []
        garbage.append(garbage)  # a cycle made after start-up is still collected
        del garbage
        print(gc.collect() >= 1)
    """)
    assert out == "True"
