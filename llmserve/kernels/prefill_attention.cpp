// Prompt attention (prefill) over the paged KV cache on CPUs with AVX512-BF16: causal, grouped-query, any number of
// sequences per call, each a run of new queries at the end of its context (a whole prompt, or a chunk after cached
// or earlier keys). torch's CPU flash attention multiplies bf16 through small GEMM calls that reach ~30 GMAC/s on
// Zen 4 (4.9 ms a layer for a 512-token prompt of the default model, a third of the prefill); here both products
// run as vdpbf16ps with their operands laid out for it.
//
// A sequence's keys are read from the cache once per KV head and packed: keys as pairs of dimensions, 16 keys to a
// vector (one vdpbf16ps then scores 16 keys against one query for two dimensions), values as pairs of keys, 16
// dimensions to a vector. The work is then split into tiles: a few query tokens times the query heads of one KV
// head, at most kRows rows, whose accumulators stay in registers. A tile walks its visible keys kSpan at a time with
// an online softmax: scores and sums in float32, the probabilities rounded to bf16 for the value product (as torch's
// flash attention rounds them), the output accumulated in float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "simd_exp.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LLMSERVE_PREFILL_ATTENTION 1

constexpr int kRows = 12;   // query rows per tile: 24 accumulators in the value product, 12 in the scores
constexpr int kSpan = 128;  // keys per online-softmax update, a multiple of 16

// acc + w . the pair of bf16 at `pair`, broadcast to every lane. (As an asm statement with an in-out register, the
// accumulator arrays below were kept in memory: every product stored and loaded.)
inline __m512 dot_broadcast_pair(__m512 acc, __m512i w, const int32_t& pair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
}

inline void store_bf16x16(at::BFloat16* dst, __m512 v) {
  const __m256bh r = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(r));
}

inline int32_t pair_at(const at::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One tile's rows, laid out for the kernel. The scores and probabilities of a span and the output sums live here.
struct Scratch {
  std::vector<int32_t> queries;  // [D / 2][rows]: each row's pairs of dimensions
  std::vector<float> scores;     // [rows][kSpan]
  std::vector<at::BFloat16> probs;  // [rows][kSpan]
  std::vector<int32_t> prob_pairs;  // [kSpan / 2][rows]
  std::vector<float> acc;        // [rows][D]
  explicit Scratch(int d)
      : queries(d / 2 * kRows), scores(kRows * kSpan), probs(kRows * kSpan), prob_pairs(kSpan / 2 * kRows), acc(kRows * d) {}
};

// Scores of 16 keys for R rows: queries [pair][row], keys `w` [pair][16 keys]; out[r * kSpan ..] = scale * q_r . k.
template <int kPairs, int R>
__attribute__((always_inline)) inline void score_keys(const int32_t* q, const int32_t* w, float scale, float* out) {
  __m512 a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int p = 0; p < kPairs; ++p) {
    const __m512i wv = _mm512_loadu_si512(w + p * 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) a[r] = dot_broadcast_pair(a[r], wv, q[p * R + r]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kSpan, _mm512_mul_ps(a[r], sc));
}

// acc[r * D .. + 32) += sum over key pairs p of probs [p][row] . values `v` [p][D] (32 dimensions from v).
template <int D, int R>
__attribute__((always_inline)) inline void sum_values(const int32_t* probs, int pairs, const int32_t* v, float* acc) {
  __m512 o0[R], o1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    o0[r] = _mm512_loadu_ps(acc + r * D);
    o1[r] = _mm512_loadu_ps(acc + r * D + 16);
  }
  for (int p = 0; p < pairs; ++p, probs += R, v += D) {
    const __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      o0[r] = dot_broadcast_pair(o0[r], v0, probs[r]);
      o1[r] = dot_broadcast_pair(o1[r], v1, probs[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * D, o0[r]);
    _mm512_storeu_ps(acc + r * D + 16, o1[r]);
  }
}

// A tile: `rows` query rows (R at compile time) over packed keys `kp` ([key / 16][D / 2][16] pairs) and values `vp`
// ([key / 2][D] pairs); row r sees keys 0 .. last[r]. Writes each row's normalized output through out_rows[r].
template <int D, int R>
__attribute__((noinline)) void attend_tile(Scratch& s, const int32_t* kp, const int32_t* vp, const int64_t* last, float scale,
                 at::BFloat16* const* out_rows) {
  constexpr int kPairs = D / 2;
  float m[R], l[R];
  for (int r = 0; r < R; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
  std::fill(s.acc.begin(), s.acc.begin() + R * D, 0.f);
  const int64_t keys = *std::max_element(last, last + R) + 1;
  for (int64_t span0 = 0; span0 < keys; span0 += kSpan) {
    const int span = static_cast<int>(std::min<int64_t>(kSpan, keys - span0));
    const int span16 = (span + 15) / 16 * 16;
    // scores of 16 keys at a time
    for (int kb = 0; kb < span16; kb += 16)
      score_keys<kPairs, R>(s.queries.data(), kp + (span0 + kb) / 16 * (kPairs * 16), scale, s.scores.data() + kb);
    // the online softmax, row by row; keys past a row's last (the causal mask, the padding) get probability 0
    for (int r = 0; r < R; ++r) {
      float* sr = s.scores.data() + r * kSpan;
      at::BFloat16* pr = s.probs.data() + r * kSpan;
      const int visible = static_cast<int>(std::clamp<int64_t>(last[r] - span0 + 1, 0, span));
      if (visible == 0) {
        std::fill(pr, pr + span16, at::BFloat16(0.f));
        continue;
      }
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int k = 0; k < visible; k += 16) {
        const __mmask16 live = visible - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (visible - k)) - 1);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(sr + k));
      }
      const float new_m = std::max(m[r], _mm512_reduce_max_ps(mx));
      const float alpha = std::exp(m[r] - new_m);  // 0 on the first span (m = -inf)
      if (alpha != 1.f) {
        float* ar = s.acc.data() + r * D;
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), _mm512_set1_ps(alpha)));
      }
      const __m512 nm = _mm512_set1_ps(new_m);
      __m512 sum = _mm512_setzero_ps();
      for (int k = 0; k < span16; k += 16) {
        const int left = visible - k;
        const __mmask16 live = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + k), nm)));
        sum = _mm512_add_ps(sum, e);
        store_bf16x16(pr + k, e);
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      m[r] = new_m;
    }
    // regroup the probabilities as pairs of keys per row, so one base address serves every row below
    const int pairs = span16 / 2;
    for (int p = 0; p < pairs; ++p)
      for (int r = 0; r < R; ++r) s.prob_pairs[p * R + r] = pair_at(s.probs.data() + r * kSpan + 2 * p);
    // the values, 32 dimensions at a time
    const int32_t* v = vp + span0 / 2 * D;
    for (int d0 = 0; d0 < D; d0 += 32) sum_values<D, R>(s.prob_pairs.data(), pairs, v + d0, s.acc.data() + d0);
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int d = 0; d < D; d += 16)
      store_bf16x16(out_rows[r] + d, _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + r * D + d), inv));
  }
}

