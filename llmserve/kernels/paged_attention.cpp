// Decode attention over the paged KV cache on CPU: one query per sequence, keys and values read where they lie
// in the cache blocks. torch has no paged attention for CPU, so the Python path first gathers every sequence's
// blocks into a padded copy and then runs SDPA over it with a mask: three passes over the KV bytes where this
// kernel makes one, and it skips the padding.
//
// Work is split by sequence, and when there are fewer sequences than threads, by ranges of a sequence's keys
// whose partial softmaxes are merged at the end. A sequence's keys are taken kSpan at a time: first every head's
// scores for the span, a block's piece at a time, then one online-softmax update per head, then the values, a
// piece at a time, summed by every query head of their KV head (GQA without copies). The softmax is in float32
// whatever the cache dtype.
// - Where the CPU multiplies bf16 (AVX512-BF16) and the query is bf16, K and V rows are read where they lie: the
//   scores are vdpbf16ps dot products, and the value sums take two keys per vdpbf16ps, their rows interleaved in
//   registers, against the probabilities rounded to bf16 (as the prompt kernel and torch's flash attention round
//   them). With AMX the scores of 16 keys against every query head of their KV head are one tile product instead
//   (AmxScores).
// - Otherwise each piece's K and V rows are converted to float32 in small L1 buffers; with AVX-512 the dot products,
//   the value sums and exp run on 16 floats at a time with the accumulators in registers (with AVX2 alone, 8 at a
//   time); elsewhere the same loops are left to the compiler's vectorizer.
// The next piece's lines are requested into L2 a few at a time while a piece is computed (LineRequests), and a
// thread's next sequence's first block during this one's last: the blocks lie anywhere in the pool, and at serving
// sizes the kernel streams K and V from memory.
//
// The cache may be FP8 (e4m3fn, --kv-cache-dtype fp8) under a bf16 or float32 query: half the bytes of bf16, and at
// serving sizes this kernel streams K and V from memory. Each piece is converted exactly (every e4m3 value is a bf16
// and a float32; by table lookup where the CPU has AVX512-VBMI) into an L1 buffer, to bf16 on the bf16 route and to
// float32 otherwise, so the arithmetic is the bf16 cache's on the dequantized values; k_scale and v_scale (the
// stored value times the scale is the real one) are applied to the scores and to the output.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "simd_exp.h"

namespace {

constexpr int kSpan = 128;      // keys scored (every head) before their values are summed: one softmax update each
constexpr int kMaxHeads = 256;  // query heads (kMaxHeads and kMaxDim: MAX_QUERY_HEADS, MAX_HEAD_DIM in __init__.py)
constexpr int kMaxDim = 1024;   // head_dim
constexpr int64_t kMinPartKeys = 256;  // a sequence's keys are split across threads only in ranges this long

using Fp8 = c10::Float8_e4m3fn;

template <typename T>
inline void to_float(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An FP8 cache is read in units of 2^-8: the conversions below give each value times 2^-8 (exactly), and the kernel
// multiplies the scores and the output by 256 instead (folded into the scales it applies anyway).
constexpr float kFp8Unit = 256.f;

#if defined(__AVX512VBMI__)
// e4m3fn to bf16 (times 2^-8) by table lookup: the 7 magnitude bits index two 128-byte tables, the bf16's high and
// low bytes, and vpermi2b looks up 64 values per instruction; the sign bit is copied across and the bytes are
// interleaved into words (or into float32's upper half, the low half zero). Six instructions per 64 values to bf16,
// eight to float32, where the path through float16 below takes about twenty.
struct Fp8Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t to_bf16[2][64];   // byte interleave: words 0-31, then 32-63
  alignas(64) uint8_t to_float[4][64];  // float32 k covers values 16k .. 16k + 15
  Fp8Tables() {
    for (int m = 0; m < 128; ++m) {
      const float f = static_cast<float>(Fp8(static_cast<uint8_t>(m), Fp8::from_bits())) / kFp8Unit;
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);  // exact in bf16: at most 4 significant bits
      hi[m] = static_cast<uint8_t>(bits >> 24);
      lo[m] = static_cast<uint8_t>(bits >> 16);
    }
    // in vpermt2b's index, 0-63 pick from the low bytes and 64-127 from the high ones
    for (int j = 0; j < 64; ++j)
      for (int half = 0; half < 2; ++half) to_bf16[half][j] = static_cast<uint8_t>(32 * half + j / 2 + (j % 2) * 64);
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 64; ++j) to_float[k][j] = static_cast<uint8_t>(16 * k + j / 4 + (j % 4 == 3) * 64);
  }
};
inline const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}
constexpr __mmask64 kFloatUpperHalves = 0xCCCCCCCCCCCCCCCCull;  // bytes 2 and 3 of every float32

// 64 e4m3fn values: the high (sign included) and low bytes of their bf16s.
inline void fp8x64_lookup(const Fp8* src, const Fp8Tables& t, __m512i* lo, __m512i* hi) {
  const __m512i x = _mm512_loadu_si512(src);
  *lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), x, _mm512_load_si512(t.lo + 64));
  const __m512i h = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), x, _mm512_load_si512(t.hi + 64));
  *hi = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // h | (x & 0x80)
}
#endif

