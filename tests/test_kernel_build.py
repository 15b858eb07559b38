"""Building native extensions: a build killed half-way never blocks the next start, a start that waits on another
process's build says so, and the same sources at another path reuse one build. A tiny extension stands in for the
kernels (the same code path builds them), in a fresh extensions folder."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmserve.kernels.build import build_key

SOURCE = """
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor add_one(const at::Tensor& x) { return x + 1; }
TORCH_LIBRARY(llmserve_build_test, m) { m.def("add_one", &add_one); }
"""
LOADER = """
import sys, torch
from pathlib import Path
from llmserve.kernels.build import load_extension
load_extension("llmserve_build_test", [Path(sys.argv[1])], [], ["-O0"], "the test extension")
print(torch.ops.llmserve_build_test.add_one(torch.zeros(2)).tolist())
"""
CFLAGS = ["-O0"]


@pytest.fixture
def setup(tmp_path):
    source = tmp_path / "src" / "add_one.cpp"
    source.parent.mkdir()
    source.write_text(SOURCE)
    ext = tmp_path / "ext"
    return source, ext, {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}


def _load(source: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOADER, str(source)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_killed_build_does_not_block_the_next_and_other_paths_reuse_it(setup, tmp_path):
    source, ext, env = setup
    first = subprocess.Popen([sys.executable, "-c", LOADER, str(source)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(ext.glob("*.build-*/src")) and time.monotonic() < deadline:  # the compiler is about to start
        time.sleep(0.05)
    time.sleep(1.0)
    first.kill()  # as Ctrl-C or an OOM kill would stop it, mid-build
    first.wait()
    assert list(ext.glob("*.lock")), "the killed build should have left its lock behind"

    started = time.monotonic()
    second = _load(source, env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[1.0, 1.0]"
    assert "llmserve: building the test extension (once per machine and version" in second.stderr
    assert not list(ext.glob("*.lock")) and not list(ext.glob("*.build-*"))  # nothing left to trip over

    elsewhere = tmp_path / "checkout" / "add_one.cpp"  # the same source imported from another path
    elsewhere.parent.mkdir()
    elsewhere.write_text(SOURCE)
    third = _load(elsewhere, env, timeout=60)
    assert third.returncode == 0 and third.stdout.strip() == "[1.0, 1.0]"
    assert "building" not in third.stderr  # reused, not rebuilt
    assert time.monotonic() - started < 600


def test_a_start_waiting_on_another_build_says_on_whom(setup):
    source, ext, env = setup
    ext.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a live builder
    try:
        name = f"llmserve_build_test_{build_key([source], [], CFLAGS)}"
        (ext / f"{name}.lock").write_text(f"{socket.gethostname()} {holder.pid}")
        waiter = subprocess.Popen([sys.executable, "-c", LOADER, str(source)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        said, deadline = "", time.monotonic() + 60
        while f"waiting for process {holder.pid}" not in said and time.monotonic() < deadline:
            ready, _, _ = select.select([waiter.stderr], [], [], 1.0)
            if ready:
                said += waiter.stderr.readline()
        assert f"waiting for process {holder.pid}, which is building the test extension" in said
        assert waiter.poll() is None  # still waiting while the owner lives
    finally:
        holder.kill()
        holder.wait()
    try:  # the owner is gone: its lock is stale, and the waiter builds (to the end in the test above)
        deadline = time.monotonic() + 120
        while "llmserve: building the test extension" not in said and time.monotonic() < deadline:
            ready, _, _ = select.select([waiter.stderr], [], [], 1.0)
            if ready:
                line = waiter.stderr.readline()
                assert line or waiter.poll() is None, said
                said += line
        assert "llmserve: building the test extension" in said, said
    finally:
        waiter.kill()
        waiter.wait()