using AttendTileFn = void (*)(Scratch&, const int32_t*, const int32_t*, const int64_t*, float, at::BFloat16* const*);

template <int D, int... R>
constexpr std::array<AttendTileFn, sizeof...(R)> attend_tile_table(std::integer_sequence<int, R...>) {
  return {&attend_tile<D, R + 1>...};
}

struct Tile {
  int64_t seq, kv_head, token0, tokens, head0, heads;
};

template <int D>
void run(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& tables, const int64_t* spans, int64_t block_size, float scale) {
  const int64_t batch = tables.size(0), table_stride = tables.size(1);
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const auto* kc = k_cache.data_ptr<at::BFloat16>();
  const auto* vc = v_cache.data_ptr<at::BFloat16>();
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  // packed keys and values of each (sequence, KV head), keys padded to 16 with zeros
  std::vector<int64_t> packed_at(batch * kv_heads + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      packed_at[b * kv_heads + h + 1] = packed_at[b * kv_heads + h] + (spans[3 * b + 2] + 15) / 16 * 16 * D / 2;
  std::vector<int32_t> kpack(packed_at.back()), vpack(packed_at.back());
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, keys = spans[3 * b + 2];
      int32_t* kdst = kpack.data() + packed_at[item];
      int32_t* vdst = vpack.data() + packed_at[item];
      const int64_t padded = (keys + 15) / 16 * 16;
      for (int64_t key = 0; key < padded; ++key) {
        int32_t* kd = kdst + key / 16 * (D / 2 * 16) + key % 16;
        at::BFloat16* vd = reinterpret_cast<at::BFloat16*>(vdst + key / 2 * D) + key % 2;
        if (key >= keys) {
          for (int p = 0; p < D / 2; ++p) kd[p * 16] = 0;
          for (int d = 0; d < D; ++d) vd[2 * d] = at::BFloat16(0.f);
          continue;
        }
        const int64_t slot = tp[b * table_stride + key / block_size] * block_size + key % block_size;
        const at::BFloat16* krow = kc + (slot * kv_heads + h) * D;
        const at::BFloat16* vrow = vc + (slot * kv_heads + h) * D;
        for (int p = 0; p < D / 2; ++p) kd[p * 16] = pair_at(krow + 2 * p);
        for (int d = 0; d < D; ++d) vd[2 * d] = vrow[d];
      }
    }
  });
  // tiles: query tokens x the query heads of one KV head, at most kRows rows
  const int64_t tile_heads = std::min<int64_t>(group, kRows), tile_tokens = std::max<int64_t>(1, kRows / group);
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t t = 0; t < spans[3 * b + 1]; t += tile_tokens)
        for (int64_t g = 0; g < group; g += tile_heads)
          tiles.push_back({b, h, t, std::min(tile_tokens, spans[3 * b + 1] - t), g, std::min(tile_heads, group - g)});
  // the longest first (a tile's cost grows with its last position), handed out one at a time
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& x, const Tile& y) {
    return spans[3 * x.seq + 2] - spans[3 * x.seq + 1] + x.token0 > spans[3 * y.seq + 2] - spans[3 * y.seq + 1] + y.token0;
  });
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  static constexpr auto kAttendTile = attend_tile_table<D>(std::make_integer_sequence<int, kRows>{});
  const int threads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size())));
