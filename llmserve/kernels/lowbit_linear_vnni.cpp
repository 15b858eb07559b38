// The low-bit matmul's int8 route for bf16 activations on CPUs with AVX512-VNNI (AMD Zen 4, Intel since Ice Lake):
// route "avx512_int8", 4-bit codes only. As on the AVX2 int8 route (lowbit_linear_avx2.cpp), each row's activations
// are quantized to int8 per group of 32 (step = max |x| / 127) and multiplied against the bare codes in integers:
// one vpdpbusd sums 64 products (16 columns x 4 inputs), twice vdpbf16ps's 32, and no bf16 weight is ever built.
// Per group and column the integer sum becomes float once: sum * scale * step + offset * (the group's float sum of x).
//
// In the layout, byte j of a 4-bit tile's 32-byte chunk i holds column j / 2 and inputs 4i + j % 2 (low nibble) and
// 4i + 2 + j % 2 (high nibble). Widening the chunk's bytes to 16 bits and moving each high nibble into the upper byte
// puts column c's four inputs in lane c, in the order 4i, 4i + 2, 4i + 1, 4i + 3: the activations are stored in that
// order when they are quantized, so the columns come out in their natural order.

#include "lowbit_vnni.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>

namespace llmserve_lowbit {
namespace {

constexpr int64_t kGroup = 32;      // input columns per group
constexpr int64_t kBlockN = 32;     // output columns per work item: two tiles of 16
constexpr int64_t kTileBytes = 256; // 16 columns x 32 inputs, 4 bits each
constexpr int kRows = 12;           // rows per pass: an int32 and a float32 accumulator each, of 32 registers

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

// bf16 x 16 to float32.
inline __m512 load_bf16x16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One row: q [K] int8 (each 4 inputs in the order 0, 2, 1, 3), step [K / 32] and sum [K / 32] (the group's float
// sum, for the offsets).
void quantize_row(const at::BFloat16* x, int64_t K, int8_t* q, float* step, float* sum) {
  const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const __m512 v0 = load_bf16x16(x + g * kGroup), v1 = load_bf16x16(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    step[g] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // cvtps rounds to nearest even; |x| * 127 / max|x| stays within 127.
    const __m128i b0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)));
    const __m128i b1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm_shuffle_epi8(b0, order));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm_shuffle_epi8(b1, order));
  }
}

// Chunk i of a tile as 64 unsigned bytes, column c's four inputs in lane c.
inline __m512i chunk_codes(const uint8_t* tile, int i) {
  const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * i)));
  // (wide | wide << 4) & 0x0F0F: the low nibble in the low byte, the high one in the high byte
  return _mm512_ternarylogic_epi32(wide, _mm512_slli_epi16(wide, 4), _mm512_set1_epi16(0x0F0F), 0xA8);
}

// A work item's codes as chunk_codes gives them, [group][tile][chunk][64 bytes]: steps of more than one pass build
// them once and every pass reads them.
void expand_item(const uint8_t* codes, int64_t groups, uint8_t* panel) {
  for (int64_t j = 0; j < groups * 2; ++j)
    for (int i = 0; i < 8; ++i)
      _mm512_store_si512(panel + (j * 8 + i) * 64, chunk_codes(codes + j * kTileBytes, i));
}

// R rows (R <= kRows) against one work item, tile by tile: each tile's float sums stay in registers over the whole
// input. The integer sums are exact and each row is turned into floats the same way whatever R is, so a row's
// result does not depend on its step's size.
// `panel`: the item's codes from expand_item, or null to expand each chunk here (the same bytes).
template <int R>
void int8_pass(const int8_t* q, const float* step, const float* sum, int64_t K, const uint8_t* codes,
               const uint8_t* panel, const at::Half* scales, const at::Half* offsets, at::BFloat16* out, int64_t N) {
  const int64_t groups = K / kGroup;
  for (int t = 0; t < 2; ++t) {
    __m512 f[R];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* tile = codes + (g * 2 + t) * kTileBytes;
      __m512i s[R];
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 1  // as on the AVX2 route: unrolled, the chunks' codes would be built first and spilled
      for (int i = 0; i < 8; ++i) {
        const __m512i w = panel ? _mm512_load_si512(panel + ((g * 2 + t) * 8 + i) * 64) : chunk_codes(tile, i);
        const int8_t* qi = q + g * kGroup + 4 * i;
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, qi + r * K, 4);
          s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(four));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kBlockN + 16 * t)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + g * kBlockN + 16 * t)));
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(step[r * groups + g]));
        f[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r * groups + g]), _mm512_fmadd_ps(scaled, d, f[r]));
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + 16 * t),
                          reinterpret_cast<const __m256i&>(static_cast<const __m256bh&>(_mm512_cvtneps_pbh(f[r]))));
  }
}

template <int... R>
constexpr auto pass_table(std::integer_sequence<int, R...>) {
  using Pass = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*, const uint8_t*,
                        const at::Half*, const at::Half*, at::BFloat16*, int64_t);
  return std::array<Pass, sizeof...(R)>{&int8_pass<R + 1>...};
}

}  // namespace

bool vnni_built() { return true; }

void lowbit_gemm_vnni(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, int64_t N, at::BFloat16* out) {
  static constexpr auto kPasses = pass_table(std::make_integer_sequence<int, kRows>());
  const int64_t groups = K / kGroup, item_bytes = groups * 2 * kTileBytes;
  std::vector<int8_t> q(M * K);
  std::vector<float> step(M * groups), sum(M * groups);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * K, K, q.data() + r * K, step.data() + r * groups, sum.data() + r * groups);
  });
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint8_t, FreeDeleter> panel;
    if (M > kRows) {
      panel.reset(static_cast<uint8_t*>(std::aligned_alloc(64, groups * 2 * 8 * 64)));
      TORCH_CHECK(panel, "lowbit_linear: out of memory");
    }
    for (int64_t item = begin; item < end; ++item) {
      const uint8_t* c = codes + item * item_bytes;
      const at::Half* s = scales + item * groups * kBlockN;
      const at::Half* o = offsets + item * groups * kBlockN;
      if (panel) expand_item(c, groups, panel.get());
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        kPasses[rows - 1](q.data() + m0 * K, step.data() + m0 * groups, sum.data() + m0 * groups, K, c, panel.get(),
                          s, o, out + m0 * N + item * kBlockN, N);
      }
    }
  });
}

}  // namespace llmserve_lowbit

#else

namespace llmserve_lowbit {
bool vnni_built() { return false; }
void lowbit_gemm_vnni(const at::BFloat16*, int64_t, int64_t, const uint8_t*, const at::Half*, const at::Half*,
                      int64_t, at::BFloat16*) {}
}  // namespace llmserve_lowbit

#endif
