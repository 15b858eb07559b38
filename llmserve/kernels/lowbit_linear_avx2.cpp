// The low-bit matmul's route for float32 activations on CPUs with AVX2 and FMA but no native bf16 (AMD Zen 1-3,
// Intel client CPUs): the same blocks and layout as lowbit_linear.cpp, multiplied with float32 FMAs. There bf16
// matmuls are emulated (oneDNN needs AVX512-BF16/AVX-NE-CONVERT for them; measured 4x slower than float32), so
// such CPUs serve float32, whose weights cost 4 bytes each: this route reads 4 or 8 bits instead.
//
// Lanes follow the layout's pair interleaving: one 8-float vector holds 4 output columns x 2 adjacent input
// columns, multiplied against those two activations broadcast as one 64-bit pair; the two halves of each column
// are added once, at the end. Steps of several rows expand the work item's weights to float32 once (code * scale +
// offset, one rounding) and reuse them for every pass of up to 6 rows against 8 columns, whose 12 accumulators stay
// in registers over the whole input; a single row computes the same weights in registers, in the same order, so
// results do not depend on the step's size.

#include "lowbit_avx2.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace llmserve_lowbit {
namespace {

constexpr int64_t kGroup = 32;   // input columns per group: 16 pairs, one tile row each
constexpr int64_t kBlockN = 32;  // output columns per work item: 8 vectors of 4 columns x 2
constexpr int kPassRows = 6;     // 6 rows x 2 vectors = 12 accumulators, + 2 weight vectors + a broadcast, of 16

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

// Tile row r's elements j..j+7 (columns j/2.., input columns 2r, 2r + 1 of the group) as float codes.
// 4 bits: rows 2i and 2i + 1 share 32 bytes, the first in the low nibbles; 8 bits: 32 signed bytes a row.
template <int kBits>
inline __m256 tile_codes(const uint8_t* tile, int r, int j) {
  if constexpr (kBits == 4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + (r >> 1) * 32 + j)));
    return _mm256_cvtepi32_ps(_mm256_and_si256((r & 1) ? _mm256_srli_epi32(v, 4) : v, _mm256_set1_epi32(15)));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + r * 32 + j))));
  }
}

// Four columns' values, each repeated for its two lanes: [v0 v0 v1 v1 v2 v2 v3 v3].
inline __m256 pair_lanes(const float* v4) {
  const __m128 a = _mm_loadu_ps(v4);
  return _mm256_set_m128(_mm_unpackhi_ps(a, a), _mm_unpacklo_ps(a, a));
}

// The two activations x[k], x[k + 1] in every lane pair.
inline __m256 broadcast_pair(const float* x) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x)));
}