#pragma omp parallel num_threads(threads)
  {
    Scratch s(D);
    int64_t last[kRows];
    at::BFloat16* out_rows[kRows];
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tiles.size(); ++i) {
      const Tile& t = tiles[i];
      const int64_t first = spans[3 * t.seq], queries = spans[3 * t.seq + 1], keys = spans[3 * t.seq + 2];
      const int rows = static_cast<int>(t.tokens * t.heads);
      for (int64_t j = 0; j < t.tokens; ++j) {
        const int64_t token = first + t.token0 + j;
        for (int64_t g = 0; g < t.heads; ++g) {
          const int r = static_cast<int>(j * t.heads + g);
          const int64_t head = t.kv_head * group + t.head0 + g;
          last[r] = keys - queries + t.token0 + j;
          out_rows[r] = op + (token * heads + head) * D;
          const at::BFloat16* qrow = qp + token * q_row + head * q_head;
          for (int p = 0; p < D / 2; ++p) s.queries[p * rows + r] = pair_at(qrow + 2 * p);
        }
      }
      const int64_t item = t.seq * kv_heads + t.kv_head;
      kAttendTile[rows - 1](s, kpack.data() + packed_at[item], vpack.data() + packed_at[item], last, scale, out_rows);
    }
  }
}
#endif

bool prefill_attention_built() {
#if defined(LLMSERVE_PREFILL_ATTENTION)
  return true;
#else
  return false;
#endif
}

// q [T, Hq, D] (rows and heads may be strided: a view of the fused QKV output), caches [slots, Hkv, D]
// in blocks of block_size slots, block_tables [B, N], spans [B, 3]: each sequence's first query row in q, its number
// of queries and its number of keys (the queries are the last positions of its keys). Rows of the result that no
// span covers are left unwritten.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& spans, int64_t block_size, double scale) {
  TORCH_CHECK(prefill_attention_built(), "prefill_attention needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "q [T, Hq, D], caches [slots, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "prefill_attention takes bf16 queries and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "query heads must be a multiple of KV heads, with the same head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && spans.scalar_type() == at::kLong && spans.dim() == 2 &&
              spans.size(1) == 3 && block_tables.dim() == 2 && spans.size(0) == block_tables.size(0),
              "block_tables [B, N] and spans [B, 3], int64");
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();  // rows and heads may be strided, not dimensions
  auto tables = block_tables.contiguous();
  auto sp = spans.contiguous();
  const int64_t* s = sp.data_ptr<int64_t>();
  for (int64_t b = 0; b < sp.size(0); ++b) {
    const int64_t first = s[3 * b], queries = s[3 * b + 1], keys = s[3 * b + 2];
    TORCH_CHECK(first >= 0 && queries >= 0 && first + queries <= q.size(0), "a span's queries run past q");
    TORCH_CHECK(keys >= queries && keys <= tables.size(1) * block_size, "a span's keys run past its block table");
    TORCH_CHECK(queries == 0 || keys > 0, "a span with queries needs keys");
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#if defined(LLMSERVE_PREFILL_ATTENTION)
  switch (q.size(2)) {
    case 64: run<64>(qc, out, k_cache, v_cache, tables, s, block_size, static_cast<float>(scale)); break;
    case 128: run<128>(qc, out, k_cache, v_cache, tables, s, block_size, static_cast<float>(scale)); break;
    default: TORCH_CHECK(false, "prefill_attention takes head_dim 64 or 128, got ", q.size(2));
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_kernels, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor spans, "
        "int block_size, float scale) -> Tensor");
  m.def("prefill_attention_built() -> bool", &prefill_attention_built);
}

TORCH_LIBRARY_IMPL(llmserve_kernels, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
