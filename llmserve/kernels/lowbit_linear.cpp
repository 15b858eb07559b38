// Matmul of bf16 activations with a weight kept in 4 or 8 bits (groups of 32 input columns, a float16 scale per
// group and output column, and for 4 bits a float16 offset: GGUF's Q4_1 and Q8_0 blocks). Made for decode steps of
// a few to a few dozen rows, which read every weight once and do little arithmetic with it: their speed is set by
// the bytes of weight read, and these are a quarter (4 bits) or half (8 bits) of bf16's, plus the scales. It also
// beats oneDNN's bf16 matmul on prefill (1.2x at 512 rows), so where it runs it serves every step.
//
// Each work item is 32 output columns. Their weights are expanded, 32 input columns at a time, into bf16 in the
// pair-interleaved layout AMX reads (two 16x32 tiles, 2 KB, in L1) and multiplied with tdpbf16ps into float32
// accumulator tiles that stay in registers across the whole input dimension; the scales are applied during the
// expansion, where they vary by group, since the accumulators cannot. The expansion computes code * scale + offset
// in float32 and rounds once to bf16: the same bf16 weight a GGUF file dequantized to float32 and cast gives.
// Steps of more than 32 rows expand a work item's whole weight panel once and reuse it for every 32 rows. Steps of
// a few rows take another route (lowbit_gemm_few_rows, below).
//
// On a CPU without AMX but with AVX512-BF16 (AMD Zen 4 and later), lowbit_gemm_avx512 (below) runs the same
// blocks with vdpbf16ps, 12 rows a pass against 32 columns: for one pass, the bare codes with the scales applied to
// each group's partial sums, as the AMX route does for a few rows (up to 8 rows, built in registers and used at
// once: item_direct_rows, item_direct_rows_by_tile); for more, the weights expanded once per work item, as above.
// Its arithmetic rate is oneDNN's, so it wins where the bytes of weight decide (up to a few hundred rows) and stays
// level with it on prefill (docs/performance.md); it too serves every step.
// Float32 activations (CPUs without native bf16, where the engine serves float32) take the AVX2 route in
// lowbit_linear_avx2.cpp over the same blocks; bf16 activations rounded to int8 (decode_quantization w4a8, opt-in in
// bf16) the AVX512-VNNI route in lowbit_linear_vnni.cpp. Without a route for the activations' dtype, Python keeps to
// torch's weight-only kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amx.h"
#include "lowbit_avx2.h"
#include "lowbit_vnni.h"

namespace {

constexpr int64_t kGroup = 32;   // input columns per group, and per tile row (32 bf16 = 64 bytes)
constexpr int64_t kBlockN = 32;  // output columns per work item: two 16-column B tiles
constexpr int64_t kBlockM = 32;  // rows per pass: two 16-row A tiles
constexpr int64_t kPrefetchGroups = 8;  // how far ahead the weight stream is prefetched
// Up to this many rows, 4-bit steps scale partial sums instead of weights (lowbit_gemm_few_rows): measured faster
// up to 12 rows (22 % at 1 row), even at 16.
constexpr int64_t kFewRows = 12;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LLMSERVE_LOWBIT_AVX512 1
#include <immintrin.h>

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 32 float32 results of one row to bf16 at `out`.
inline void store_bf16_row(const float* acc, at::BFloat16* out) {
  const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_load_ps(acc + 16), _mm512_load_ps(acc));
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(r));
}

// Asks for the codes, scales and offsets of the work item's group kPrefetchGroups ahead: the hardware prefetcher
// alone left the weight stream waiting on memory (~25 % slower, scratch measurement in docs/benchmarks-history.md).
inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes, const at::Half* scales, const at::Half* offsets) {
  const char* ahead = reinterpret_cast<const char*>(block + kPrefetchGroups * block_bytes);
  for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + kPrefetchGroups * kBlockN), _MM_HINT_T0);
  if (offsets) _mm_prefetch(reinterpret_cast<const char*>(offsets + kPrefetchGroups * kBlockN), _MM_HINT_T0);
}

// Sum of each row's activations over each group of 32 columns, [M, groups]: what the offsets multiply when the
// scales are applied to partial sums of bare codes.
std::vector<float> group_row_sums(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  std::vector<float> sums(M * groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 lo = _mm512_cvtpbh_ps(reinterpret_cast<const __m256bh&>(*(x + m * K + g * kGroup)));
      const __m512 hi = _mm512_cvtpbh_ps(reinterpret_cast<const __m256bh&>(*(x + m * K + g * kGroup + 16)));
      sums[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  return sums;
}

// A row pair's 32 bytes of 4-bit codes as the bf16 numbers 128 + q, unscaled: the code under 128's exponent, two
// bit operations for 64 codes, no arithmetic. `lo` gets the low nibbles (the pair's first tile row), `hi` the high.
inline void bf16_from_nibbles(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), bf16_128 = _mm512_set1_epi32(0x43004300);
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo = _mm512_ternarylogic_epi32(v, nibble, bf16_128, 0xEA);  // (a & b) | c
  hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, bf16_128, 0xEA);
}

// 32 signed 8-bit codes as bf16, unscaled (exact: |q| <= 127 fits bf16's 8 significant bits), in their order.
inline __m512i bf16_from_int8(const uint8_t* p) {
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  const __m512bh v = _mm512_cvtne2ps_pbh(f1, f0);
  return reinterpret_cast<const __m512i&>(v);
}