// 32 float16 values to float32.
inline void halves_to_floats(const at::Half* h, float* out) {
  for (int i = 0; i < 32; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
}

// Adds each column's two lanes: vectors a (columns 0-3) and b (4-7) to 8 columns in order.
inline __m256 fold_pairs(__m256 a, __m256 b) {
  const __m256 h = _mm256_hadd_ps(a, b);  // [a01 a23 b01 b23 | a45 a67 b45 b67]
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

constexpr int64_t tile_bytes(int bits) { return bits == 4 ? 256 : 512; }

// One row against one work item, without storing the expanded weights: each is computed in registers exactly as
// expand_panel computes it and accumulated in the same order as panel_pass, so a row's result does not depend on
// how many rows its step has (float32 stays batch-invariant, as the float32 reference mode promises).
template <int kBits>
void one_row(const float* x, int64_t groups, const uint8_t* codes, const at::Half* scales, const at::Half* offsets,
             float* out) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;  // see panel_pass
  alignas(32) float d[32], m[32] = {};
  alignas(32) float dv[8][8], mv[8][8];
  for (int64_t g = 0; g < groups; ++g) {
    halves_to_floats(scales + g * kBlockN, d);
    if constexpr (kBits == 4) halves_to_floats(offsets + g * kBlockN, m);
    for (int v = 0; v < 8; ++v) {
      _mm256_store_ps(dv[v], pair_lanes(d + 4 * v));
      _mm256_store_ps(mv[v], pair_lanes(m + 4 * v));
    }
    const uint8_t* tile0 = codes + g * 2 * tile_bytes(kBits);
    const uint8_t* tile1 = tile0 + tile_bytes(kBits);
    for (int r = 0; r < 16; ++r) {
      const __m256 xb = broadcast_pair(x + g * kGroup + 2 * r);
#define LLMSERVE_STEP(v, tile, j) \
  a##v = _mm256_fmadd_ps(xb, _mm256_fmadd_ps(tile_codes<kBits>(tile, r, j), _mm256_load_ps(dv[v]), _mm256_load_ps(mv[v])), a##v);
      LLMSERVE_STEP(0, tile0, 0) LLMSERVE_STEP(1, tile0, 8) LLMSERVE_STEP(2, tile0, 16) LLMSERVE_STEP(3, tile0, 24)
      LLMSERVE_STEP(4, tile1, 0) LLMSERVE_STEP(5, tile1, 8) LLMSERVE_STEP(6, tile1, 16) LLMSERVE_STEP(7, tile1, 24)
#undef LLMSERVE_STEP
    }
  }
  _mm256_storeu_ps(out, fold_pairs(a0, a1));
  _mm256_storeu_ps(out + 8, fold_pairs(a2, a3));
  _mm256_storeu_ps(out + 16, fold_pairs(a4, a5));
  _mm256_storeu_ps(out + 24, fold_pairs(a6, a7));
}

// The work item's weights as float32, [K / 2 pairs][8 vectors of 8]: code * scale + offset, as the file means them.
template <int kBits>
void expand_panel(int64_t groups, const uint8_t* codes, const at::Half* scales, const at::Half* offsets, float* w) {
  alignas(32) float d[32], m[32];
  for (int64_t g = 0; g < groups; ++g) {
    halves_to_floats(scales + g * kBlockN, d);
    if constexpr (kBits == 4) halves_to_floats(offsets + g * kBlockN, m);
    for (int v = 0; v < 8; ++v) {
      const int t = v / 4, j = 8 * (v % 4);
      const uint8_t* tile = codes + g * 2 * tile_bytes(kBits) + t * tile_bytes(kBits);
      const __m256 dv = pair_lanes(d + 4 * v);
      const __m256 mv = kBits == 4 ? pair_lanes(m + 4 * v) : _mm256_setzero_ps();
      for (int r = 0; r < 16; ++r)
        _mm256_store_ps(w + ((g * 16 + r) * 8 + v) * 8, _mm256_fmadd_ps(tile_codes<kBits>(tile, r, j), dv, mv));
    }
  }
}

// R rows (R <= kPassRows) against one quarter (8 columns, 2 vectors) of an expanded panel, over the whole input.
// The accumulators are named variables, not an array: GCC stored an array's elements back to the stack on every
// iteration (12 stores per 12 FMAs), which held the pass to a quarter of the FMA rate.
template <int R>
void panel_pass(const float* x, int64_t K, const float* w, int quarter, float* out, int64_t N) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero;
  __m256 a30 = zero, a31 = zero, a40 = zero, a41 = zero, a50 = zero, a51 = zero;
  const float* wq = w + quarter * 16;
#define LLMSERVE_ROW(r)                                                     \
  if constexpr (R > r) {                                                  \
    const __m256 xb = broadcast_pair(x + r * K + 2 * p);                  \
    a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);                           \
    a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);                           \
  }
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m256 w0 = _mm256_load_ps(wq + p * 64), w1 = _mm256_load_ps(wq + p * 64 + 8);
    LLMSERVE_ROW(0) LLMSERVE_ROW(1) LLMSERVE_ROW(2) LLMSERVE_ROW(3) LLMSERVE_ROW(4) LLMSERVE_ROW(5)
  }
#undef LLMSERVE_ROW
  const __m256 rows[kPassRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N + 8 * quarter, fold_pairs(rows[r][0], rows[r][1]));
}

using PassFn = void (*)(const float*, int64_t, const float*, int, float*, int64_t);
constexpr PassFn kPass[kPassRows] = {panel_pass<1>, panel_pass<2>, panel_pass<3>,
                                     panel_pass<4>, panel_pass<5>, panel_pass<6>};

template <int kBits>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales, const at::Half* offsets,
          int64_t N, float* out) {
  const int64_t groups = K / kGroup, item_bytes = groups * 2 * tile_bytes(kBits);
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float, FreeDeleter> w;
    if (M > 1) w.reset(static_cast<float*>(std::aligned_alloc(64, K * kBlockN * sizeof(float))));
    for (int64_t item = begin; item < end; ++item) {
      const uint8_t* c = codes + item * item_bytes;
      const at::Half* s = scales + item * groups * kBlockN;
      const at::Half* o = offsets ? offsets + item * groups * kBlockN : nullptr;
      float* out_item = out + item * kBlockN;
      if (M == 1) {
        one_row<kBits>(x, groups, c, s, o, out_item);
        continue;
      }
      expand_panel<kBits>(groups, c, s, o, w.get());
      // Quarter by quarter: each quarter's panel (K x 8 columns, 18 KiB at K = 576) is reused by every pass of rows
      // while it is still in cache.
      for (int quarter = 0; quarter < 4; ++quarter)
        for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kPassRows, M - m0));
          kPass[rows - 1](x + m0 * K, K, w.get(), quarter, out_item + m0 * N, N);
        }
    }
  });
}

}  // namespace

bool avx2_built() { return true; }

void lowbit_gemm_avx2(const float* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, int64_t N, float* out) {
  if (offsets)
    gemm<4>(x, M, K, codes, scales, offsets, N, out);
  else
    gemm<8>(x, M, K, codes, scales, offsets, N, out);
}

}  // namespace llmserve_lowbit

#else

namespace llmserve_lowbit {
bool avx2_built() { return false; }
void lowbit_gemm_avx2(const float*, int64_t, int64_t, const uint8_t*, const at::Half*, const at::Half*, int64_t,
                      float*) {}
}  // namespace llmserve_lowbit

#endif
