"""The GPU machine is lent for 15 minutes now and then, so its one prepared script must not fail there on something a
CPU run would have caught: benchmarks/gpu_bench.py's own path (a tokenizer folder from the default GGUF, a
random-weight folder built in memory and handed to the engine, the batch-1 and throughput figures, the JSON) runs
here in miniature on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_bench_runs_in_miniature_on_the_cpu(tmp_path):
    def run(*args):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), *args], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stdout + r.stderr

    run("--make-tokenizer", str(tmp_path / "tokenizer"))
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    run("--tokenizer", str(tmp_path / "tokenizer"), "--shapes", "tiny", "--device", "cpu", "--skip-transformers",
        "--serving-shape", "", "--variants", "", "--deterministic-shape", "", "--profile-shape", "",
        "--num-prompts", "4", "--prompt-len", "16", "--output-len", "8", "--kv-cache-memory", "32MiB",
        "--api-servers", "0", "--json", str(tmp_path / "gpu_bench.json"))
    shape = json.loads((tmp_path / "gpu_bench.json").read_text())["shapes"]["tiny"]
    assert "error" not in shape, shape
    assert shape["llmserve_batch1_tok_s"] > 0 and shape["llmserve_throughput_tok_s"] > 0
