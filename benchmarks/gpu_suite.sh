#!/usr/bin/env bash
# The test suite on the lent GPU machine (issue 37: every test that can run on CUDA passes there), as a second call
# after benchmarks/gpu_run.sh: run(carry=[".whl"], timeout_s=280, command="bash benchmarks/gpu_suite.sh"). Engines
# in these tests pick CUDA (device auto) and its defaults: the Triton attention kernel and CUDA graphs. The default
# model's file cannot be brought there, so its tests skip (LLMSERVE_TESTS_WITHOUT_DEFAULT_MODEL=1); the files below
# are the ones that also test on tiny random-weight checkpoints. Writes $OUT/suite.log and $OUT/suite.xml.
source "$(dirname "$0")/gpu_env.sh"
export LLMSERVE_TESTS_WITHOUT_DEFAULT_MODEL=1
timeout "${SUITE_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 120 \
    --junitxml "$OUT/suite.xml" -m "not slow" \
    tests/test_cuda_graphs.py tests/test_triton_kernels.py tests/test_attention_backends.py tests/test_sampler.py \
    tests/test_kv_accounting.py tests/test_kv_fp8.py tests/test_prefix_cache.py tests/test_spec_decode.py \
    tests/test_deterministic.py tests/test_lora.py tests/test_executor.py tests/test_model_logits.py \
    tests/test_quantized_checkpoints.py \
    tests/test_async_scheduling.py tests/test_engine_process.py tests/test_platform_defaults.py \
    > "$OUT/suite.log" 2>&1
echo "suite exit $?" >> "$OUT/suite.log"
tail -15 "$OUT/suite.log"
