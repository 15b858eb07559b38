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
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

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
    if (M > 1) {
      w.reset(static_cast<float*>(std::aligned_alloc(64, K * kBlockN * sizeof(float))));
      TORCH_CHECK(w, "lowbit_linear: out of memory");
    }
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

// A float32 weight kept in expand_panel's layout: the passes above, for every step size, one row included. A row's
// 12 accumulators (2 per row) run over the input in order whatever the number of rows, so a row's result does not
// depend on what else is in its step (MKL's sgemm picks kernels, and so summation orders, by the number of rows).
void float_gemm(const float* x, int64_t M, int64_t K, const float* panel, int64_t N, float* out) {
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const float* w = panel + item * K * kBlockN;
      float* out_item = out + item * kBlockN;
      for (int quarter = 0; quarter < 4; ++quarter)
        for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kPassRows, M - m0));
          kPass[rows - 1](x + m0 * K, K, w, quarter, out_item + m0 * N, N);
        }
    }
  });
}

// ---- int8 activations (route "avx2_int8") ----
// As llama.cpp multiplies Q4_1 by Q8_1: each row's activations are quantized to int8 per group of 32 (step =
// max |x| / 127), and codes times activations are summed exactly in integers, 32 products per vpmaddubsw, which
// is 4x the multiplies per instruction of the float route and never builds a float weight. Per group and column
// the integer sum becomes float once: sum * scale * step + offset * (the group's float sum of x).
// In the layout, byte j of a 4-bit tile's 32-byte chunk i holds column j / 2 and inputs 4i + j % 2 (low nibble)
// and 4i + 2 + j % 2 (high nibble); interleaving the low and high nibbles' 16-bit units puts each column's four
// inputs 4i..4i+3 in order in 4 bytes, against the activations' 4 bytes broadcast. An 8-bit tile interleaves rows
// 2i and 2i + 1 the same way.

constexpr int kInt8Rows = 4;  // rows per pass: 2 int16 accumulators each, + codes, broadcast and products, of 16

// Row-wise: q [K] int8, step [K / 32] (the group's max |x| / 127) and sum [K / 32] (its float sum, for offsets).
void quantize_row(const float* x, int64_t K, int8_t* q, float* step, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' per-lane interleaving
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    const __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8), v2 = _mm256_loadu_ps(xg + 16),
                 v3 = _mm256_loadu_ps(xg + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    __m256 s = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    sum[g] = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    step[g] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // cvtps rounds to nearest even; |x| * 127 / max|x| stays within 127.
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)),
                  i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

// A tile's float16 values for columns [0-3 | 8-11] (lo) and [4-7 | 12-15] (hi), as the 16-bit unpacks leave them.
inline __m128 four_halves(const at::Half* h) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
}
inline __m256 tile_lanes_lo(const at::Half* h16) { return _mm256_set_m128(four_halves(h16 + 8), four_halves(h16)); }
inline __m256 tile_lanes_hi(const at::Half* h16) { return _mm256_set_m128(four_halves(h16 + 12), four_halves(h16 + 4)); }

// R rows (R <= kInt8Rows) against one work item. The integer sums are exact, and each row is turned into floats
// and accumulated the same way whatever R is, so a row's result does not depend on its step's size.
template <int kBits, int R>
void int8_pass(const int8_t* q, const float* step, const float* sum, int64_t K, const uint8_t* codes,
               const at::Half* scales, const at::Half* offsets, float* out, int64_t N) {
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[kInt8Rows][kBlockN] = {};
  // Tile by tile, then group by group: were the tiles inner, GCC would keep one group's activation broadcasts for
  // both tiles, which spills them to the stack.
  for (int t = 0; t < 2; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* tile = codes + (g * 2 + t) * tile_bytes(kBits);
      const __m256i zero = _mm256_setzero_si256();
      // 4 bits: int16 sums of 8 chunks stay below 8 * 2 * 15 * 127 < 2^15; 8 bits: int32 at once.
      __m256i s0l = zero, s0h = zero, s1l = zero, s1h = zero, s2l = zero, s2h = zero, s3l = zero, s3h = zero;
#pragma GCC unroll 1  // unrolled, GCC computed all products first and spilled them to the stack
      for (int i = 0; i < 8; ++i) {
        __m256i lo, hi;
        if constexpr (kBits == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + i * 32));
          const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          lo = _mm256_unpacklo_epi16(low, high);
          hi = _mm256_unpackhi_epi16(low, high);
        } else {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 2 * i * 32));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (2 * i + 1) * 32));
          lo = _mm256_unpacklo_epi16(a, b);
          hi = _mm256_unpackhi_epi16(a, b);
        }
