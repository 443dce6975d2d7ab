// Prefill attention on AVX-512 BF16: one sequence's chunk of L prompt tokens attends, causally, over
// its T context slots (the cached tokens, then the chunk's own, already written), read out of the
// layer's paged KV arena through the slot ids. kernels/paged_attention.py's gather + SDPA is the
// oracle (tests/test_cpu_kernels.py), and the path for every dtype or machine this one does not take.
//
// Why: torch's CPU SDPA ran a mixed workload's chunks (128 queries over ~600 keys, head_dim 64,
// an additive mask) at ~50 GFLOP/s on a 2-core AVX-512 BF16 machine where the projections' kernel
// runs at ~420: prefill attention was a fifth of a mixed step.
//
// The shape of it, per KV head h:
// - Gather (once per call, shared by the tasks): the context's keys as contiguous bf16 rows
//   Kc[t][D], and the values as pairs of consecutive keys Vp[t/2][D][2] (what one dot-product
//   instruction takes: 16 output columns x 2 keys). An int8 arena is dequantized here, into the
//   bits kernels/paged_attention.py dequantize_kv gives (float32 product rounded to bf16).
// - A task is 16 queries of the chunk and the G query heads sharing h, held as G "lane groups":
//   lane i of group g is query i of head h * G + g. Scores for 8 keys x up to 3 groups stay in 24
//   registers while the queries' pairs of dims (packed once per task) meet each key's broadcast
//   pair: no horizontal sums, and the softmax runs along the keys lane-wise (a row's max and sum are
//   lane operations). The causal limit is a lane mask: key t is seen by queries i >= t - cached.
// - Weights: exp(s - max) in float32 (summed unrounded, as torch's flash attention does), rounded to
//   bf16 in pairs of keys, which is what the values' pair layout multiplies.
// - Output: 24 / (D / 16) rows at a time, D / 16 accumulators each, over the key pairs; divided by
//   the row's sum and rounded to bf16.
// Everything accumulates in float32.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

#if defined(__AVX512BF16__) && MESHSERVE_AVX512
#define MESHSERVE_PREFILL_BF16 1
#else
#define MESHSERVE_PREFILL_BF16 0
#endif