// A group's 4-bit codes, bare (bf16_from_nibbles). `w` gets 32 vectors of 32 bf16, vector t * 16 + r holding tile
// t's row r (input columns 2r and 2r + 1 of 16 output columns, pair-interleaved): what an AMX tile or vdpbf16ps reads.
inline void bare_codes_4bit(const uint8_t* block, uint16_t* w) {
  for (int pair = 0; pair < 16; ++pair) {  // both tiles' 8 row pairs, 32 bytes each
    __m512i lo, hi;
    bf16_from_nibbles(block + 32 * pair, lo, hi);
    _mm512_store_si512(w + 64 * pair, lo);
    _mm512_store_si512(w + 64 * pair + 32, hi);
  }
}

// A group's 8-bit codes as bf16, unscaled, in the same order.
inline void bare_codes_8bit(const uint8_t* block, uint16_t* w) {
  for (int row = 0; row < 32; ++row)  // both tiles' 16 rows, 32 signed bytes each, in element order
    _mm512_store_si512(w + 32 * row, bf16_from_int8(block + 32 * row));
}

// Scale (or offset) of each element of a tile row: the row holds 16 columns x 2 input columns, column-major pairs,
// so element e belongs to column e / 2. `half16` is the 16 columns' float16 values.
inline void pair_expand(const at::Half* half16, __m512& lo, __m512& hi) {
  const __m512 v = load_half16(half16);
  lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

// One 16-column tile of one group into bf16: 16 rows of 32 elements, 64 bytes each.
// 4 bits: rows go in pairs, 32 bytes a pair, element j of the first row in byte j's low nibble and of the second in
// its high one. Each code q becomes the float 1 + q/16 by placing it in the mantissa under 1.0's exponent (no
// int-to-float conversion), and (1 + q/16) * 16d + (m - 16d) = q*d + m exactly in float32 for float16 d and m.
template <int kBits>
inline void expand_tile(const uint8_t* __restrict codes, const at::Half* scales, const at::Half* offsets,
                        uint16_t* __restrict out) {
  __m512 s_lo, s_hi;
  pair_expand(scales, s_lo, s_hi);
  if constexpr (kBits == 4) {
    __m512 o_lo, o_hi;
    pair_expand(offsets, o_lo, o_hi);
    const __m512 sixteen = _mm512_set1_ps(16.f);
    s_lo = _mm512_mul_ps(s_lo, sixteen);
    s_hi = _mm512_mul_ps(s_hi, sixteen);
    o_lo = _mm512_sub_ps(o_lo, s_lo);
    o_hi = _mm512_sub_ps(o_hi, s_hi);
    const __m512i mantissa = _mm512_set1_epi32(0xF << 19), one = _mm512_set1_epi32(0x3F800000);
    auto expand = [&](__m512i v, int shift) {  // (a & b) | c
      return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, shift), mantissa, one, 0xEA));
    };
    for (int r = 0; r < 16; r += 2) {
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
      const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r + 16)));
      const __m512bh w0 = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(expand(v1, 19), s_hi, o_hi),
                                              _mm512_fmadd_ps(expand(v0, 19), s_lo, o_lo));
      const __m512bh w1 = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(expand(v1, 15), s_hi, o_hi),
                                              _mm512_fmadd_ps(expand(v0, 15), s_lo, o_lo));
      _mm512_store_si512(out + 32 * r, reinterpret_cast<const __m512i&>(w0));
      _mm512_store_si512(out + 32 * r + 32, reinterpret_cast<const __m512i&>(w1));
    }
  } else {
    for (int r = 0; r < 16; ++r) {  // 32 signed bytes a row, in element order
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * r));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * r + 16));
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1));
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_mul_ps(f1, s_hi), _mm512_mul_ps(f0, s_lo));
      _mm512_store_si512(out + 32 * r, reinterpret_cast<const __m512i&>(w));
    }
  }
}

#endif  // AVX512-BF16

#ifdef LLMSERVE_AMX

using llmserve_amx::TileConfig;

