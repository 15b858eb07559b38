"""A Q4_K_M GGUF on CPU: --decode-quantization auto (each layer at its own precision: the Q4_K layers' codes in the
int4 kernel, Q6_K layers as int8) against `none` (every layer dequantized to the serving dtype: what auto gave such a
file before), each in a fresh process, same run: resident memory once loaded (with 64 MiB of KV cache), and batch-1 decode speed.

    .venv/bin/python benchmarks/gguf_kquants.py [--layers 24] [--json out.json]

No Q4_K_M file can be downloaded here and the gguf package cannot write K-quants, so the file is Llama-shaped
(hidden 1024, FFN 4096, 16 heads / 4 KV heads, ~0.5 B parameters, the default model's vocabulary and tokenizer) with
random codes and fixed block scales, its tensors typed as llama.cpp's Q4_K_M recipe types them: Q4_K, with attn_v
and ffn_down in Q6_K in half the layers and the (tied) embedding in Q6_K. Speed and memory do not depend on the codes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, sys, time
from llmserve import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], decode_quantization=args["mode"], max_model_len=512, kv_cache_memory="64MiB")
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
rss = int(status["VmRSS"].split()[0]) * 1024
prompt = {"prompt_token_ids": list(range(100, 116))}
def run(n):
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t
run(8)
rates = []
for _ in range(3):
    first, whole = run(1), run(129)
    rates.append(128 / (whole - first))
rates.sort()
print(json.dumps({"rss_bytes": rss, "decode_tok_s": rates[1],
                  "summary": llm.llm_engine.executor.info.weights.decode_quantization}))
"""


def q4_k_blocks(rows: int, cols: int, rng) -> np.ndarray:
    """Q4_K: 144-byte blocks of 256 columns: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of codes."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def q6_k_blocks(rows: int, cols: int, rng) -> np.ndarray:
    """Q6_K: 210-byte blocks of 256 columns: 192 bytes of codes, 16 int8 scales, d (float16)."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, 192:208] = rng.integers(1, 32, size=(blocks.shape[0], 16), dtype=np.uint8)
    blocks[:, 208:210] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_q4_k_m(path: str, layers: int, hidden: int = 1024, ffn: int = 4096, heads: int = 16, kv_heads: int = 4) -> str:
    import gguf

    from llmserve.loader import default_model_path
    from llmserve.loader.gguf import field_value

    source = gguf.GGUFReader(default_model_path())
    tokens = field_value(source, "tokenizer.ggml.tokens")
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 2048), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                       (w.add_file_type, gguf.LlamaFileType.MOSTLY_Q4_K_M)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field_value(source, "tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(field_value(source, "tokenizer.ggml.token_type"))
    w.add_token_merges(field_value(source, "tokenizer.ggml.merges"))
    w.add_bos_token_id(field_value(source, "tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field_value(source, "tokenizer.ggml.eos_token_id"))
    w.add_tensor("token_embd.weight", q6_k_blocks(len(tokens), hidden, rng), raw_dtype=Q.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    head_dim = hidden // heads
    for i in range(layers):
        more_bits = i % 2 == 0  # llama.cpp's Q4_K_M gives attn_v and ffn_down 6 bits in about half the layers
        for name, rows, cols, six in (("attn_q", hidden, hidden, False), ("attn_k", kv_heads * head_dim, hidden, False),
                                      ("attn_v", kv_heads * head_dim, hidden, more_bits),
                                      ("attn_output", hidden, hidden, False), ("ffn_gate", ffn, hidden, False),
                                      ("ffn_up", ffn, hidden, False), ("ffn_down", hidden, ffn, more_bits)):
            blocks, qtype = (q6_k_blocks, Q.Q6_K) if six else (q4_k_blocks, Q.Q4_K)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(rows, cols, rng), raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def measure(model: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"model": model, "mode": mode})],
                         capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = write_q4_k_m(os.path.join(tempfile.mkdtemp(prefix="llmserve-q4km-"), "q4_k_m.gguf"), args.layers)
    size = os.path.getsize(path)
    results = {"file_bytes": size}
    for mode in ("none", "auto"):
        results[mode] = measure(path, mode)
        print(mode, results[mode], flush=True)
    base, new = results["none"], results["auto"]
    print(f"file {size / 2**20:.0f} MiB; resident once loaded (64 MiB of KV cache): none {base['rss_bytes'] / 2**20:.0f} MiB, auto "
          f"{new['rss_bytes'] / 2**20:.0f} MiB ({new['rss_bytes'] / base['rss_bytes']:.2f}x); batch-1 decode: none "
          f"{base['decode_tok_s']:.1f} tok/s, auto {new['decode_tok_s']:.1f} tok/s "
          f"({new['decode_tok_s'] / base['decode_tok_s']:.2f}x)")
    if args.json:
        from common import write_json

        write_json(args.json, results)


if __name__ == "__main__":
    main()