#if defined(__AVX512F__)
// 32 e4m3fn values to float16 bits, times 2^-8, exactly: the e4m3 bits s.eeee.mmm placed as the float16
// s.0eeee.mmm0000000 are the same number times 2^-8, subnormals included (both formats' subnormals line up there).
inline __m512i fp8x32_to_half(const Fp8* src) {
  // sign-extended, the sign fills bits 7-15: shifted by 7 it lands in bit 15 (and 14, which the mask clears)
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_and_si512(_mm512_slli_epi16(wide, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
}
#endif

// e4m3fn values times 2^-8 to float32, exactly
inline void to_float(const Fp8* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512VBMI__)
  const Fp8Tables& t = fp8_tables();
  for (; i + 64 <= n; i += 64) {
    __m512i lo, hi;
    fp8x64_lookup(src + i, t, &lo, &hi);
    for (int k = 0; k < 4; ++k)
      _mm512_storeu_si512(dst + i + 16 * k,
                          _mm512_maskz_permutex2var_epi8(kFloatUpperHalves, lo, _mm512_load_si512(t.to_float[k]), hi));
  }
#endif
#if defined(__AVX512F__)
  for (; i + 32 <= n; i += 32) {  // vcvtph2ps is exact
    const __m512i half = fp8x32_to_half(src + i);
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm512_castsi512_si256(half)));
    _mm512_storeu_ps(dst + i + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) / kFp8Unit;
}

#if defined(__AVX512BF16__)
// e4m3fn keys times 2^-8 to bf16 for the bf16 dot products, exactly (3 bits of mantissa fit in bf16's 7).
inline void fp8_to_bf16(const Fp8* __restrict src, at::BFloat16* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512VBMI__)
  const Fp8Tables& t = fp8_tables();
  for (; i + 64 <= n; i += 64) {
    __m512i lo, hi;
    fp8x64_lookup(src + i, t, &lo, &hi);
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.to_bf16[0]), hi));
    _mm512_storeu_si512(dst + i + 32, _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.to_bf16[1]), hi));
  }
#endif
  for (; i + 32 <= n; i += 32) {
    const __m512i half = fp8x32_to_half(src + i);
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)),
                                              _mm512_cvtph_ps(_mm512_castsi512_si256(half)));
    _mm512_storeu_si512(dst + i, (__m512i)pair);
  }
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(static_cast<float>(src[i]) / kFp8Unit);
}
#endif

// The portable inner loops; head_dim given at run time.
struct Portable {
  static constexpr bool kRawKeys = false;  // keys are converted to float32 before the dot products
  static constexpr bool kRawValues = false;  // values are converted to float32 before their sums
  static float dot(const float* __restrict a, const float* __restrict b, int d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
  }
  // scores[0..n) <- exp(scores - mx); returns their sum
  static float exp_sum(float* __restrict scores, int n, float mx) {
    float sum = 0.f;
    for (int t = 0; t < n; ++t) {
      scores[t] = std::exp(scores[t] - mx);
      sum += scores[t];
    }
    return sum;
  }
  // for each of the heads query heads i sharing these values: acc[i * acc_stride ..][0..d) += sum_t p[i * p_stride + t] * v[t * stride ..]
  static void accumulate(float* __restrict acc, int64_t acc_stride, int heads, const float* __restrict p, int64_t p_stride,
                         const float* __restrict v, int64_t stride, int n, int d) {
    for (int i = 0; i < heads; ++i) {
      float* __restrict a = acc + i * acc_stride;
      const float* __restrict pi = p + i * p_stride;
      for (int t = 0; t < n; ++t) {
#pragma omp simd
        for (int j = 0; j < d; ++j) a[j] += pi[t] * v[t * stride + j];
      }
    }
  }
};

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp(x) for x <= 0, as exp16 below on 8 floats: 2^n built in the exponent bits (n >= -126 after the clamp).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// CPUs with AVX2 but not AVX-512 (AMD Zen 1-3, Intel client cores): the Avx512 path's (below) loops on 8 floats. head_dim a
// multiple of 8 known at compile time; a head's accumulator is D / 8 registers, so heads are summed one at a time.
template <int D>
struct Avx2 {
  static_assert(D % 8 == 0 && D > 0 && D <= 128, "AVX2 path needs head_dim a multiple of 8, at most 128");
  static constexpr int kVec = D / 8;
  static constexpr bool kRawKeys = false;
  static constexpr bool kRawValues = false;

  static float dot(const float* __restrict a, const float* __restrict b, int) {
    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)), s1 = _mm256_setzero_ps();
    for (int j = 1; j < kVec; ++j) {
      const __m256 prod_in = _mm256_loadu_ps(a + 8 * j);
      if (j % 2) s1 = _mm256_fmadd_ps(prod_in, _mm256_loadu_ps(b + 8 * j), s1);
      else s0 = _mm256_fmadd_ps(prod_in, _mm256_loadu_ps(b + 8 * j), s0);
    }
    return sum8(_mm256_add_ps(s0, s1));
  }
  static float exp_sum(float* __restrict scores, int n, float mx) {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), m));
      _mm256_storeu_ps(scores + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = sum8(sum);
    if (t < n) {  // the tail through a padded copy: AVX2 has no masked float loads and stores of every width
      alignas(32) float tail[8];
      for (int i = 0; i < 8; ++i) tail[i] = t + i < n ? scores[t + i] : mx - 100.f;
      _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), m)));
      for (int i = 0; t + i < n; ++i) {
        scores[t + i] = tail[i];
        total += tail[i];
      }
    }
    return total;
  }
  static void accumulate(float* __restrict acc, int64_t acc_stride, int heads, const float* __restrict p, int64_t p_stride,
                         const float* __restrict v, int64_t stride, int n, int) {
    for (int i = 0; i < heads; ++i) {
      float* __restrict ai = acc + i * acc_stride;
      const float* __restrict pi = p + i * p_stride;
      __m256 a[kVec];
      for (int j = 0; j < kVec; ++j) a[j] = _mm256_loadu_ps(ai + 8 * j);
      for (int t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(pi[t]);
        for (int j = 0; j < kVec; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + t * stride + 8 * j), a[j]);
      }
      for (int j = 0; j < kVec; ++j) _mm256_storeu_ps(ai + 8 * j, a[j]);
    }
  }
};
#endif

