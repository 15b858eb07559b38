// The int8 route for bf16 activations of llmserve_kernels::lowbit_linear, built in lowbit_linear_vnni.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace llmserve_lowbit {

// Whether this build has the route (a CPU with AVX512-VNNI and AVX512-BF16, built with -march=native).
bool vnni_built();

// out [M, N] = x [M, K] (bf16, quantized here to int8 per group of 32) times 4-bit codes in lowbit_linear's block
// layout (route "avx512_int8").
void lowbit_gemm_vnni(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, int64_t N, at::BFloat16* out);

}  // namespace llmserve_lowbit