// Tiles 0-3: accumulators (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31); 4, 5: activation
// rows 0-15 and 16-31; 6, 7: weight columns 0-15 and 16-31. A pass of fewer rows shortens its tiles (a tile with
// no rows must have no columns either).
void configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// Steps of a few rows (4 bits): expanding every weight to its float value costs more than the few rows' products,
// so the tiles get the bare codes instead, as the bf16 numbers 128 + q (the code under 128's exponent: two bit
// operations for 64 codes, no arithmetic), and the scales are applied to each group's partial sums:
//   sum_k x_k (q_k d + m) = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k   over the group's 32 columns.
// The products are exact in float32 and the sums are float32, as in the other path.
void lowbit_gemm_few_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                          const at::Half* offsets, int64_t N, at::BFloat16* out) {
  constexpr int64_t kBlockBytes = 512, kExpanded = 2 * 16 * 32;
  const int64_t groups = K / kGroup, items = N / kBlockN;
  const std::vector<float> row_sums = group_row_sums(x, M, K);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t buffer[2 * kExpanded];  // two groups: the next one's stores need not wait on this one's loads
    alignas(64) float partial[16 * kBlockN], acc[16 * kBlockN];
    configure_tiles(static_cast<int>(M), 0);
    const __m512 c128 = _mm512_set1_ps(128.f);

    for (int64_t item = begin; item < end; ++item) {
      const uint8_t* item_codes = codes + item * groups * kBlockBytes;
      const at::Half* item_scales = scales + item * groups * kBlockN;
      const at::Half* item_offsets = offsets + item * groups * kBlockN;
      std::memset(acc, 0, sizeof(acc));
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = item_codes + g * kBlockBytes;
        const at::Half* s = item_scales + g * kBlockN;
        const at::Half* o = item_offsets + g * kBlockN;
        prefetch_ahead(block, kBlockBytes, s, o);
        uint16_t* w = buffer + (g & 1) * kExpanded;
        bare_codes_4bit(block, w);
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, x + g * kGroup, K * 2);
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stored(0, partial, kBlockN * 4);
        _tile_stored(1, partial + 16, kBlockN * 4);
        const __m512 d0 = load_half16(s), d1 = load_half16(s + 16);
        const __m512 o0 = _mm512_fnmadd_ps(d0, c128, load_half16(o)), o1 = _mm512_fnmadd_ps(d1, c128, load_half16(o + 16));
        for (int64_t m = 0; m < M; ++m) {
          const __m512 sum = _mm512_set1_ps(row_sums[m * groups + g]);
          float* a = acc + m * kBlockN;
          _mm512_store_ps(a, _mm512_fmadd_ps(d0, _mm512_load_ps(partial + m * kBlockN), _mm512_fmadd_ps(o0, sum, _mm512_load_ps(a))));
          _mm512_store_ps(a + 16, _mm512_fmadd_ps(d1, _mm512_load_ps(partial + m * kBlockN + 16),
                                                  _mm512_fmadd_ps(o1, sum, _mm512_load_ps(a + 16))));
        }
      }
      for (int64_t m = 0; m < M; ++m) store_bf16_row(acc + m * kBlockN, out + m * N + item * kBlockN);
    }
    _tile_release();
  });
}

template <int kBits>
void lowbit_gemm(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                 const at::Half* offsets, int64_t N, at::BFloat16* out) {
  constexpr int64_t kTileBytes = 16 * 32 * kBits / 8;  // one tile's codes
  constexpr int64_t kBlockBytes = 2 * kTileBytes;      // one (work item, group) block
  constexpr int64_t kExpanded = 2 * 16 * 32;           // its two tiles in bf16 (elements)
  const int64_t groups = K / kGroup, items = N / kBlockN;
  const bool whole_panel = M > kBlockM;  // expand an item's weights once, reuse them for every pass of 32 rows
  const int64_t x_stride = K * 2;        // bytes between activation rows

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // Two group buffers when expanding as it goes: the next group's stores need not wait for this one's tile loads.
    const int64_t buf_elems = (whole_panel ? groups : 2) * kExpanded;
    auto buffer = std::unique_ptr<uint16_t[], decltype(&std::free)>(
        static_cast<uint16_t*>(std::aligned_alloc(64, buf_elems * 2)), &std::free);
    TORCH_CHECK(buffer, "lowbit_linear: out of memory");
    alignas(64) float acc[kBlockM * kBlockN];
    int configured = -1;

    for (int64_t item = begin; item < end; ++item) {
      const uint8_t* item_codes = codes + item * groups * kBlockBytes;
      const at::Half* item_scales = scales + item * groups * kBlockN;
      const at::Half* item_offsets = offsets ? offsets + item * groups * kBlockN : nullptr;
      auto expand_group = [&](int64_t g, uint16_t* dst) {
        const int64_t s = g * kBlockN;
        prefetch_ahead(item_codes + g * kBlockBytes, kBlockBytes, item_scales + s, item_offsets ? item_offsets + s : nullptr);
        for (int t = 0; t < 2; ++t)
          expand_tile<kBits>(item_codes + g * kBlockBytes + t * kTileBytes, item_scales + s + 16 * t,
                             item_offsets ? item_offsets + s + 16 * t : nullptr, dst + t * 512);
      };
      if (whole_panel)
        for (int64_t g = 0; g < groups; ++g) expand_group(g, buffer.get() + g * kExpanded);

      for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
        const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m0));
        const int rows1 = static_cast<int>(std::min<int64_t>(16, std::max<int64_t>(0, M - m0 - 16)));
        if (configured != rows0 * 32 + rows1) {
          configure_tiles(rows0, rows1);
          configured = rows0 * 32 + rows1;
        }
        _tile_zero(0);
        _tile_zero(1);
        if (rows1) {
          _tile_zero(2);
          _tile_zero(3);
        }
        const char* a0 = reinterpret_cast<const char*>(x + m0 * K);
        const char* a1 = reinterpret_cast<const char*>(x + (m0 + 16) * K);
        for (int64_t g = 0; g < groups; ++g) {
          uint16_t* w = buffer.get() + (whole_panel ? g : g & 1) * kExpanded;
          if (!whole_panel) expand_group(g, w);
          _tile_loadd(6, w, 64);
          _tile_loadd(7, w + 512, 64);
          _tile_loadd(4, a0 + g * 64, x_stride);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (rows1) {
            _tile_loadd(5, a1 + g * 64, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, acc, kBlockN * 4);
        _tile_stored(1, acc + 16, kBlockN * 4);
        if (rows1) {
          _tile_stored(2, acc + 16 * kBlockN, kBlockN * 4);
          _tile_stored(3, acc + 16 * kBlockN + 16, kBlockN * 4);
        }
        for (int i = 0; i < rows0 + rows1; ++i) store_bf16_row(acc + i * kBlockN, out + (m0 + i) * N + item * kBlockN);
      }
    }
    _tile_release();
  });
}

