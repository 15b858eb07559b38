"""Loading GGUF files: seconds to build `LLM(model)` (after `import llmserve`), this checkout against another git
revision in the same run, each load in a fresh process, alternating which side goes first.

    .venv/bin/python benchmarks/gguf_load.py --base 805e514 [--rounds 3] [--json bench-results/gguf_load.json]

Files: the default model (SmolLM2-135M, Q4_1 with a Q8_0 embedding); the same weights as Q8_0 (quantized by the gguf
package); and a Q4_K_M-typed Llama of ~0.5 B parameters (benchmarks/gguf_kquants.py: Q4_K, with attn_v and ffn_down
in Q6_K in half the layers, the embedding in Q6_K; random codes: load time does not depend on them). Each side runs
with its own code on PYTHONPATH (the base checked out beside this one) and 64 MiB of KV cache, so that the KV pool's
allocation does not hide the weights' load. Also reported: resident memory once loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import checkout_beside, write_json
from gguf_kquants import write_q4_k_m

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
import llmserve
from llmserve import LLM
t = time.perf_counter()
llm = LLM(model=sys.argv[1], kv_cache_memory="64MiB", max_model_len=512)
seconds = time.perf_counter() - t
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({"seconds": seconds, "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
                  "code": llmserve.__file__}))
"""


def write_q8_0(path: str) -> str:
    """The default model's weights, every 2-D tensor as Q8_0 (what `llama-quantize ... Q8_0` makes of the model)."""
    import gguf
    import numpy as np

    from llmserve.loader import default_model_path
    from llmserve.loader.gguf import PlainViewReader

    source = PlainViewReader(default_model_path())
    arch = source.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = int(gguf.LlamaFileType.MOSTLY_Q8_0) if name == "general.file_type" else field.contents()
        writer.add_key_value(name, value, field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                             else None)
    for t in source.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.array(t.data))
            continue
        codes = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(t.name, codes, raw_shape=codes.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_once(checkout: str, model: str) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, cwd=checkout, env=env,
                         timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"].startswith(checkout), result["code"]  # each side ran its own code
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24, help="layers of the Q4_K_M file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from llmserve.loader import default_model_path

    base = str(checkout_beside(args.base))
    folder = tempfile.mkdtemp(prefix="gguf_load_")
    files = {"default (Q4_1)": default_model_path(),
             "default as Q8_0": write_q8_0(os.path.join(folder, "q8_0.gguf")),
             f"Q4_K_M, {args.layers} layers": write_q4_k_m(os.path.join(folder, "q4_k_m.gguf"), args.layers)}
    sides = {"base": base, "head": ROOT}
    results: dict = {}
    for round_ in range(args.rounds):
        for label, model in files.items():
            order = ["base", "head"] if round_ % 2 == 0 else ["head", "base"]
            for side in order:
                results.setdefault(label, {}).setdefault(side, []).append(load_once(sides[side], model))
    report = {"base": args.base, "rounds": args.rounds, "files": {}}
    for label, by_side in results.items():
        row = {side: {"seconds": statistics.median(r["seconds"] for r in runs),
                      "rss_mib": statistics.median(r["rss_mib"] for r in runs),
                      "all_seconds": [round(r["seconds"], 3) for r in runs]} for side, runs in by_side.items()}
        row["ratio_seconds"] = row["head"]["seconds"] / row["base"]["seconds"]
        row["ratio_rss"] = row["head"]["rss_mib"] / row["base"]["rss_mib"]
        report["files"][label] = row
        print(f"{label:24s} base {row['base']['seconds']:6.2f} s {row['base']['rss_mib']:7.0f} MiB | "
              f"head {row['head']['seconds']:6.2f} s {row['head']['rss_mib']:7.0f} MiB | "
              f"{row['ratio_seconds']:.2f}x time, {row['ratio_rss']:.2f}x memory")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