#if defined(__AVX512F__)
// head_dim a multiple of 16, known at compile time: a head's query, or its accumulator, is D / 16 registers.
template <int D>
struct Avx512 {
  static_assert(D % 16 == 0 && D > 0, "AVX-512 path needs head_dim a multiple of 16");
  static constexpr int kVec = D / 16;
  static constexpr bool kRawKeys = false;
  static constexpr bool kRawValues = false;
  static constexpr int kFuse = std::max(1, std::min(4, 16 / kVec));  // heads summed together: <= 16 accumulators

  static float dot(const float* __restrict a, const float* __restrict b, int) {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int j = 1; j < kVec; ++j) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * j), _mm512_loadu_ps(b + 16 * j), s);
    return _mm512_reduce_add_ps(s);
  }
  static float exp_sum(float* __restrict scores, int n, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
      const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), m));
      _mm512_mask_storeu_ps(scores + t, live, e);
      sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
  // NH heads at once: each value row is loaded once for all of them, and their NH * kVec accumulators are independent
  // chains (one head's kVec chains alone would wait on the FMA latency).
  template <int NH>
  static void accumulate_fused(float* __restrict acc, int64_t acc_stride, const float* __restrict p, int64_t p_stride,
                               const float* __restrict v, int64_t stride, int n) {
    __m512 a[NH][kVec];
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < kVec; ++j) a[i][j] = _mm512_loadu_ps(acc + i * acc_stride + 16 * j);
    for (int t = 0; t < n; ++t) {
      __m512 vt[kVec];
      for (int j = 0; j < kVec; ++j) vt[j] = _mm512_loadu_ps(v + t * stride + 16 * j);
      for (int i = 0; i < NH; ++i) {
        const __m512 pt = _mm512_set1_ps(p[i * p_stride + t]);
        for (int j = 0; j < kVec; ++j) a[i][j] = _mm512_fmadd_ps(pt, vt[j], a[i][j]);
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < kVec; ++j) _mm512_storeu_ps(acc + i * acc_stride + 16 * j, a[i][j]);
  }
  // Calls fn(std::integral_constant<int, NH>, first head) for the heads in chunks of up to kFuse (four only where D
  // is 64 or less), so that each chunk's sums run with NH known at compile time.
  template <typename Fn>
  static void in_fused_chunks(int heads, Fn&& fn) {
    for (int i = 0; i < heads;) {
      const int nh = std::min(kFuse, heads - i);
      switch (nh) {
        case 1: fn(std::integral_constant<int, 1>{}, i); break;
        case 2: fn(std::integral_constant<int, 2>{}, i); break;
        case 3: fn(std::integral_constant<int, 3>{}, i); break;
        default: fn(std::integral_constant<int, 4>{}, i); break;
      }
      i += nh;
    }
  }
  static void accumulate(float* __restrict acc, int64_t acc_stride, int heads, const float* __restrict p, int64_t p_stride,
                         const float* __restrict v, int64_t stride, int n, int) {
    in_fused_chunks(heads, [&](auto nh, int i) {
      accumulate_fused<decltype(nh)::value>(acc + i * acc_stride, acc_stride, p + i * p_stride, p_stride, v, stride, n);
    });
  }
};