#endif  // LLMSERVE_AMX

#ifdef LLMSERVE_LOWBIT_AVX512

constexpr int kRowsAvx512 = 12;  // rows per pass: 24 float32 accumulators and the weight pair in registers

// acc += w . the pair of bf16 at `pair`, broadcast to every lane: vdpbf16ps with an embedded broadcast. From
// intrinsics GCC loads one broadcast register per row for its two products, which measured ~10 % slower.
inline void dot_broadcast_pair(__m512& acc, __m512i w, const int32_t& pair) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(pair));
}

// The activations of each pass of up to kRowsAvx512 rows, regrouped so that a group's pairs of input columns for
// all the pass's rows lie together: [pass][group][pair r][row]. The kernel broadcasts one pair of one row per two
// vdpbf16ps; from rows a row's length apart, the address arithmetic alone ran out of registers and took half the time.
// Prompt-sized steps split the passes between threads (a 512-row step regroups ~0.6-1.5 MB a projection).
std::unique_ptr<int32_t[]> pack_pairs_by_pass(const at::BFloat16* x, int64_t M, int64_t K) {
  const int32_t* pairs = reinterpret_cast<const int32_t*>(x);
  const int64_t row_pairs = K / 2, groups = K / kGroup, passes = (M + kRowsAvx512 - 1) / kRowsAvx512;
  std::unique_ptr<int32_t[]> packed(new int32_t[M * row_pairs]);  // every element is written below
  at::parallel_for(0, passes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t m0 = pass * kRowsAvx512, rows = std::min<int64_t>(kRowsAvx512, M - m0);
      int32_t* dst = packed.get() + m0 * row_pairs;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t m = 0; m < rows; ++m) *dst++ = pairs[(m0 + m) * row_pairs + g * 16 + r];
    }
  });
  return packed;
}

// One group's products for R rows: p0, p1 += each row's 16 activation pairs (`pairs`: [r][row]), broadcast, against
// the group's 32 vectors of weights `w` (tile t's pair r at t * 16 + r). Inlined so that p0 and p1 stay in registers.
template <int R>
__attribute__((always_inline)) inline void dot_group(__m512 (&p0)[R], __m512 (&p1)[R], const int32_t* pairs,
                                                     const uint16_t* w) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i w0 = _mm512_load_si512(w + 32 * r), w1 = _mm512_load_si512(w + 32 * (16 + r));
#pragma GCC unroll 12
    for (int m = 0; m < R; ++m) {
      dot_broadcast_pair(p0[m], w0, pairs[r * R + m]);
      dot_broadcast_pair(p1[m], w1, pairs[r * R + m]);
    }
  }
}

// One group's share of R rows x 32 output columns: each row's 16 activation pairs (`pairs`: [r][row]), broadcast,
// against the group's bare codes `w` (bare_codes_4bit's order), then acc += d * partial (+ o * the row's group sum
// for 4 bits).
template <int R>
void group_rows(const int32_t* pairs, const uint16_t* w, __m512 d0, __m512 d1, const __m512* o, const float* sums,
                int64_t sums_stride, float* acc) {
  __m512 p0[R], p1[R];
#pragma GCC unroll 12
  for (int m = 0; m < R; ++m) p0[m] = p1[m] = _mm512_setzero_ps();
  dot_group(p0, p1, pairs, w);
#pragma GCC unroll 12
  for (int m = 0; m < R; ++m) {
    float* a = acc + m * kBlockN;
    __m512 a0 = _mm512_load_ps(a), a1 = _mm512_load_ps(a + 16);
    if (o) {
      const __m512 sum = _mm512_set1_ps(sums[m * sums_stride]);
      a0 = _mm512_fmadd_ps(o[0], sum, a0);
      a1 = _mm512_fmadd_ps(o[1], sum, a1);
    }
    _mm512_store_ps(a, _mm512_fmadd_ps(d0, p0[m], a0));
    _mm512_store_ps(a + 16, _mm512_fmadd_ps(d1, p1[m], a1));
  }
}

using GroupRowsFn = void (*)(const int32_t*, const uint16_t*, __m512, __m512, const __m512*, const float*, int64_t,
                             float*);

// Steps of up to kDirectRows rows: a work item's whole pass with its sums in registers, each group's bare codes
// built in registers (bf16_from_nibbles, bf16_from_int8) and used at once, rather than stored to L1 and loaded back
// (which cost as much as the products at one row). With one or two rows the products alone are too few to hide
// vdpbf16ps's latency, so each row and tile keeps kChains independent partial sums (one chain: 16 dependent products
// a group), added at the end of the group. Measured against the L1 round trip: 1.2-1.3x on the projections of 30
// layers at 1-4 rows, weights from memory (docs/benchmarks-history.md).
constexpr int kDirectRows = 4;

