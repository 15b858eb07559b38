#!/usr/bin/env bash
# The one prepared call on the lent GPU machine (issues 37 and 42). Here first: bash scripts/device_wheels.sh; then
# run(carry=[".whl"], timeout_s=600, command="bash benchmarks/gpu_run.sh"). Writes to $OUT: the Triton kernels' and
# the CUDA graphs' tests run natively on the GPU (bf16 included), then benchmarks/gpu_bench.py's figures (JSON,
# rewritten as it goes, so a run cut off by its time limit keeps what it measured; pass e.g. --shapes llama-3.1-8b
# to a second call for the rest).
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${TEST_SECONDS:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
echo "tests exit $?" >> "$OUT/tests.log"
timeout "${BENCH_SECONDS:-400}" python3 benchmarks/gpu_bench.py --tokenizer .whl/smollm2-tokenizer \
    --json "$OUT/gpu_bench.json" "$@" > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench exit $?" >> "$OUT/gpu_bench.log"
tail -3 "$OUT/tests.log" "$OUT/gpu_bench.log"