#if defined(__AVX512BF16__)
// bf16 cache on CPUs with AVX512_BF16: q.k straight from the bf16 rows with vdpbf16ps (products exact in float32,
// float32 sums), so keys are never converted; the scale is applied to the score instead.
template <int D>
struct Avx512Bf16 : Avx512<D> {
  static_assert(D % 32 == 0, "vdpbf16ps takes 32 bf16 at a time");
  static constexpr bool kRawKeys = true;
  static constexpr bool kRawValues = true;
  using Avx512<D>::kVec;
  // scores[t] = scale * q.k_t for the n keys at k + t * stride; returns max(mx, scores). Sixteen keys at a time: their
  // sixteen vectors of partial sums are reduced together (a transpose-and-add tree, 45 shuffles and adds) rather
  // than one horizontal sum per key (~7 each).
  static float scores_raw(const at::BFloat16* __restrict q, const at::BFloat16* __restrict k, int64_t stride, int n,
                          float scale, float* __restrict scores, float mx) {
    __m512bh qv[D / 32];
    for (int j = 0; j < D / 32; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
    __m512 best = _mm512_set1_ps(mx);
    for (int t0 = 0; t0 < n; t0 += 16) {
      const int count = std::min(16, n - t0);
      __m512 s[16];
      for (int t = 0; t < 16; ++t) {
        s[t] = _mm512_setzero_ps();
        if (t < count)
          for (int j = 0; j < D / 32; ++j)
            s[t] = _mm512_dpbf16_ps(s[t], qv[j], (__m512bh)_mm512_loadu_si512(k + (t0 + t) * stride + 32 * j));
      }
      __m512 pairs[8], quads[4], halves[2];
      for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
      for (int i = 0; i < 4; ++i)  // per 128-bit lane: keys 4i .. 4i + 3, in order
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
      for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3 of two quads side by side
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
      const __m512 total = _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                                                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD)),
                                         _mm512_set1_ps(scale));
      const __mmask16 live = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
      _mm512_mask_storeu_ps(scores + t0, live, total);
      best = _mm512_mask_max_ps(best, live, best, total);
    }
    return _mm512_reduce_max_ps(best);
  }

  // probs[0..n) <- exp(scores - mx) rounded to bf16 for the value product (as the prompt kernel and torch's flash
  // attention round them); returns the sum of the unrounded exps, the softmax's denominator.
  static float exp_sum_bf16(const float* __restrict scores, at::BFloat16* __restrict probs, int n, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
      const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), m));
      const __m256bh rounded = _mm512_cvtneps_pbh(e);
      _mm256_mask_storeu_epi16(probs + t, live, reinterpret_cast<const __m256i&>(rounded));
      sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }

  // vpermt2w indices that interleave two value rows x, y (32 dimensions each) into pairs of keys: word 2i of the
  // first result is x[i], word 2i + 1 is y[i] (i < 16); the second result does dimensions 16-31.
  struct PairIndex {
    alignas(64) uint16_t words[2][32];
    constexpr PairIndex() : words{} {
      for (int half = 0; half < 2; ++half)
        for (int i = 0; i < 16; ++i) {
          words[half][2 * i] = static_cast<uint16_t>(16 * half + i);
          words[half][2 * i + 1] = static_cast<uint16_t>(32 + 16 * half + i);
        }
    }
  };
  static constexpr PairIndex kPairIndex{};

  // NH heads' sums over the n value rows at v (bf16, as they lie): the rows are interleaved two keys at a time, so
  // one vdpbf16ps adds two keys' products for 16 dimensions against the pair of the keys' probabilities. A row is
  // read once for every head, and never converted to float32.
  template <int NH>
  static void accumulate_pairs(float* __restrict acc, int64_t acc_stride, const at::BFloat16* __restrict p,
                               int64_t p_stride, const at::BFloat16* __restrict v, int64_t stride, int n) {
    __m512 a[NH][kVec];
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < kVec; ++j) a[i][j] = _mm512_loadu_ps(acc + i * acc_stride + 16 * j);
    const __m512i first = _mm512_load_si512(kPairIndex.words[0]), second = _mm512_load_si512(kPairIndex.words[1]);
    auto add_pair = [&](const at::BFloat16* x_row, const at::BFloat16* y_row, const uint32_t* pair_of_probs) {
      __m512i w[kVec];
      for (int c = 0; c < D / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(x_row + 32 * c);
        const __m512i y = y_row ? _mm512_loadu_si512(y_row + 32 * c) : _mm512_setzero_si512();
        w[2 * c] = _mm512_permutex2var_epi16(x, first, y);
        w[2 * c + 1] = _mm512_permutex2var_epi16(x, second, y);
      }
      for (int i = 0; i < NH; ++i) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of_probs[i]));
        for (int j = 0; j < kVec; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], pp, (__m512bh)w[j]);
      }
    };
    uint32_t pairs[NH];
    int t = 0;
    for (; t + 2 <= n; t += 2) {
      for (int i = 0; i < NH; ++i) std::memcpy(&pairs[i], p + i * p_stride + t, sizeof(uint32_t));
      add_pair(v + t * stride, v + (t + 1) * stride, pairs);
    }
    if (t < n) {  // an odd last key, paired with a zero row and a zero probability
      for (int i = 0; i < NH; ++i) {
        uint16_t bits;
        std::memcpy(&bits, p + i * p_stride + t, sizeof bits);
        pairs[i] = bits;
      }
      add_pair(v + t * stride, nullptr, pairs);
    }
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < kVec; ++j) _mm512_storeu_ps(acc + i * acc_stride + 16 * j, a[i][j]);
  }

  // as Avx512::accumulate, on bf16 probabilities and values
  static void accumulate_raw(float* __restrict acc, int64_t acc_stride, int heads, const at::BFloat16* __restrict p,
                             int64_t p_stride, const at::BFloat16* __restrict v, int64_t stride, int n) {
    Avx512<D>::in_fused_chunks(heads, [&](auto nh, int i) {
      accumulate_pairs<decltype(nh)::value>(acc + i * acc_stride, acc_stride, p + i * p_stride, p_stride, v, stride, n);
    });
  }
};
#endif
#endif

#if defined(LLMSERVE_AMX)
// q.k with AMX tiles, every query head of a KV head at once: 16 keys as they lie are the A tile (a row each, 32 dims,
// the rows a slot apart), the group's queries the B tile (pairs of dims down, heads across, arranged once per
// sequence), and tdpbf16ps gives the 16 x group scores in float32 (exact products, float32 sums). This replaces,
// per head, the AVX-512 path's two dot products per key and its reduction tree over every 16 keys, which took as
// long as the products. Tiles: 0 the scores, 1 the keys, 2 the queries. Used where the blocks hold a multiple of
// 16 keys: a piece's last tile may read up to 15 rows past its keys, which then lie in the same block (or in the
// keys buffer) and whose scores are dropped.
struct AmxScores {
  static constexpr int kMaxGroup = 16;  // a B tile row holds 16 pairs

  static void configure(int group) {
    llmserve_amx::TileConfig cfg;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
    cfg.colsb[0] = cfg.colsb[2] = static_cast<uint16_t>(4 * group);
    cfg.colsb[1] = 64;
    _tile_loadconfig(&cfg);
  }

  // pairs[((g * chunks + c) * 16 + i) * group + j] = dims 32c + 2i, 32c + 2i + 1 of query head g * group + j.
  static void arrange(const at::BFloat16* __restrict q, int heads, int group, int d, uint32_t* __restrict pairs) {
    const int chunks = d / 32;
    for (int h = 0; h < heads; ++h) {
      const int g = h / group, j = h % group;
      for (int c = 0; c < chunks; ++c)
        for (int i = 0; i < 16; ++i) {
          uint32_t word;
          std::memcpy(&word, q + static_cast<int64_t>(h) * d + 32 * c + 2 * i, sizeof word);
          pairs[((g * chunks + c) * 16 + i) * group + j] = word;
        }
    }
  }