template <int kBits, int R>
void item_direct_rows(const int32_t* pairs, const float* sums, int64_t groups, const uint8_t* codes,
                      const at::Half* scales, const at::Half* offsets, at::BFloat16* out, int64_t N) {
  constexpr int64_t kBlockBytes = 32 * 32 * kBits / 8;
  constexpr int kChains = R == 1 ? 4 : R == 2 ? 2 : 1;
  const __m512 c128 = _mm512_set1_ps(128.f);
  __m512 a0[R], a1[R];
#pragma GCC unroll 4
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, codes += kBlockBytes, scales += kBlockN, pairs += 16 * R) {
    prefetch_ahead(codes, kBlockBytes, scales, offsets);
    __m512 p0[kChains][R], p1[kChains][R];
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) p0[c][m] = p1[c][m] = _mm512_setzero_ps();
    // Tile rows 2p and 2p + 1 of both tiles (w0: columns 0-15, w1: 16-31). Row r multiplies each row's activation
    // pair r. 4 bits: pair p of the block (32 bytes) holds tile 0's rows for p < 8, tile 1's for p >= 8, in its low
    // and high nibbles; 8 bits: row r of tile t is the block's 32 bytes t * 16 + r.
#pragma GCC unroll 8
    for (int pair = 0; pair < 8; ++pair) {
      __m512i w0lo, w0hi, w1lo, w1hi;
      if constexpr (kBits == 4) {
        bf16_from_nibbles(codes + 32 * pair, w0lo, w0hi);
        bf16_from_nibbles(codes + 32 * (pair + 8), w1lo, w1hi);
      } else {
        w0lo = bf16_from_int8(codes + 32 * (2 * pair));
        w0hi = bf16_from_int8(codes + 32 * (2 * pair + 1));
        w1lo = bf16_from_int8(codes + 32 * (16 + 2 * pair));
        w1hi = bf16_from_int8(codes + 32 * (17 + 2 * pair));
      }
      const int c = pair % kChains;
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) {
        dot_broadcast_pair(p0[c][m], w0lo, pairs[2 * pair * R + m]);
        dot_broadcast_pair(p1[c][m], w1lo, pairs[2 * pair * R + m]);
        dot_broadcast_pair(p0[c][m], w0hi, pairs[(2 * pair + 1) * R + m]);
        dot_broadcast_pair(p1[c][m], w1hi, pairs[(2 * pair + 1) * R + m]);
      }
    }
    const __m512 d0 = load_half16(scales), d1 = load_half16(scales + 16);
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) {
#pragma GCC unroll 4
      for (int c = 1; c < kChains; ++c) {
        p0[0][m] = _mm512_add_ps(p0[0][m], p0[c][m]);
        p1[0][m] = _mm512_add_ps(p1[0][m], p1[c][m]);
      }
    }
    if constexpr (kBits == 4) {  // sum_k x_k (q_k d + m) = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k
      const __m512 o0 = _mm512_fnmadd_ps(d0, c128, load_half16(offsets));
      const __m512 o1 = _mm512_fnmadd_ps(d1, c128, load_half16(offsets + 16));
      offsets += kBlockN;
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) {
        const __m512 sum = _mm512_set1_ps(sums[m * groups + g]);
        a0[m] = _mm512_fmadd_ps(d0, p0[0][m], _mm512_fmadd_ps(o0, sum, a0[m]));
        a1[m] = _mm512_fmadd_ps(d1, p1[0][m], _mm512_fmadd_ps(o1, sum, a1[m]));
      }
    } else {
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) {
        a0[m] = _mm512_fmadd_ps(d0, p0[0][m], a0[m]);
        a1[m] = _mm512_fmadd_ps(d1, p1[0][m], a1[m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < R; ++m) {
    const __m512bh v = _mm512_cvtne2ps_pbh(a1[m], a0[m]);
    _mm512_storeu_si512(out + m * N, reinterpret_cast<const __m512i&>(v));
  }
}

using DirectRowsFn = void (*)(const int32_t*, const float*, int64_t, const uint8_t*, const at::Half*, const at::Half*,
                              at::BFloat16*, int64_t);

// Steps of kDirectRows + 1 to kTileDirectRows rows: the same codes built in registers and used at once, one 16-column
// tile of the work item at a time, so that each row's sum and partial sums stay in registers; both tiles at once
// needed twice as many and spilled. The item's codes are read twice, the second time from L1 or L2. Against the L1
// round trip: 1.09-1.21x on the projections of 30 layers at 5-8 rows, 1.12-1.35x on the 8-bit LM head (weights
// from memory, benchmarks/lowbit_kernel_ab.py, docs/benchmarks-history.md); at 9 rows and more it spilled
// again.
constexpr int kTileDirectRows = 8;

template <int kBits, int R>
void item_direct_rows_by_tile(const int32_t* pairs, const float* sums, int64_t groups, const uint8_t* codes,
                              const at::Half* scales, const at::Half* offsets, at::BFloat16* out, int64_t N) {
  constexpr int64_t kBlockBytes = 32 * 32 * kBits / 8;
  constexpr int kChains = R <= 6 ? 2 : 1;  // independent partial sums per row, to hide vdpbf16ps's latency
  const __m512 c128 = _mm512_set1_ps(128.f);
  for (int t = 0; t < 2; ++t) {
    __m512 acc[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    const int32_t* p = pairs;
    for (int64_t g = 0; g < groups; ++g, p += 16 * R) {
      const uint8_t* block = codes + g * kBlockBytes;
      const int64_t s = g * kBlockN + 16 * t;
      if (t == 0) prefetch_ahead(block, kBlockBytes, scales + g * kBlockN, offsets ? offsets + g * kBlockN : nullptr);
      __m512 part[kChains][R];
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) part[c][m] = _mm512_setzero_ps();
      // Tile t's rows 2 pair and 2 pair + 1 (item_direct_rows gives the layout).
#pragma GCC unroll 8
      for (int pair = 0; pair < 8; ++pair) {
        __m512i lo, hi;
        if constexpr (kBits == 4) {
          bf16_from_nibbles(block + 32 * (pair + 8 * t), lo, hi);
        } else {
          lo = bf16_from_int8(block + 32 * (16 * t + 2 * pair));
          hi = bf16_from_int8(block + 32 * (16 * t + 2 * pair + 1));
        }
        const int c = pair % kChains;
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) {
          dot_broadcast_pair(part[c][m], lo, p[2 * pair * R + m]);
          dot_broadcast_pair(part[c][m], hi, p[(2 * pair + 1) * R + m]);
        }
      }
      if constexpr (kChains == 2)
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) part[0][m] = _mm512_add_ps(part[0][m], part[1][m]);
      const __m512 d = load_half16(scales + s);
      if constexpr (kBits == 4) {  // as in item_direct_rows
        const __m512 o = _mm512_fnmadd_ps(d, c128, load_half16(offsets + s));
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m)
          acc[m] = _mm512_fmadd_ps(d, part[0][m], _mm512_fmadd_ps(o, _mm512_set1_ps(sums[m * groups + g]), acc[m]));
      } else {
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(d, part[0][m], acc[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const __m256bh v = _mm512_cvtneps_pbh(acc[m]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + 16 * t), reinterpret_cast<const __m256i&>(v));
    }
  }
}

