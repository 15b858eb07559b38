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
// AMX only: torch's own weight-only kernels for CPU loop over rows with AVX-512 and lose to oneDNN's bf16 matmul
// from a handful of rows on (docs/performance.md). Built without AMX, lowbit_linear_available() is false and
// Python keeps to those.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"

namespace {

constexpr int64_t kGroup = 32;   // input columns per group, and per tile row (32 bf16 = 64 bytes)
constexpr int64_t kBlockN = 32;  // output columns per work item: two 16-column B tiles
constexpr int64_t kBlockM = 32;  // rows per pass: two 16-row A tiles
constexpr int64_t kPrefetchGroups = 8;  // how far ahead the weight stream is prefetched
// Up to this many rows, 4-bit steps scale partial sums instead of weights (lowbit_gemm_few_rows): measured faster
// up to 12 rows (22 % at 1 row), even at 16.
constexpr int64_t kFewRows = 12;

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

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 32 float32 results of one row to bf16 at `out`.
inline void store_bf16_row(const float* acc, at::BFloat16* out) {
  const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_load_ps(acc + 16), _mm512_load_ps(acc));
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(r));
}

// Asks for the codes, scales and offsets of the work item's group kPrefetchGroups ahead: the hardware prefetcher
// alone left the weight stream waiting on memory (~25 % slower, scratch measurement in docs/benchmarks.md).
inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes, const at::Half* scales, const at::Half* offsets) {
  const char* ahead = reinterpret_cast<const char*>(block + kPrefetchGroups * block_bytes);
  for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + kPrefetchGroups * kBlockN), _MM_HINT_T0);
  if (offsets) _mm_prefetch(reinterpret_cast<const char*>(offsets + kPrefetchGroups * kBlockN), _MM_HINT_T0);
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

// Steps of a few rows (4 bits): expanding every weight to its float value costs more than the few rows' products,
// so the tiles get the bare codes instead, as the bf16 numbers 128 + q (the code under 128's exponent: two bit
// operations for 64 codes, no arithmetic), and the scales are applied to each group's partial sums:
//   sum_k x_k (q_k d + m) = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k   over the group's 32 columns.
// The products are exact in float32 and the sums are float32, as in the other path.
void lowbit_gemm_few_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                          const at::Half* offsets, int64_t N, at::BFloat16* out) {
  constexpr int64_t kBlockBytes = 512, kExpanded = 2 * 16 * 32;
  const int64_t groups = K / kGroup, items = N / kBlockN;
  std::vector<float> row_sums(M * groups);  // sum of each row's activations over each group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 lo = _mm512_cvtpbh_ps(reinterpret_cast<const __m256bh&>(*(x + m * K + g * kGroup)));
      const __m512 hi = _mm512_cvtpbh_ps(reinterpret_cast<const __m256bh&>(*(x + m * K + g * kGroup + 16)));
      row_sums[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t buffer[2 * kExpanded];  // two groups: the next one's stores need not wait on this one's loads
    alignas(64) float partial[16 * kBlockN], acc[16 * kBlockN];
    configure_tiles(static_cast<int>(M), 0);
    const __m512i nibble = _mm512_set1_epi32(0x000F000F), bf16_128 = _mm512_set1_epi32(0x43004300);
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
        for (int pair = 0; pair < 16; ++pair) {  // both tiles' 8 row pairs, 32 bytes each
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * pair)));
          const __m512i first = _mm512_ternarylogic_epi32(v, nibble, bf16_128, 0xEA);  // (a & b) | c
          const __m512i second = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, bf16_128, 0xEA);
          _mm512_store_si512(w + 64 * pair, first);
          _mm512_store_si512(w + 64 * pair + 32, second);
        }
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

bool lowbit_linear_available() {
#ifdef LLMSERVE_AMX
  return llmserve_amx::permitted();
#else
  return false;
#endif
}

// x [M, K] bf16; codes [N / 32, K / 32, 32 * 32 * bits / 8] uint8 (see llmserve/layers/quant.py for the order);
// scales, offsets [N / 32, K / 32, 32] float16 (offsets for 4 bits only). Returns [M, N] bf16.
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& offsets) {
  TORCH_CHECK(lowbit_linear_available(), "lowbit_linear needs AMX (bf16 tiles), which this CPU or build lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "lowbit_linear: x must be 2-D bfloat16");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "lowbit_linear: codes must be contiguous uint8 [N/32, K/32, bytes]");
  const int64_t K = x.size(1), N = codes.size(0) * kBlockN, block_bytes = codes.size(2);
  TORCH_CHECK(codes.size(1) * kGroup == K, "lowbit_linear: x has ", K, " columns, the weight ", codes.size(1) * kGroup);
  TORCH_CHECK(block_bytes == 512 || block_bytes == 1024, "lowbit_linear: 512 (4-bit) or 1024 (8-bit) bytes a block");
  const bool four_bits = block_bytes == 512;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({codes.size(0), codes.size(1), kBlockN}),
              "lowbit_linear: scales must be contiguous float16 [N/32, K/32, 32]");
  TORCH_CHECK(offsets.has_value() == four_bits, "lowbit_linear: 4-bit codes need offsets, 8-bit codes take none");
  if (four_bits)
    TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "lowbit_linear: offsets must be shaped and typed like scales");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
#ifdef LLMSERVE_AMX
  const at::Half* off = four_bits ? offsets->data_ptr<at::Half>() : nullptr;
  if (four_bits && x.size(0) <= kFewRows)
    lowbit_gemm_few_rows(xc.data_ptr<at::BFloat16>(), x.size(0), K, codes.data_ptr<uint8_t>(),
                         scales.data_ptr<at::Half>(), off, N, out.data_ptr<at::BFloat16>());
  else if (four_bits)
    lowbit_gemm<4>(xc.data_ptr<at::BFloat16>(), x.size(0), K, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                   off, N, out.data_ptr<at::BFloat16>());
  else
    lowbit_gemm<8>(xc.data_ptr<at::BFloat16>(), x.size(0), K, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                   off, N, out.data_ptr<at::BFloat16>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_kernels, m) {
  m.def("lowbit_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets) -> Tensor");
  m.def("lowbit_linear_available() -> bool", &lowbit_linear_available);
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) {
  m.impl("lowbit_linear", &lowbit_linear);
}