  static float max(const float* __restrict x, int n) {
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int t = 0; t < n; t += 16) {
      const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
      best = _mm512_mask_max_ps(best, live, best, _mm512_maskz_loadu_ps(live, x + t));
    }
    return _mm512_reduce_max_ps(best);
  }

  // scores[h * kSpan + t] = scale * q_h.k_t for the n keys at keys + t * stride (KV head g's at + g * d), every head.
  static void scores(const uint32_t* __restrict pairs, const at::BFloat16* __restrict keys, int64_t stride, int n,
                     int kv_heads, int group, int d, float scale, float* __restrict scores) {
    const int chunks = d / 32;
    alignas(64) float tile[16 * kMaxGroup + 16];  // 16 keys x group, and a vector's overrun for the permutes
    const __m512i row_starts = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(group));
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < kv_heads; ++g) {
      const at::BFloat16* kg = keys + static_cast<int64_t>(g) * d;
      const uint32_t* qg = pairs + g * chunks * 16 * group;
      for (int t0 = 0; t0 < n; t0 += 16) {
        _tile_zero(0);
        for (int c = 0; c < chunks; ++c) {
          _tile_loadd(1, kg + t0 * stride + 32 * c, stride * 2);
          _tile_loadd(2, qg + c * 16 * group, 4 * group);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, tile, 4 * group);
        const int count = std::min(16, n - t0);
        const __mmask16 live = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
        for (int j = 0; j < group; ++j) {  // head j's column: tile[t * group + j], from 32 floats per permute
          const __m512i index = _mm512_add_epi32(row_starts, _mm512_set1_epi32(j));
          const __m512i pair = _mm512_srli_epi32(index, 5);  // which 32 floats; the permute reads the low 5 bits
          __m512 column = _mm512_setzero_ps();
          for (int base = 0; base < 16 * group; base += 32) {
            const __mmask16 here = _mm512_cmpeq_epi32_mask(pair, _mm512_set1_epi32(base / 32));
            column = _mm512_mask_mov_ps(column, here, _mm512_permutex2var_ps(_mm512_load_ps(tile + base), index,
                                                                             _mm512_load_ps(tile + base + 16)));
          }
          _mm512_mask_storeu_ps(scores + (g * group + j) * kSpan + t0, live, _mm512_mul_ps(column, sc));
        }
      }
    }
  }
};
#endif

// The K and V lines of the pieces ahead, requested into L2 a few lines at a time between the computations: a
// piece's ~200 requests at once filled the core's miss buffers and held it until they drained, so that memory and
// compute took turns (in a scratch loop of the same reads with the same requests spread out: 1.4-1.5x). Into L1 the
// lines would evict the piece being computed (slower on Zen 4: docs/benchmarks-history.md).
template <typename C>
struct LineRequests {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0;  // of the piece at k and v, not yet requested

  void set(const C* k_cache, const C* v_cache, int64_t first, int64_t count) {
    k = reinterpret_cast<const char*>(k_cache + first);
    v = reinterpret_cast<const char*>(v_cache + first);
    bytes = count * static_cast<int64_t>(sizeof(C));
  }
  // Requests up to `lines` lines of K and as many of V; returns how many of the `lines` were left over.
  int64_t issue(int64_t lines) {
    for (; lines > 0 && bytes > 0; --lines, k += 64, v += 64, bytes -= 64) {
      __builtin_prefetch(k, 0, 2);
      __builtin_prefetch(v, 0, 2);
    }
    return lines;
  }
};

