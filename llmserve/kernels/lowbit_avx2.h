// The float32 (AVX2) route of llmserve_kernels::lowbit_linear, built in lowbit_linear_avx2.cpp.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace llmserve_lowbit {

// Whether this build has the route (a CPU with AVX2, FMA and F16C, built with -march=native).
bool avx2_built();

// out [M, N] = x [M, K] (float32) times the weight in lowbit_linear's block layout; offsets null for 8-bit codes.
// int8_activations: x quantized to int8 per group of 32 and multiplied in integers (route "avx2_int8").
void lowbit_gemm_avx2(const float* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, int64_t N, float* out, bool int8_activations);

// out [M, N] = x [M, K] (float32) times a float32 weight packed as float_panel_linear expects ([N / 32][K / 2][64]:
// each 32-column work item's pairs of input columns, 8 vectors of 4 columns x 2 inputs). Every row is summed in the
// same order whatever M is (the batch-invariant float matmul of the deterministic mode).
void float_panel_gemm(const float* x, int64_t M, int64_t K, const float* panel, int64_t N, float* out);

}  // namespace llmserve_lowbit