// R rows x 32 output columns over the whole input: each row's activation pairs (`pairs`: [group][r][row]) against
// the work item's weights expanded to bf16 (`panel`: expand_tile's order, 2 KB a group), the sums in registers from
// the first group to the last, stored to `out` (row stride N) as bf16.
template <int R>
void panel_rows(const int32_t* pairs, int64_t groups, const uint16_t* panel, at::BFloat16* out, int64_t N) {
  __m512 p0[R], p1[R];
#pragma GCC unroll 12
  for (int m = 0; m < R; ++m) p0[m] = p1[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, pairs += 16 * R, panel += 2 * 16 * 32) dot_group(p0, p1, pairs, panel);
#pragma GCC unroll 12
  for (int m = 0; m < R; ++m) {
    const __m512bh v = _mm512_cvtne2ps_pbh(p1[m], p0[m]);
    _mm512_storeu_si512(out + m * N, reinterpret_cast<const __m512i&>(v));
  }
}

using PanelRowsFn = void (*)(const int32_t*, int64_t, const uint16_t*, at::BFloat16*, int64_t);

template <int... R>
constexpr std::array<GroupRowsFn, sizeof...(R)> group_rows_table(std::integer_sequence<int, R...>) {
  return {&group_rows<R + 1>...};
}

template <int... R>
constexpr std::array<PanelRowsFn, sizeof...(R)> panel_rows_table(std::integer_sequence<int, R...>) {
  return {&panel_rows<R + 1>...};
}

template <int kBits, int... R>
constexpr std::array<DirectRowsFn, sizeof...(R)> direct_rows_table(std::integer_sequence<int, R...>) {
  return {&item_direct_rows<kBits, R + 1>...};
}

template <int kBits, int... R>
constexpr std::array<DirectRowsFn, sizeof...(R)> tile_direct_rows_table(std::integer_sequence<int, R...>) {
  return {&item_direct_rows_by_tile<kBits, kDirectRows + 1 + R>...};
}