// One sequence's keys [key_begin, key_end), all heads. Writes the unnormalized partial result: partial[h] is
// (acc[0..d), running max, running sum) of head h. T: the query's dtype; C: the cache's (T, or Fp8); scale includes
// k_scale. Keys are taken kSpan at a time: every head's scores for the span (read a block's piece at a time, never
// across a block), one online-softmax update per head, then the values, a piece at a time, converted once to float32
// in an L1 buffer that every query head of a KV head reads (GQA without copies).
// With raw values (the bf16 route) the probabilities are rounded to bf16 and the value rows are summed as they lie,
// two keys per product (Ops::accumulate_raw); an FP8 piece is converted to bf16 in the values buffer first.
// work: heads * d + heads * kSpan + 2 * block_piece * kv_heads * d + heads * kSpan / 2 floats,
// block_piece = min(block_size, kSpan).
template <typename T, typename C, typename Ops>
void attend_sequence(const T* __restrict q, float* __restrict partial, int heads, int kv_heads, int d,
                     const C* __restrict k_cache, const C* __restrict v_cache, const int64_t* __restrict table,
                     int64_t key_begin, int64_t key_end, int64_t block_size, float scale, float softcap,
                     float* __restrict work, bool amx, LineRequests<C> after) {
  const int groups = heads / kv_heads;
  const int64_t slot_stride = static_cast<int64_t>(kv_heads) * d;
  const int64_t row = d + 2;
  const int64_t piece_max = std::min<int64_t>(block_size, kSpan);
  float* __restrict qf = work;                          // [heads, d], pre-scaled
  float* __restrict scores = qf + heads * d;            // [heads, kSpan]
  float* __restrict keys = scores + heads * kSpan;      // [piece, kv_heads * d]
  float* __restrict values = keys + piece_max * slot_stride;
  // [heads, kSpan]: the probabilities rounded for the bf16 value sums
  at::BFloat16* __restrict probs = reinterpret_cast<at::BFloat16*>(values + piece_max * slot_stride);
  float m[kMaxHeads], l[kMaxHeads];
  if constexpr (!Ops::kRawKeys) {
    to_float(q, qf, static_cast<int64_t>(heads) * d);
    for (int64_t i = 0; i < static_cast<int64_t>(heads) * d; ++i) qf[i] *= scale;
  }
#if defined(LLMSERVE_AMX)
  uint32_t* __restrict q_pairs = reinterpret_cast<uint32_t*>(qf);  // raw keys leave qf unused
  if constexpr (Ops::kRawKeys)
    if (amx) AmxScores::arrange(q, heads, groups, d, q_pairs);
#endif
  for (int h = 0; h < heads; ++h) {
    std::fill(partial + h * row, partial + h * row + d, 0.f);
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  // The piece of keys from `start` to the end of its block (or of the span): its first cache slot and length.
  auto piece = [&](int64_t start, int64_t limit, int64_t* slot) {
    *slot = table[start / block_size] * block_size + start % block_size;
    return static_cast<int>(std::min(block_size - start % block_size, limit - start));
  };
  // Each piece's lines are requested while the one before it is computed, and during a span's values the next
  // span's; then `after`, the thread's next sequence's first piece. A sequence's first piece is asked for again at its
  // start (already in L2 where the previous sequence asked for it; skipping that measured level).
  LineRequests<C> requests;
  int64_t requested = key_begin;  // the pieces before this key are in `requests` or done
  auto request = [&](int64_t key, int64_t lines) {  // up to `lines` lines of the pieces that start before `key`
    while ((lines = requests.issue(lines)) > 0) {
      if (requested < key && requested < key_end) {
        int64_t slot;
        const int n = piece(requested, key_end, &slot);
        requests.set(k_cache, v_cache, slot * slot_stride, n * slot_stride);
        requested += n;
      } else if (requested >= key_end && after.bytes > 0) {
        requests = after;
        after.bytes = 0;
      } else {
        return;
      }
    }
  };
  const int64_t piece_lines = (piece_max * slot_stride * static_cast<int64_t>(sizeof(C)) + 63) / 64;
  const int64_t head_lines = (piece_lines + heads - 1) / heads;  // a piece's lines spread over its heads' scores
  const int64_t group_lines = (piece_lines + kv_heads - 1) / kv_heads;  // or over its KV heads' value sums
  const int64_t all_lines = std::numeric_limits<int64_t>::max();
  for (int64_t span = key_begin; span < key_end; span += kSpan) {
    const int64_t span_end = std::min<int64_t>(span + kSpan, key_end);
    const int span_n = static_cast<int>(span_end - span);
    float span_max[kMaxHeads];
    std::fill(span_max, span_max + heads, -std::numeric_limits<float>::infinity());
    for (int64_t start = span; start < span_end;) {
      int64_t slot;
      const int n = piece(start, span_end, &slot);
      const int64_t next = start + n;
      request(next, all_lines);  // this piece's lines, if the ones before did not ask for them
      const C* k_rows = k_cache + slot * slot_stride;
      const int offset = static_cast<int>(start - span);
      if constexpr (Ops::kRawKeys) {
        // Raw keys are read where they lie in a bf16 cache, and from a bf16 copy in the keys buffer for FP8.
        const T* raw_keys;
        if constexpr (std::is_same_v<C, T>) {
          raw_keys = k_rows;
        } else {
          fp8_to_bf16(k_rows, reinterpret_cast<T*>(keys), n * slot_stride);
          raw_keys = reinterpret_cast<const T*>(keys);
        }
#if defined(LLMSERVE_AMX)
        if (amx) {  // every head in one call: the next piece's lines go before it
          request(next + 1, all_lines);
          AmxScores::scores(q_pairs, raw_keys, slot_stride, n, kv_heads, groups, d, scale, scores + offset);
          start = next;
          continue;
        }
#endif
        for (int h = 0; h < heads; ++h) {
          request(next + 1, head_lines);
          span_max[h] = Ops::scores_raw(q + static_cast<int64_t>(h) * d, raw_keys + static_cast<int64_t>(h / groups) * d,
                                        slot_stride, n, scale, scores + h * kSpan + offset, span_max[h]);
        }
      } else {
        // A float32 cache is read where it lies: a copy into the buffer would be the same numbers, and for prompt
        // rows (the deterministic mode attends them here one by one) the copies cost more than the products.
        const float* piece_keys;
        if constexpr (std::is_same_v<C, float>) {
          piece_keys = k_rows;
        } else {
          to_float(k_rows, keys, n * slot_stride);
          piece_keys = keys;
        }
        for (int h = 0; h < heads; ++h) {
          request(next + 1, head_lines);
          const float* __restrict qh = qf + static_cast<int64_t>(h) * d;
          const float* __restrict kh = piece_keys + static_cast<int64_t>(h / groups) * d;
          float* __restrict sc = scores + h * kSpan + offset;
          for (int t = 0; t < n; ++t) {
            sc[t] = Ops::dot(qh, kh + t * slot_stride, d);
            span_max[h] = std::max(span_max[h], sc[t]);
          }
        }
      }
      start = next;
    }
#if defined(LLMSERVE_AMX)
    if (amx)
      for (int h = 0; h < heads; ++h) span_max[h] = AmxScores::max(scores + h * kSpan, span_n);
#endif
    if (softcap > 0.f) {  // Gemma 2's soft-capping, cap * tanh(score / cap), before the softmax (rare: scalar)
      for (int h = 0; h < heads; ++h) {
        float* __restrict sc = scores + h * kSpan;
        span_max[h] = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < span_n; ++t) {
          sc[t] = softcap * std::tanh(sc[t] / softcap);
          span_max[h] = std::max(span_max[h], sc[t]);
        }
      }
    }
    for (int h = 0; h < heads; ++h) {  // the online softmax, once per span
      const float mx = std::max(m[h], span_max[h]);
      const float correction = std::exp(m[h] - mx);  // exp(-inf) = 0 on the first span
      if constexpr (Ops::kRawValues)
        l[h] = l[h] * correction + Ops::exp_sum_bf16(scores + h * kSpan, probs + h * kSpan, span_n, mx);
      else
        l[h] = l[h] * correction + Ops::exp_sum(scores + h * kSpan, span_n, mx);
      m[h] = mx;
      if (correction != 1.f)
        for (int i = 0; i < d; ++i) partial[h * row + i] *= correction;
    }
    for (int64_t start = span; start < span_end;) {
      int64_t slot;
      const int n = piece(start, span_end, &slot);
      const int offset = static_cast<int>(start - span);
      const int64_t ahead = span_end + offset + n + 1;  // the next span's piece at the same offset
      if constexpr (Ops::kRawValues) {
        const T* raw_values;
        if constexpr (std::is_same_v<C, T>) {
          raw_values = v_cache + slot * slot_stride;
        } else {
          fp8_to_bf16(v_cache + slot * slot_stride, reinterpret_cast<T*>(values), n * slot_stride);
          raw_values = reinterpret_cast<const T*>(values);
        }
        for (int g = 0; g < kv_heads; ++g) {
          request(ahead, group_lines);
          Ops::accumulate_raw(partial + static_cast<int64_t>(g) * groups * row, row, groups,
                              probs + static_cast<int64_t>(g) * groups * kSpan + offset, kSpan,
                              raw_values + static_cast<int64_t>(g) * d, slot_stride, n);
        }
      } else {
        const float* piece_values;
        if constexpr (std::is_same_v<C, float>) {
          piece_values = v_cache + slot * slot_stride;
        } else {
          to_float(v_cache + slot * slot_stride, values, n * slot_stride);
          piece_values = values;
        }
        for (int g = 0; g < kv_heads; ++g) {
          request(ahead, group_lines);
          Ops::accumulate(partial + static_cast<int64_t>(g) * groups * row, row, groups,
                          scores + static_cast<int64_t>(g) * groups * kSpan + offset, kSpan,
                          piece_values + static_cast<int64_t>(g) * d, slot_stride, n, d);
        }
      }
      start += n;
    }
  }
  for (int h = 0; h < heads; ++h) {
    partial[h * row + d] = m[h];
    partial[h * row + d + 1] = l[h];
  }
}

