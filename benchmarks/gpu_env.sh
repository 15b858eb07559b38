# Sourced by benchmarks/gpu_run.sh and gpu_suite.sh on the lent GPU machine: from the repository root, with $OUT
# made, the carried wheels (.whl/, from scripts/device_wheels.sh) installed beside the machine's own packages and on
# PYTHONPATH with this checkout.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD
