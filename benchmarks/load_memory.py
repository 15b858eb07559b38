"""Peak memory while loading a model: each configuration loaded by `LLM(...)` in a fresh process, its peak resident
memory (VmHWM) and resident memory once loaded (VmRSS) read from /proc, for two checkouts of llmserve side by side
(this one and --base-code, e.g. a worktree of the previous main), same run.

    git worktree add /tmp/base <previous main>
    .venv/bin/python benchmarks/load_memory.py --base-code /tmp/base

Models: the default GGUF (float32 with its int4 codes; bf16 where the CPU has fast bf16) and a random-weight
Llama-shaped Hugging Face folder of ~0.5 B parameters in bf16 safetensors (served in bf16, then with int4 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, sys
from llmserve import LLM
llm = LLM(**json.loads(sys.argv[1]))
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({k: int(status[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS")}))
"""


def make_folder(path: str) -> str:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                   num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path)
    return path


def measure(code: str, engine_args: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": code}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(engine_args)], capture_output=True, text=True,
                         env=env, cwd=code, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-code", required=True, help="a checkout of the llmserve to compare with")
    args = ap.parse_args()
    folder = make_folder(tempfile.mkdtemp(prefix="llmserve-load-"))
    common = {"device": "cpu", "kv_cache_memory": "32MiB"}
    configs = {
        "default GGUF, float32 (int4 codes)": {"dtype": "float32"},
        "default GGUF, bf16 (int4 codes)": {"dtype": "bfloat16"},
        "0.5B bf16 safetensors, bf16": {"model": folder, "dtype": "bfloat16"},
        "0.5B bf16 safetensors, bf16, int4": {"model": folder, "dtype": "bfloat16", "decode_quantization": "int4"},
    }
    rows = []
    for name, cfg in configs.items():
        base = measure(args.base_code, {**common, **cfg})
        new = measure(ROOT, {**common, **cfg})
        rows.append({"config": name, "base_peak_mib": base["VmHWM"] >> 20, "new_peak_mib": new["VmHWM"] >> 20,
                     "peak_ratio": round(new["VmHWM"] / base["VmHWM"], 2), "base_rss_mib": base["VmRSS"] >> 20,
                     "new_rss_mib": new["VmRSS"] >> 20})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