// Combines a sequence's partial results over its key ranges (flash-decoding's reduction) into the output, times
// v_scale.
template <typename T>
void merge_parts(const float* __restrict partial, int parts, int heads, int d, float v_scale, T* __restrict out) {
  const int64_t row = d + 2, part_stride = static_cast<int64_t>(heads) * row;
  for (int h = 0; h < heads; ++h) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < parts; ++p) mx = std::max(mx, partial[p * part_stride + h * row + d]);
    float total = 0.f;
    float acc[kMaxDim];
    std::fill(acc, acc + d, 0.f);
    for (int p = 0; p < parts; ++p) {
      const float* part = partial + p * part_stride + h * row;
      if (part[d + 1] == 0.f) continue;  // an empty range (a sequence shorter than the others)
      const float w = std::exp(part[d] - mx);
      total += part[d + 1] * w;
      for (int i = 0; i < d; ++i) acc[i] += part[i] * w;
    }
    const float inv = total > 0.f ? v_scale / total : 0.f;
    for (int i = 0; i < d; ++i) out[h * d + i] = static_cast<T>(acc[i] * inv);
  }
}

struct Scales {
  double softmax, k, v;
  double softcap;  // > 0: scores soft-capped to (-softcap, softcap) before the softmax (Gemma 2); 0: not
};

// Which of a sequence's keys its query reads, and how they are split across threads (see run).
struct KeyRange {
  int64_t split_keys;  // > 0: ranges of this many keys; 0: as many ranges as keep the threads busy
  int64_t window;      // > 0: only the last `window` keys (sliding-window attention); 0: every key
};

// split_keys > 0: a sequence's keys are split into ranges of this many keys (rounded up to whole spans), however many
// sequences the call has and however long the others are, so that a query's result depends on its own keys only:
// the deterministic mode's fixed split size. 0: split to keep every thread busy (the number of ranges then depends
// on the batch, and with it the order of the softmax merge).

template <typename T, typename C, typename Ops>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size, Scales scales, KeyRange range) {
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const double unit = std::is_same_v<C, Fp8> ? kFp8Unit : 1.0;  // the conversions' unit (see kFp8Unit)
  const float score_scale = static_cast<float>(scales.softmax * scales.k * unit), v_scale = static_cast<float>(scales.v * unit);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t table_stride = tables.size(1);
  const int64_t step = std::min<int64_t>(kSpan, block_size);
  // A sequence's visible keys: all of them, or under a sliding window its last `window` (a function of its own length
  // only, so a query's result still depends on its own keys alone).
  auto first_key = [&](int64_t b) { return range.window > 0 ? std::max<int64_t>(0, lp[b] - range.window) : 0; };
  // Fewer sequences than threads: split each sequence's keys into ranges (whole pieces, at least kMinPartKeys
  // keys each) so that every thread has work, and merge the ranges' partial results afterwards.
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lp[b] - first_key(b));
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1, part_keys;
  if (range.split_keys > 0) {
    part_keys = (std::max<int64_t>(range.split_keys, kSpan) + kSpan - 1) / kSpan * kSpan;  // whole spans: same span starts
    parts = std::max<int64_t>(1, (longest + part_keys - 1) / part_keys);
  } else {
    if (batch < threads) parts = std::max<int64_t>(1, std::min((threads + batch - 1) / batch, longest / kMinPartKeys));
    const int64_t chunks_per_part = ((longest + step - 1) / step + parts - 1) / parts;
    part_keys = chunks_per_part * step;
  }
  auto partial = at::empty({batch, parts, heads, d + 2}, q.options().dtype(at::kFloat));
  float* pp = partial.data_ptr<float>();
  const int64_t scratch =
      heads * d + heads * kSpan + 2 * std::min<int64_t>(block_size, kSpan) * kv_heads * d + heads * kSpan / 2;
  bool amx = false;