namespace prefill_attention {

using bf16 = c10::BFloat16;

constexpr int kLanes = 16;     // queries per task: the lanes of a score vector
constexpr int kKeyTile = 8;    // keys per score tile (x up to kGroupTile groups in registers)
constexpr int kGroupTile = 3;  // lane groups per score tile
constexpr int kAcc = 24;       // accumulators of the output tile (rows x D / 16)

struct Args {
  const bf16* q;  // [L, Hq, D]
  bf16* out;      // [L, Hq, D]
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;  // in elements
  int64_t L, T, cached, Hq, Hkv, G, D;
  float scale;
};

#if MESHSERVE_PREFILL_BF16

inline uint32_t bits_of(const bf16* p) {  // two bf16 as one 32-bit word (the pair an instruction takes)
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Kc[t][D] and Vp[t2][D][2] of one KV head from its rows (src_k(t), src_v(t): the row's start in the
// arena). KV: bf16 (copied) or int8 (dequantized: value * the row's float32 scale, rounded once).
template <typename KV>
inline void row_to_bf16(const KV* row, int64_t D, bf16* dst) {
  if constexpr (std::is_same<KV, bf16>::value) {
    std::memcpy(dst, row, D * sizeof(bf16));
  } else {
    float sc;
    std::memcpy(&sc, row + D, sizeof sc);
    const __m512 vs = _mm512_set1_ps(sc);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
      vec_math::store16(dst + d, _mm512_mul_ps(x, vs));
    }
  }
}

// Two rows of D bf16 (keys t and t + 1) interleaved: out[d][0] = a[d], out[d][1] = b[d].
inline void interleave_pair(const bf16* a, const bf16* b, int64_t D, bf16* out) {
  static const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                             37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                             54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
    _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// Which lanes see key t: query i sees keys up to cached + i, so lanes i >= t - first_free, where
// first_free = cached + i0 (the task's first query's own position); padding lanes never.
inline __mmask16 seen_by(int64_t t, int64_t first_free, __mmask16 valid) {
  const int64_t first = t - first_free;
  return first <= 0 ? valid : static_cast<__mmask16>(valid & ~((1u << first) - 1));
}

// Scores of keys [t0, t0 + kn) for GN lane groups: s[t][g] (16 lanes) = scale * q_g . k_t, and each
// group's running maximum over the keys its lanes see (mx[g]).
template <int GN>
inline void score_tile(const bf16* qp, int64_t D, const bf16* kc, int64_t t0, int kn, float scale, float* s,
                       int64_t G, __m512* mx, int64_t first_free, __mmask16 valid) {
  __m512 acc[kKeyTile][GN];
  for (int k = 0; k < kKeyTile; ++k)
    for (int g = 0; g < GN; ++g) acc[k][g] = _mm512_setzero_ps();
  const int64_t D2 = D / 2;
  for (int64_t j = 0; j < D2; ++j) {
    __m512bh qv[GN];
    for (int g = 0; g < GN; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qp + (g * D2 + j) * 2 * kLanes);
#pragma GCC unroll 8
    for (int k = 0; k < kKeyTile; ++k) {
      if (k < kn) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits_of(kc + (t0 + k) * D + 2 * j)));
        for (int g = 0; g < GN; ++g) acc[k][g] = _mm512_dpbf16_ps(acc[k][g], qv[g], kb);
      }
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int k = 0; k < kn; ++k) {
    const __mmask16 seen = seen_by(t0 + k, first_free, valid);
    for (int g = 0; g < GN; ++g) {
      const __m512 x = _mm512_mul_ps(acc[k][g], vs);
      _mm512_storeu_ps(s + ((t0 + k) * G + g) * kLanes, x);
      mx[g] = _mm512_mask_max_ps(mx[g], seen, mx[g], x);
    }
  }
}

// out rows [i0, i0 + RN) of one lane group from the pairs of weights pp[t2][16 lanes] and the values.
template <int DV, int RN>
inline void output_tile(const uint32_t* pp, int64_t pair_stride, int64_t n2, const bf16* vp, int i0, const float* inv,
                        bf16* const* rows) {
  __m512 acc[RN][DV];
  for (int r = 0; r < RN; ++r)
    for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_setzero_ps();
  constexpr int64_t D = 16 * DV;
  for (int64_t t2 = 0; t2 < n2; ++t2) {
    __m512bh v[DV];
    for (int j = 0; j < DV; ++j) v[j] = (__m512bh)_mm512_loadu_si512(vp + (t2 * D + 16 * j) * 2);
    const uint32_t* p = pp + t2 * pair_stride + i0;
#pragma GCC unroll 12
    for (int r = 0; r < RN; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r]));
      for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], v[j], w);
    }
  }
  for (int r = 0; r < RN; ++r) {
    if (rows[r] == nullptr) continue;  // a padding lane: no query
    const __m512 w = _mm512_set1_ps(inv[r]);
    for (int j = 0; j < DV; ++j) vec_math::store16(rows[r] + 16 * j, _mm512_mul_ps(acc[r][j], w));
  }
}

template <int DV>
void output_rows(const uint32_t* pp, int64_t pair_stride, int64_t n2, const bf16* vp, int i0, int rn, const float* inv,
                 bf16* const* rows) {
  constexpr int RMAX = kAcc / DV;
  switch (rn) {  // the tail of a lane group: fewer rows, each its own instantiation
#define MESHSERVE_OUT_CASE(R) \
  case R:                     \
    if constexpr (R <= RMAX) output_tile<DV, R>(pp, pair_stride, n2, vp, i0, inv, rows); \
    break;
    MESHSERVE_OUT_CASE(1) MESHSERVE_OUT_CASE(2) MESHSERVE_OUT_CASE(3) MESHSERVE_OUT_CASE(4)
    MESHSERVE_OUT_CASE(5) MESHSERVE_OUT_CASE(6) MESHSERVE_OUT_CASE(7) MESHSERVE_OUT_CASE(8)
    MESHSERVE_OUT_CASE(9) MESHSERVE_OUT_CASE(10) MESHSERVE_OUT_CASE(11) MESHSERVE_OUT_CASE(12)
#undef MESHSERVE_OUT_CASE
    default: break;
  }
}

// Per-thread scratch of one task.
struct Scratch {
  std::vector<bf16> qp;       // [G][D/2][16][2]: the task's queries, pairs of dims per lane
  std::vector<float> s;       // [T][G][16]: scores, then weights
  std::vector<uint32_t> pp;   // [T/2][G][16]: bf16 pairs of weights of keys 2t2, 2t2 + 1
  std::vector<float> inv;     // [G][16]
  std::vector<__m512> mx;     // [G]: the scores' running maxima
};