// Each work item is 32 output columns.
// - One pass of up to kRowsAvx512 rows: the item goes through the groups once, each group's codes expanded bare into
//   L1 and the scales applied to the pass's partial sums, which stay in float32 in `acc` until the end:
//     4 bits: sum_k x_k (q_k d + m) = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k   over a group's 32 columns
//     8 bits: sum_k x_k q_k d = d * sum_k x_k q_k
//   The products are exact in float32 and the sums are float32, as on the AMX route.
// - More rows: the item's weights are expanded once to their bf16 values (code * scale + offset, rounded once, as the
//   bf16 path holds them), and every pass runs over all of them with its sums in registers, without per-group
//   scaling.
template <int kBits>
void lowbit_gemm_avx512(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                        const at::Half* offsets, int64_t N, at::BFloat16* out) {
  constexpr int64_t kBlockBytes = 32 * 32 * kBits / 8, kTileBytes = kBlockBytes / 2, kExpanded = 2 * 16 * 32;
  static constexpr auto kPass = group_rows_table(std::make_integer_sequence<int, kRowsAvx512>());
  static constexpr auto kPanelPass = panel_rows_table(std::make_integer_sequence<int, kRowsAvx512>());
  static constexpr auto kDirect = direct_rows_table<kBits>(std::make_integer_sequence<int, kDirectRows>());
  static constexpr auto kTileDirect =
      tile_direct_rows_table<kBits>(std::make_integer_sequence<int, kTileDirectRows - kDirectRows>());
  const int64_t groups = K / kGroup, items = N / kBlockN;
  const bool whole_panel = M > kRowsAvx512;
  const std::vector<float> row_sums = kBits == 4 && !whole_panel ? group_row_sums(x, M, K) : std::vector<float>();
  // One row's pairs are already in the pass order ([group][r]).
  const std::unique_ptr<int32_t[]> packed = M > 1 ? pack_pairs_by_pass(x, M, K) : nullptr;
  const int32_t* pairs = M > 1 ? packed.get() : reinterpret_cast<const int32_t*>(x);

  if (M <= kTileDirectRows) {  // no buffers: the codes never leave registers
    const DirectRowsFn direct = M <= kDirectRows ? kDirect[M - 1] : kTileDirect[M - kDirectRows - 1];
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item)
        direct(pairs, row_sums.data(), groups, codes + item * groups * kBlockBytes, scales + item * groups * kBlockN,
                       kBits == 4 ? offsets + item * groups * kBlockN : nullptr, out + item * kBlockN, N);
    });
    return;
  }
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t buf_elems = (whole_panel ? groups : 1) * kExpanded;
    auto w = std::unique_ptr<uint16_t[], decltype(&std::free)>(
        static_cast<uint16_t*>(std::aligned_alloc(64, buf_elems * 2)), &std::free);
    TORCH_CHECK(w, "lowbit_linear: out of memory");
    auto acc = std::unique_ptr<float[], decltype(&std::free)>(  // the one pass's sums (the panel keeps its in registers)
        whole_panel ? nullptr : static_cast<float*>(std::aligned_alloc(64, M * kBlockN * sizeof(float))), &std::free);
    TORCH_CHECK(whole_panel || acc, "lowbit_linear: out of memory");
    for (int64_t item = begin; item < end; ++item) {
      const uint8_t* item_codes = codes + item * groups * kBlockBytes;
      const at::Half* item_scales = scales + item * groups * kBlockN;
      const at::Half* item_offsets = kBits == 4 ? offsets + item * groups * kBlockN : nullptr;
      if (whole_panel) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t s = g * kBlockN;
          prefetch_ahead(item_codes + g * kBlockBytes, kBlockBytes, item_scales + s, item_offsets ? item_offsets + s : nullptr);
          for (int t = 0; t < 2; ++t)
            expand_tile<kBits>(item_codes + g * kBlockBytes + t * kTileBytes, item_scales + s + 16 * t,
                               item_offsets ? item_offsets + s + 16 * t : nullptr, w.get() + g * kExpanded + t * 512);
        }
        for (int64_t m0 = 0; m0 < M; m0 += kRowsAvx512) {
          const int64_t rows = std::min<int64_t>(kRowsAvx512, M - m0);
          kPanelPass[rows - 1](pairs + m0 * (K / 2), groups, w.get(), out + m0 * N + item * kBlockN, N);
        }
        continue;
      }
      std::memset(acc.get(), 0, M * kBlockN * sizeof(float));
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = item_codes + g * kBlockBytes;
        const at::Half* s = item_scales + g * kBlockN;
        const at::Half* o = kBits == 4 ? item_offsets + g * kBlockN : nullptr;
        prefetch_ahead(block, kBlockBytes, s, o);
        if constexpr (kBits == 4)
          bare_codes_4bit(block, w.get());
        else
          bare_codes_8bit(block, w.get());
        const __m512 d0 = load_half16(s), d1 = load_half16(s + 16);
        __m512 shift[2];
        if constexpr (kBits == 4) {  // m - 128 d
          const __m512 c128 = _mm512_set1_ps(128.f);
          shift[0] = _mm512_fnmadd_ps(d0, c128, load_half16(o));
          shift[1] = _mm512_fnmadd_ps(d1, c128, load_half16(o + 16));
        }
        kPass[M - 1](pairs + g * 16 * M, w.get(), d0, d1, kBits == 4 ? shift : nullptr,
                     kBits == 4 ? row_sums.data() + g : nullptr, groups, acc.get());
      }
      for (int64_t m = 0; m < M; ++m) store_bf16_row(acc.get() + m * kBlockN, out + m * N + item * kBlockN);
    }
  });
}

#endif  // LLMSERVE_LOWBIT_AVX512

bool amx_route() {
#ifdef LLMSERVE_AMX
  return llmserve_amx::permitted();
#else
  return false;
#endif
}

bool avx512_route() {
#ifdef LLMSERVE_LOWBIT_AVX512
  return true;
#else
  return false;
#endif
}

// Which route lowbit_linear takes here for bf16 activations: "amx", "avx512_bf16", or "" where neither was built.
std::string lowbit_linear_isa() { return amx_route() ? "amx" : avx512_route() ? "avx512_bf16" : ""; }

// The int8 route for bf16 activations: "avx512_int8" (AVX512-VNNI), or "" where it was not built.
std::string lowbit_linear_int8_isa() { return llmserve_lowbit::vnni_built() ? "avx512_int8" : ""; }

// The route for float32 activations: "avx2", or "" where it was not built.
std::string lowbit_linear_float32_isa() { return llmserve_lowbit::avx2_built() ? "avx2" : ""; }