#if defined(LLMSERVE_AMX)
  if constexpr (Ops::kRawKeys)
    amx = heads / kv_heads <= AmxScores::kMaxGroup && block_size % 16 == 0 && llmserve_amx::permitted();
#endif
  at::parallel_for(0, batch * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(scratch);
#if defined(LLMSERVE_AMX)
    if (amx) AmxScores::configure(static_cast<int>(heads / kv_heads));
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / parts, p = item % parts;
      const int64_t key_begin = std::min(lp[b], first_key(b) + p * part_keys);
      const int64_t key_end = std::min(lp[b], first_key(b) + (p + 1) * part_keys);
      LineRequests<C> after;  // the next item's first piece, requested as this one's last lines are
      if (item + 1 < end) {
        const int64_t nb = (item + 1) / parts, np = (item + 1) % parts;
        const int64_t first = std::min(lp[nb], first_key(nb) + np * part_keys);
        const int64_t last = std::min(lp[nb], first_key(nb) + (np + 1) * part_keys);
        if (first < last) {
          const int64_t keys = std::min(block_size - first % block_size, last - first);
          const int64_t slot = tp[nb * table_stride + first / block_size] * block_size + first % block_size;
          after.set(kp, vp, slot * kv_heads * d, keys * kv_heads * d);
        }
      }
      attend_sequence<T, C, Ops>(qp + b * q.stride(0), pp + item * heads * (d + 2), static_cast<int>(heads),
                                 static_cast<int>(kv_heads), static_cast<int>(d), kp, vp, tp + b * table_stride,
                                 key_begin, key_end, block_size, score_scale, static_cast<float>(scales.softcap),
                                 work.data(), amx, after);
      if (parts == 1) merge_parts<T>(pp + item * heads * (d + 2), 1, static_cast<int>(heads), static_cast<int>(d),
                                     v_scale, op + b * heads * d);
    }
#if defined(LLMSERVE_AMX)
    if (amx) _tile_release();
#endif
  });
  if (parts > 1) {
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        merge_parts<T>(pp + b * parts * heads * (d + 2), static_cast<int>(parts), static_cast<int>(heads),
                       static_cast<int>(d), v_scale, op + b * heads * d);
    });
  }
}

template <typename T, typename C>
void dispatch_head_dim(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size, Scales scales,
                       KeyRange range) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    switch (q.size(2)) {
      case 64: return run<T, C, Avx512Bf16<64>>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
      case 128: return run<T, C, Avx512Bf16<128>>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
      default: break;
    }
  }
#endif
#if defined(__AVX512F__)
  switch (q.size(2)) {
    case 64: return run<T, C, Avx512<64>>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
    case 128: return run<T, C, Avx512<128>>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
    default: break;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  switch (q.size(2)) {
    case 64: return run<T, C, Avx2<64>>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
    case 128: return run<T, C, Avx2<128>>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
    default: break;
  }
#endif
  run<T, C, Portable>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
}

template <typename T>
void dispatch_cache(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size, Scales scales,
                    KeyRange range) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
    dispatch_head_dim<T, Fp8>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
  else
    dispatch_head_dim<T, T>(q, out, k_cache, v_cache, tables, lengths, block_size, scales, range);
}

// q: [B, Hq, D]; k_cache, v_cache: [slots, Hkv, D], q's dtype or float8_e4m3fn; block_tables: [B, N] int64;
// lengths: [B] int64 (keys per sequence, the new token's included); k_scale, v_scale: what the cache's K and V
// values are multiplied by to give the real ones; window > 0: each query reads only its sequence's last `window` keys
// (sliding-window attention: the key at position p is seen from positions p..p+window-1); softcap > 0: each score s
// becomes softcap * tanh(s / softcap) before the softmax (Gemma 2's attention soft-capping). Returns [B, Hq, D] in
// q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lengths, int64_t block_size,
                                  double scale, double k_scale, double v_scale, int64_t split_keys,
                                  int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kFloat8_e4m3fn),
              "the cache must be in q's dtype or float8_e4m3fn");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  TORCH_CHECK(split_keys >= 0 && window >= 0 && softcap >= 0, "split_keys, window and softcap must not be negative");
  const KeyRange range{split_keys, window};
  const int64_t d = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && q.size(1) % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(q.size(1) <= kMaxHeads && d <= kMaxDim, "too many query heads or head_dim too large");
  TORCH_CHECK(lengths.numel() == q.size(0) && block_tables.size(0) == q.size(0), "one table and length per query");
  // A query's heads must be contiguous, the queries need not be: q is usually a view into the rotary's output,
  // which holds the keys' heads too.
  auto qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = lengths.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(lp, lp + lens.numel(), [&](int64_t n) { return n >= 0 && n <= tables.size(1) * block_size; }),
              "a length runs past its block table");
  auto out = at::empty(qc.sizes(), qc.options());
  const Scales scales{scale, k_scale, v_scale, softcap};
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { dispatch_cache<float>(qc, out, k_cache, v_cache, tables, lens, block_size, scales, range); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      dispatch_cache<at::BFloat16>(qc, out, k_cache, v_cache, tables, lens, block_size, scales, range);
    }));
  return out;
}

}  // namespace

TORCH_LIBRARY(llmserve_kernels, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, "
        "int block_size, float scale, float k_scale=1.0, float v_scale=1.0, int split_keys=0, int window=0, "
        "float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
