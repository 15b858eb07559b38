"""What the benchmark scripts share: a call's median time, writing a result file, and building the native kernels
of another git revision beside the working tree's."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median wall time of `repeats` calls of fn, after `warmup` untimed ones (caches, lazy builds, allocator)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_json(path: str | None, data: Any, indent: int = 1) -> None:
    """Writes data to path as JSON, creating its folder; nothing when no path was asked for."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)


def checkout_beside(rev: str) -> Path:
    """The git revision checked out outside the repository (a worktree in the temp folder), made once. Named by its
    commit, not by what was typed: a worktree left from another day's `HEAD` holds another commit."""
    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"llmserve-ab-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(path), commit], check=True)
    return path


def build_kernel_revision(rev: str, sources: list[str], namespace: str) -> str:
    """Builds the revision's llmserve/kernels `sources` (with its headers) with the working tree's flags, their ops
    registered as torch.ops.<namespace> instead of llmserve_kernels, so that both can be timed in one process.
    Returns the revision's short hash."""
    from torch.utils import cpp_extension

    from llmserve import kernels

    repo = Path(kernels.__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout

    folder = Path(tempfile.mkdtemp(prefix=f"{namespace}_"))
    for path in git("ls-tree", "--name-only", rev, "llmserve/kernels/").split():
        name = Path(path).name
        if name.endswith(".h") or name in sources:
            text = git("show", f"{rev}:{path}")
            text = re.sub(r"TORCH_LIBRARY(_IMPL|_FRAGMENT)?\(llmserve_kernels", rf"TORCH_LIBRARY\1({namespace}", text)
            (folder / name).write_text(text)
    digest = git("rev-parse", "--short", rev).strip()
    cpp_extension.load(name=f"{namespace}_{digest}_{kernels._cpu_tag()}", sources=[str(folder / s) for s in sources],
                       extra_cflags=kernels.CFLAGS, is_python_module=False)
    return digest


def engine_steps_ab(batch: int, op_name: str, other, digest: str, rounds: int = 6, per_round: int = 7) -> dict:
    """Whole eager decode steps of the default model on the same requests, torch.ops.llmserve_kernels.<op_name>
    being the working tree's kernel and `other` (another revision's build of it) in turn: `batch` 200-token prompts
    prefilled, then the median of `rounds` rounds x `per_round` steps each way. Eager steps look the op up on every
    call, so swapping the attribute swaps the kernel."""
    import torch

    from llmserve import LLM, SamplingParams

    namespace = torch.ops.llmserve_kernels
    ops = {"current": getattr(namespace, op_name), "other": other}
    llm = LLM(max_num_seqs=batch)
    engine = llm.engine
    base = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40)[:200]
    for i in range(batch):
        engine.add_request(f"r{i}", [(t + i) % 5000 + 100 for t in base],
                           SamplingParams(temperature=0, max_tokens=10 + rounds * 2 * (per_round + 1), ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    times = {which: [] for which in ops}
    try:
        for rnd in range(rounds):
            for which in ("current", "other")[:: 1 if rnd % 2 else -1]:
                setattr(namespace, op_name, ops[which])
                engine.step()
                for _ in range(per_round):
                    t = time.perf_counter()
                    engine.step()
                    times[which].append((time.perf_counter() - t) * 1e3)
    finally:
        setattr(namespace, op_name, ops["current"])
    ms = {which: statistics.median(ts) for which, ts in times.items()}
    row = {"batch": batch, "current_step_ms": ms["current"], f"{digest}_step_ms": ms["other"],
           "ratio": ms["other"] / ms["current"]}
    print(f"decode steps of {batch:>3} rows: working tree {ms['current']:7.2f} ms  {digest} {ms['other']:7.2f} ms"
          f"  ratio {row['ratio']:.3f}", flush=True)
    return row