#define LLMSERVE_ROW(r)                                                                                        \
  if constexpr (R > r) {                                                                                       \
    int32_t four;                                                                                              \
    std::memcpy(&four, q + r * K + g * kGroup + 4 * i, 4);                                                     \
    const __m256i xb = _mm256_set1_epi32(four);                                                                \
    if constexpr (kBits == 4) {                                                                                \
      s##r##l = _mm256_add_epi16(s##r##l, _mm256_maddubs_epi16(lo, xb));                                      \
      s##r##h = _mm256_add_epi16(s##r##h, _mm256_maddubs_epi16(hi, xb));                                      \
    } else { /* vpmaddubsw takes one unsigned side: |w| against x with w's sign */                            \
      s##r##l = _mm256_add_epi32(s##r##l, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo),          \
                                                                                 _mm256_sign_epi8(xb, lo)), ones)); \
      s##r##h = _mm256_add_epi32(s##r##h, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi),          \
                                                                                 _mm256_sign_epi8(xb, hi)), ones)); \
    }                                                                                                          \
  }
        LLMSERVE_ROW(0) LLMSERVE_ROW(1) LLMSERVE_ROW(2) LLMSERVE_ROW(3)
#undef LLMSERVE_ROW
      }
      const at::Half* sg = scales + g * kBlockN + 16 * t;
      const __m256 dl = tile_lanes_lo(sg), dh = tile_lanes_hi(sg);
      const __m256 ml = kBits == 4 ? tile_lanes_lo(offsets + g * kBlockN + 16 * t) : _mm256_setzero_ps();
      const __m256 mh = kBits == 4 ? tile_lanes_hi(offsets + g * kBlockN + 16 * t) : _mm256_setzero_ps();
      const __m256i sums[kInt8Rows][2] = {{s0l, s0h}, {s1l, s1h}, {s2l, s2h}, {s3l, s3h}};
      for (int r = 0; r < R; ++r) {
        __m256i il = sums[r][0], ih = sums[r][1];
        if constexpr (kBits == 4) {
          il = _mm256_madd_epi16(il, ones);
          ih = _mm256_madd_epi16(ih, ones);
        }
        const __m256 st = _mm256_set1_ps(step[r * groups + g]);
        float* a = acc[r] + 16 * t;
        __m256 al = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_mul_ps(dl, st), _mm256_load_ps(a));
        __m256 ah = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_mul_ps(dh, st), _mm256_load_ps(a + 8));
        if constexpr (kBits == 4) {
          const __m256 sx = _mm256_set1_ps(sum[r * groups + g]);
          al = _mm256_fmadd_ps(ml, sx, al);
          ah = _mm256_fmadd_ps(mh, sx, ah);
        }
        _mm256_store_ps(a, al);
        _mm256_store_ps(a + 8, ah);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 2; ++t) {
      const __m256 al = _mm256_load_ps(acc[r] + 16 * t), ah = _mm256_load_ps(acc[r] + 16 * t + 8);
      _mm256_storeu_ps(out + r * N + 16 * t, _mm256_permute2f128_ps(al, ah, 0x20));
      _mm256_storeu_ps(out + r * N + 16 * t + 8, _mm256_permute2f128_ps(al, ah, 0x31));
    }
}

template <int kBits>
void gemm_int8(const float* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
               const at::Half* offsets, int64_t N, float* out) {
  using Pass = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*, const at::Half*,
                        const at::Half*, float*, int64_t);
  constexpr Pass kPasses[kInt8Rows] = {int8_pass<kBits, 1>, int8_pass<kBits, 2>, int8_pass<kBits, 3>,
                                       int8_pass<kBits, 4>};
  const int64_t groups = K / kGroup, item_bytes = groups * 2 * tile_bytes(kBits);
  std::vector<int8_t> q(M * K);
  std::vector<float> step(M * groups), sum(M * groups);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * K, K, q.data() + r * K, step.data() + r * groups, sum.data() + r * groups);
  });
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const uint8_t* c = codes + item * item_bytes;
      const at::Half* s = scales + item * groups * kBlockN;
      const at::Half* o = offsets ? offsets + item * groups * kBlockN : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kInt8Rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kInt8Rows, M - m0));
        kPasses[rows - 1](q.data() + m0 * K, step.data() + m0 * groups, sum.data() + m0 * groups, K, c, s, o,
                          out + m0 * N + item * kBlockN, N);
      }
    }
  });
}

}  // namespace

bool avx2_built() { return true; }

void float_panel_gemm(const float* x, int64_t M, int64_t K, const float* panel, int64_t N, float* out) {
  float_gemm(x, M, K, panel, N, out);
}

void lowbit_gemm_avx2(const float* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, int64_t N, float* out, bool int8_activations) {
  if (int8_activations && offsets)
    gemm_int8<4>(x, M, K, codes, scales, offsets, N, out);
  else if (int8_activations)
    gemm_int8<8>(x, M, K, codes, scales, offsets, N, out);
  else if (offsets)
    gemm<4>(x, M, K, codes, scales, offsets, N, out);
  else
    gemm<8>(x, M, K, codes, scales, offsets, N, out);
}

}  // namespace llmserve_lowbit

#else

namespace llmserve_lowbit {
bool avx2_built() { return false; }
void lowbit_gemm_avx2(const float*, int64_t, int64_t, const uint8_t*, const at::Half*, const at::Half*, int64_t,
                      float*, bool) {}
void float_panel_gemm(const float*, int64_t, int64_t, const float*, int64_t, float*) {}
}  // namespace llmserve_lowbit

#endif