// One task: KV head h, queries [i0, i0 + 16) of the chunk.
template <int DV>
void attend_task(const Args& a, int64_t h, int64_t i0, const bf16* kc, const bf16* vp, Scratch& w) {
  constexpr int64_t D = 16 * DV;
  const int64_t G = a.G, D2 = D / 2;
  const int lanes = static_cast<int>(std::min<int64_t>(kLanes, a.L - i0));
  const __mmask16 valid = static_cast<__mmask16>((1u << lanes) - 1);
  const int64_t tlim = a.cached + i0 + lanes;  // keys any lane of the task sees
  // Queries, as pairs of dims per lane (padding lanes zero).
  w.qp.assign(G * D2 * 2 * kLanes, bf16());
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < lanes; ++i) {
      const bf16* qr = a.q + (i0 + i) * a.q_stride_t + (h * G + g) * a.q_stride_h;
      uint32_t* dst = reinterpret_cast<uint32_t*>(w.qp.data()) + g * D2 * kLanes + i;
      for (int64_t j = 0; j < D2; ++j) dst[j * kLanes] = bits_of(qr + 2 * j);
    }
  // Scores, with each group's maximum over what its lanes see.
  float* s = w.s.data();
  const int64_t first_free = a.cached + i0;
  __m512* mx = w.mx.data();
  for (int64_t g = 0; g < G; ++g) mx[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g0 = 0; g0 < G; g0 += kGroupTile) {
    const int gn = static_cast<int>(std::min<int64_t>(kGroupTile, G - g0));
    const bf16* qg = w.qp.data() + g0 * D2 * 2 * kLanes;
    float* sg = s + g0 * kLanes;
    for (int64_t t0 = 0; t0 < tlim; t0 += kKeyTile) {
      const int kn = static_cast<int>(std::min<int64_t>(kKeyTile, tlim - t0));
      if (gn == 3) score_tile<3>(qg, D, kc, t0, kn, a.scale, sg, G, mx + g0, first_free, valid);
      else if (gn == 2) score_tile<2>(qg, D, kc, t0, kn, a.scale, sg, G, mx + g0, first_free, valid);
      else score_tile<1>(qg, D, kc, t0, kn, a.scale, sg, G, mx + g0, first_free, valid);
    }
  }
  // Softmax along the keys, lane-wise, in one pass: exp(s - max) of keys 2 t2 and 2 t2 + 1, summed in
  // float32 and stored as a bf16 pair per lane (an odd last key pairs with 0).
  const int64_t n2 = (tlim + 1) / 2;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 m = _mm512_mask_mov_ps(_mm512_setzero_ps(), valid, mx[g]);  // padding lanes: finite
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t2 = 0; t2 < n2; ++t2) {
      const int64_t t = 2 * t2;
      const __m512 e0 = _mm512_maskz_mov_ps(seen_by(t, first_free, valid),
                                            vec_math::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (t * G + g) * kLanes), m)));
      __m512 e1 = _mm512_setzero_ps();
      if (t + 1 < tlim)
        e1 = _mm512_maskz_mov_ps(seen_by(t + 1, first_free, valid),
                                 vec_math::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + ((t + 1) * G + g) * kLanes), m)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      const __m512i b0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
      const __m512i b1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
      _mm512_storeu_si512(w.pp.data() + (t2 * G + g) * kLanes, _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
    }
    _mm512_storeu_ps(w.inv.data() + g * kLanes, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  }
  // Output rows, a lane group at a time.
  constexpr int RMAX = kAcc / DV;
  for (int64_t g = 0; g < G; ++g) {
    for (int r0 = 0; r0 < lanes; r0 += RMAX) {
      const int rn = std::min(RMAX, lanes - r0);
      bf16* rows[RMAX > 0 ? RMAX : 1];
      for (int r = 0; r < rn; ++r) rows[r] = a.out + (i0 + r0 + r) * a.o_stride_t + (h * G + g) * a.o_stride_h;
      // Keys past the last row's limit weigh 0 for every row of the tile: stop there.
      const int64_t rows_lim = std::min<int64_t>(tlim, a.cached + i0 + r0 + rn);
      output_rows<DV>(w.pp.data() + g * kLanes, G * kLanes, (rows_lim + 1) / 2, vp, r0, rn,
                      w.inv.data() + g * kLanes + r0, rows);
    }
  }
}

#endif  // MESHSERVE_PREFILL_BF16

}  // namespace prefill_attention
