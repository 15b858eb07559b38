#!/usr/bin/env bash
# Prepares what a run on the lent GPU machine needs and cannot fetch there (it has no internet): wheels of llmserve's
# dependencies missing from its image (torch, transformers, triton, tokenizers, httpx, jinja2, aiohttp and
# prometheus-client are there), at the versions this venv holds, and the default model's tokenizer as a folder. All
# in .whl/, which git ignores locally and the device call carries: run(carry=[".whl"], command="bash
# benchmarks/gpu_run.sh").
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# openai and what it needs beyond the image (the server tests in gpu_suite.sh import it): httpx2, httpcore2, ...
for pkg in gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn \
           llguidance jsonschema jsonschema-specifications referencing rpds-py python-multipart compressed-tensors loguru \
           openai httpx2 httpcore2 truststore jiter sniffio anyio idna h11; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
        -d .whl "$pkg==$(version "$pkg")"
done
.venv/bin/python benchmarks/gpu_bench.py --make-tokenizer .whl/smollm2-tokenizer
du -sh .whl