void check_operands(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const std::optional<at::Tensor>& offsets, bool float32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == (float32 ? at::kFloat : at::kBFloat16), "lowbit_linear: x must be 2-D ",
              float32 ? "float32" : "bfloat16", " on this route");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "lowbit_linear: codes must be contiguous uint8 [N/32, K/32, bytes]");
  const int64_t K = x.size(1), block_bytes = codes.size(2);
  TORCH_CHECK(codes.size(1) * kGroup == K, "lowbit_linear: x has ", K, " columns, the weight ", codes.size(1) * kGroup);
  TORCH_CHECK(block_bytes == 512 || block_bytes == 1024, "lowbit_linear: 512 (4-bit) or 1024 (8-bit) bytes a block");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({codes.size(0), codes.size(1), kBlockN}),
              "lowbit_linear: scales must be contiguous float16 [N/32, K/32, 32]");
  TORCH_CHECK(offsets.has_value() == (block_bytes == 512),
              "lowbit_linear: 4-bit codes need offsets, 8-bit codes take none");
  if (offsets)
    TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "lowbit_linear: offsets must be shaped and typed like scales");
}

// x [M, K] bf16; codes [N / 32, K / 32, 32 * 32 * bits / 8] uint8 (see llmserve/layers/quant.py for the order);
// scales, offsets [N / 32, K / 32, 32] float16 (offsets for 4 bits only). Returns [M, N] bf16. `route` is "amx" or
// "avx512_bf16": the caller's choice, so that each route can be tested and measured on a CPU that has both; or
// "avx2", for float32 x (and a float32 result), or "avx2_int8", the same with x quantized to int8 per group of 32;
// or "avx512_int8", bf16 x quantized to int8 per group of 32, for 4-bit codes.
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& offsets, const std::string& route) {
  const bool float32 = route == "avx2" || route == "avx2_int8";
  const bool int8 = route == "avx512_int8";
  TORCH_CHECK((route == "amx" && amx_route()) || (route == "avx512_bf16" && avx512_route()) ||
                  (float32 && llmserve_lowbit::avx2_built()) || (int8 && llmserve_lowbit::vnni_built()),
              "lowbit_linear: the '", route, "' route is not available on this CPU or build (available: '",
              lowbit_linear_isa(), "', '", lowbit_linear_int8_isa(), "', '", lowbit_linear_float32_isa(), "')");
  check_operands(x, codes, scales, offsets, float32);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0) * kBlockN;
  const bool four_bits = codes.size(2) == 512;
  TORCH_CHECK(four_bits || !int8, "lowbit_linear: the 'avx512_int8' route takes 4-bit codes only");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (int8) {
    llmserve_lowbit::lowbit_gemm_vnni(xc.data_ptr<at::BFloat16>(), M, K, codes.data_ptr<uint8_t>(),
                                      scales.data_ptr<at::Half>(), offsets->data_ptr<at::Half>(), N,
                                      out.data_ptr<at::BFloat16>());
    return out;
  }
  if (float32) {
    llmserve_lowbit::lowbit_gemm_avx2(xc.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(),
                                      scales.data_ptr<at::Half>(), four_bits ? offsets->data_ptr<at::Half>() : nullptr,
                                      N, out.data_ptr<float>(), route == "avx2_int8");
    return out;
  }
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* op = four_bits ? offsets->data_ptr<at::Half>() : nullptr;
  at::BFloat16* outp = out.data_ptr<at::BFloat16>();
#ifdef LLMSERVE_AMX
  if (route == "amx") {
    if (four_bits && M <= kFewRows)
      lowbit_gemm_few_rows(xp, M, K, cp, sp, op, N, outp);
    else if (four_bits)
      lowbit_gemm<4>(xp, M, K, cp, sp, op, N, outp);
    else
      lowbit_gemm<8>(xp, M, K, cp, sp, op, N, outp);
    return out;
  }
#endif
#ifdef LLMSERVE_LOWBIT_AVX512
  if (four_bits)
    lowbit_gemm_avx512<4>(xp, M, K, cp, sp, op, N, outp);
  else
    lowbit_gemm_avx512<8>(xp, M, K, cp, sp, op, N, outp);
#endif
  return out;
}

// x [M, K] float32 times a float32 weight packed [N / 32, K / 2, 64] (llmserve/layers/quant/float_panel.py packs
// it): [M, N] float32, each row summed in an order that does not depend on M. AVX2 builds only.
at::Tensor float_panel_linear(const at::Tensor& x, const at::Tensor& panel) {
  TORCH_CHECK(llmserve_lowbit::avx2_built(), "float_panel_linear: needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "float_panel_linear: x must be 2-D float32");
  TORCH_CHECK(panel.dim() == 3 && panel.scalar_type() == at::kFloat && panel.is_contiguous() && panel.size(2) == 64,
              "float_panel_linear: the panel must be contiguous float32 [N/32, K/2, 64]");
  const int64_t M = x.size(0), K = x.size(1), N = panel.size(0) * kBlockN;
  TORCH_CHECK(panel.size(1) * 2 == K, "float_panel_linear: x has ", K, " columns, the weight ", panel.size(1) * 2);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0) llmserve_lowbit::float_panel_gemm(xc.data_ptr<float>(), M, K, panel.data_ptr<float>(), N, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_kernels, m) {
  m.def("float_panel_linear(Tensor x, Tensor panel) -> Tensor");
  m.def("lowbit_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, str route) -> Tensor");
  m.def("lowbit_linear_isa() -> str", &lowbit_linear_isa);
  m.def("lowbit_linear_float32_isa() -> str", &lowbit_linear_float32_isa);
  m.def("lowbit_linear_int8_isa() -> str", &lowbit_linear_int8_isa);
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) {
  m.impl("lowbit_linear", &lowbit_linear);
  m.impl("float_panel_linear", &float_panel_linear);
}
