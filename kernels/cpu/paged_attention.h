// Decode attention's per-(sequence, KV head) loops and the int8 KV row format (paged_attention.cpp
// describes the layout and the design): shared by paged_attention.cpp and fused_decode.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec_math.h"

namespace paged_attention {

constexpr int64_t kScaleBytes = 4;  // an int8 row's float32 scale, after its head_dim values

using bf16 = c10::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  // bf16 is the top half of a float32: widening is exact.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline void from_float(float v, float* dst) { *dst = v; }
inline void from_float(float v, bf16* dst) { *dst = bf16(v); }  // round to nearest even

struct Args {
  const void* q;
  void* out;
  const void* kv;
  const int64_t* block_tables;
  const int64_t* context_lens;
  int64_t q_stride_b, q_stride_h, o_stride_b, o_stride_h;  // in elements
  int64_t Hq, Hkv, G, D, R, block_size, max_blocks, num_slots;  // R: elements of a kv row (D, or D + 4 for int8)
  float scale;
};

// A kv row's scale: 1 for float rows, the stored float32 after the D values for int8 rows.
template <typename KV>
inline float row_scale(const KV*, int64_t) { return 1.f; }
inline float row_scale(const int8_t* row, int64_t D) {
  float f;
  std::memcpy(&f, row + D, sizeof(f));
  return f;
}

// ------------------------------------------------------------------------------------------------
// Plain loops: any head_dim, any machine. T: q/out dtype; KV: the arena's (T, or int8).
// ------------------------------------------------------------------------------------------------

template <typename T, typename KV = T>
void attend_generic(const Args& a, int64_t b, int64_t kh, float* s, float* qf, float* acc, float* inv) {
  const int64_t G = a.G, D = a.D, bs = a.block_size;
  const int64_t ctx = a.context_lens[b];
  const T* qb = static_cast<const T*>(a.q) + b * a.q_stride_b + kh * G * a.q_stride_h;
  T* ob = static_cast<T*>(a.out) + b * a.o_stride_b + kh * G * a.o_stride_h;
  if (ctx <= 0) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) from_float(0.f, ob + g * a.o_stride_h + i);
    return;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(qb[g * a.q_stride_h + i]) * a.scale;

  const int64_t ts = a.Hkv * a.R;  // elements between consecutive slots
  const KV* kbase = static_cast<const KV*>(a.kv) + kh * a.R;
  const KV* vbase = kbase + a.num_slots * ts;
  const int64_t* table = a.block_tables + b * a.max_blocks;

  // Pass 1: scores.
  for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += bs, ++blk) {
    const int64_t n = std::min(bs, ctx - t0);
    const KV* kp = kbase + table[blk] * bs * ts;
    for (int64_t o = 0; o < n; ++o) {
      const KV* kr = kp + o * ts;
      const float ks = row_scale(kr, D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < D; ++i) dot += qg[i] * to_float(kr[i]);
        s[g * ctx + t0 + o] = dot * ks;
      }
    }
  }
  // Softmax numerators, in place; inv gets the normalizers.
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * ctx;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    inv[g] = 1.f / sum;
  }
  // Pass 2: weighted sum of the values.
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += bs, ++blk) {
    const int64_t n = std::min(bs, ctx - t0);
    const KV* vp = vbase + table[blk] * bs * ts;
    for (int64_t o = 0; o < n; ++o) {
      const KV* vr = vp + o * ts;
      const float vs = row_scale(vr, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * ctx + t0 + o] * vs;
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ag[i] += p * to_float(vr[i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) from_float(acc[g * D + i] * inv[g], ob + g * a.o_stride_h + i);
}

// ------------------------------------------------------------------------------------------------
// AVX-512: head_dim = 16 * DV, rows held in registers.
// ------------------------------------------------------------------------------------------------

#if MESHSERVE_AVX512 || MESHSERVE_AVX2
// Asks for a kv row of `elems` elements one block ahead (the next block lies elsewhere in the arena).
template <typename KV>
inline void prefetch_row(const KV* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(KV)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}
#endif

#if MESHSERVE_AVX512

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// 16 int8 values widened to float32 (the row's scale is applied per row, not per value).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
using vec_math::exp16;
using vec_math::load16;

// s[0..n) <- exp(s - max(s)); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
  if (t < n) {
    const __mmask16 k = (__mmask16)((1u << (n - t)) - 1);
    vm = _mm512_mask_max_ps(vm, k, vm, _mm512_maskz_loadu_ps(k, s + t));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 vs = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  if (t < n) {
    const __mmask16 k = (__mmask16)((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    vs = _mm512_mask_add_ps(vs, k, vs, e);
  }
  return _mm512_reduce_add_ps(vs);
}

// Lane o of the result is the sum of r[o]'s 16 lanes. A transposing tree (pairs of rows share
// each shuffle and add): 46 instructions for 16 rows, where a horizontal sum per row costs about 8
// each, all on the shuffle port, in a serial chain.
inline __m512 sum_rows16(const __m512* r) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes: row 2i's 8 partial sums in lanes 0-1, row 2i+1's in 2-3
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // lane L: row 4j + L's 4 partial sums
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // lane L: two partial sums each of rows 8k + L and 8k + 4 + L
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // element 4L + m: row 4m + L; then put row o at element o.
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// Query heads handled per sweep over the values: accumulators stay in registers.
template <int DV>
constexpr int heads_per_sweep() { return DV >= 8 ? 2 : (DV >= 4 ? 4 : 8); }

// T: q/out dtype; KV: the arena's (T, or int8 rows whose scale multiplies the row's score or
// softmax weight).
template <typename T, typename KV, int DV>
void attend_avx512(const Args& a, int64_t b, int64_t kh, float* s, float* qf, float* /*acc*/, float* inv) {
  constexpr int64_t D = 16 * DV;
  constexpr bool kScaled = std::is_same<KV, int8_t>::value;
  constexpr int GC = heads_per_sweep<DV>();
  const int64_t G = a.G, bs = a.block_size, R = a.R;
  const int64_t ctx = a.context_lens[b];
  const T* qb = static_cast<const T*>(a.q) + b * a.q_stride_b + kh * G * a.q_stride_h;
  T* ob = static_cast<T*>(a.out) + b * a.o_stride_b + kh * G * a.o_stride_h;
  if (ctx <= 0) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) from_float(0.f, ob + g * a.o_stride_h + i);
    return;
  }
  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < DV; ++j)
      _mm512_storeu_ps(qf + g * D + 16 * j, _mm512_mul_ps(load16(qb + g * a.q_stride_h + 16 * j), vscale));

  const int64_t ts = a.Hkv * R;
  const KV* kbase = static_cast<const KV*>(a.kv) + kh * R;
  const KV* vbase = kbase + a.num_slots * ts;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const int64_t nblocks = (ctx + bs - 1) / bs;

  // Pass 1: scores, 16 key rows at a time: widened once into kf (L1), then each query head's 16
  // dot products reduced together.
  alignas(64) float kf[16 * D];
  alignas(64) float ks[16];
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t t0 = blk * bs;
    const int64_t n = std::min(bs, ctx - t0);
    const KV* kp = kbase + table[blk] * bs * ts;
    const KV* kn = blk + 1 < nblocks ? kbase + table[blk + 1] * bs * ts : nullptr;
    for (int64_t o0 = 0; o0 < n; o0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - o0));
      for (int i = 0; i < m; ++i) {
        const KV* kr = kp + (o0 + i) * ts;
        if (kn) prefetch_row(kn + (o0 + i) * ts, R);  // one block ahead: the next block is elsewhere
#pragma GCC unroll 8
        for (int j = 0; j < DV; ++j) _mm512_store_ps(kf + i * D + 16 * j, load16(kr + 16 * j));
        if (kScaled) ks[i] = row_scale(kr, D);
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
      for (int64_t g = 0; g < G; ++g) {
        __m512 q[DV];
#pragma GCC unroll 8
        for (int j = 0; j < DV; ++j) q[j] = _mm512_loadu_ps(qf + g * D + 16 * j);
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          if (i < m) {
            __m512 d0 = _mm512_mul_ps(q[0], _mm512_load_ps(kf + i * D));
#pragma GCC unroll 8
            for (int j = 1; j < DV; ++j) d0 = _mm512_fmadd_ps(q[j], _mm512_load_ps(kf + i * D + 16 * j), d0);
            r[i] = d0;
          } else {
            r[i] = _mm512_setzero_ps();
          }
        }
        __m512 sc = sum_rows16(r);
        if (kScaled) sc = _mm512_mul_ps(sc, _mm512_maskz_load_ps(valid, ks));
        _mm512_mask_storeu_ps(s + g * ctx + t0 + o0, valid, sc);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / softmax_numerators(s + g * ctx, ctx);

  // Pass 2: values, up to GC query heads per sweep with their accumulators in registers.
  for (int64_t g0 = 0; g0 < G; g0 += GC) {
    const int gn = static_cast<int>(std::min<int64_t>(GC, G - g0));
    __m512 ac[GC][DV];
#pragma GCC unroll 8
    for (int gi = 0; gi < GC; ++gi)
#pragma GCC unroll 8
      for (int j = 0; j < DV; ++j) ac[gi][j] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t t0 = blk * bs;
      const int64_t n = std::min(bs, ctx - t0);
      const KV* vp = vbase + table[blk] * bs * ts;
      const KV* vn = blk + 1 < nblocks ? vbase + table[blk + 1] * bs * ts : nullptr;
      const float* sp = s + g0 * ctx + t0;
      for (int64_t o = 0; o < n; ++o) {
        const KV* vr = vp + o * ts;
        if (vn && g0 == 0) prefetch_row(vn + o * ts, R);
        const float vs = kScaled ? row_scale(vr, D) : 1.f;
        __m512 v[DV];
#pragma GCC unroll 8
        for (int j = 0; j < DV; ++j) v[j] = load16(vr + 16 * j);
#pragma GCC unroll 8
        for (int gi = 0; gi < GC; ++gi) {
          if (gi < gn) {
            const __m512 p = _mm512_set1_ps(kScaled ? sp[gi * ctx + o] * vs : sp[gi * ctx + o]);
#pragma GCC unroll 8
            for (int j = 0; j < DV; ++j) ac[gi][j] = _mm512_fmadd_ps(p, v[j], ac[gi][j]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int gi = 0; gi < GC; ++gi) {
      if (gi < gn) {
        const int64_t g = g0 + gi;
        const __m512 w = _mm512_set1_ps(inv[g]);
        float tmp[D];
#pragma GCC unroll 8
        for (int j = 0; j < DV; ++j) _mm512_storeu_ps(tmp + 16 * j, _mm512_mul_ps(ac[gi][j], w));
        T* og = ob + g * a.o_stride_h;
        for (int64_t i = 0; i < D; ++i) from_float(tmp[i], og + i);
      }
    }
  }
}

#endif  // MESHSERVE_AVX512

// ------------------------------------------------------------------------------------------------
// AVX2 (head_dim = 8 * DV): machines without AVX-512 (bf16, fp32 or int8 rows). Each row is widened to float32 in registers (int8: 8 values per
// vpmovsxbd + vcvtdq2ps, its scale applied once per row; bf16: a 16-bit shift), the softmax's
// exponentials 8 at a time.
// ------------------------------------------------------------------------------------------------

#if MESHSERVE_AVX2

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
using vec_math::exp8;
using vec_math::load8;
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// s[0..n) <- exp(s - max(s)); returns the sum.
inline float softmax_numerators8(float* s, int64_t n) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
  for (int64_t u = t; u < n; ++u) m = std::max(m, s[u]);
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmax));
    _mm256_storeu_ps(s + t, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = hsum8(vs);
  if (t < n) {  // the tail through the same polynomial (the padding lanes are not used)
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = t + i < n ? s[t + i] - m : -std::numeric_limits<float>::infinity();
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t u = t; u < n; ++u) {
      s[u] = tail[u - t];
      sum += s[u];
    }
  }
  return sum;
}

template <typename T, typename KV, int DV>
void attend_avx2(const Args& a, int64_t b, int64_t kh, float* s, float* qf, float* /*acc*/, float* inv) {
  constexpr int64_t D = 8 * DV;
  // Query heads per sweep over the values: GC x DV accumulators stay in the 16 registers.
  constexpr int GC = DV >= 8 ? 1 : (DV >= 4 ? 2 : 4);
  const int64_t G = a.G, bs = a.block_size, R = a.R;
  const int64_t ctx = a.context_lens[b];
  const T* qb = static_cast<const T*>(a.q) + b * a.q_stride_b + kh * G * a.q_stride_h;
  T* ob = static_cast<T*>(a.out) + b * a.o_stride_b + kh * G * a.o_stride_h;
  if (ctx <= 0) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) from_float(0.f, ob + g * a.o_stride_h + i);
    return;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(qb[g * a.q_stride_h + i]) * a.scale;

  const int64_t ts = a.Hkv * R;
  const KV* kbase = static_cast<const KV*>(a.kv) + kh * R;
  const KV* vbase = kbase + a.num_slots * ts;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const int64_t nblocks = (ctx + bs - 1) / bs;

  // Pass 1: scores, one key row in registers against the G query heads.
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t t0 = blk * bs;
    const int64_t n = std::min(bs, ctx - t0);
    const KV* kp = kbase + table[blk] * bs * ts;
    const KV* kn = blk + 1 < nblocks ? kbase + table[blk + 1] * bs * ts : nullptr;
    for (int64_t o = 0; o < n; ++o) {
      const KV* kr = kp + o * ts;
      if (kn) prefetch_row(kn + o * ts, R);  // one block ahead: the next block is elsewhere
      __m256 k[DV];
#pragma GCC unroll 16
      for (int j = 0; j < DV; ++j) k[j] = load8(kr + 8 * j);
      const float ks = row_scale(kr, D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        __m256 d0 = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]);
#pragma GCC unroll 16
        for (int j = 1; j < DV; ++j) d0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), k[j], d0);
        s[g * ctx + t0 + o] = hsum8(d0) * ks;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / softmax_numerators8(s + g * ctx, ctx);

  // Pass 2: values, GC query heads per sweep; a row's scale folds into its softmax weights.
  for (int64_t g0 = 0; g0 < G; g0 += GC) {
    const int gn = static_cast<int>(std::min<int64_t>(GC, G - g0));
    __m256 ac[GC][DV];
#pragma GCC unroll 16
    for (int gi = 0; gi < GC; ++gi)
#pragma GCC unroll 16
      for (int j = 0; j < DV; ++j) ac[gi][j] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t t0 = blk * bs;
      const int64_t n = std::min(bs, ctx - t0);
      const KV* vp = vbase + table[blk] * bs * ts;
      const KV* vn = blk + 1 < nblocks ? vbase + table[blk + 1] * bs * ts : nullptr;
      const float* sp = s + g0 * ctx + t0;
      for (int64_t o = 0; o < n; ++o) {
        const KV* vr = vp + o * ts;
        if (vn && g0 == 0) prefetch_row(vn + o * ts, R);
        const float vs = row_scale(vr, D);
        __m256 p[GC];
#pragma GCC unroll 16
        for (int gi = 0; gi < GC; ++gi) p[gi] = _mm256_set1_ps(gi < gn ? sp[gi * ctx + o] * vs : 0.f);
#pragma GCC unroll 16
        for (int j = 0; j < DV; ++j) {
          const __m256 v = load8(vr + 8 * j);
#pragma GCC unroll 16
          for (int gi = 0; gi < GC; ++gi) ac[gi][j] = _mm256_fmadd_ps(p[gi], v, ac[gi][j]);
        }
      }
    }
#pragma GCC unroll 16
    for (int gi = 0; gi < GC; ++gi) {
      if (gi < gn) {
        const int64_t g = g0 + gi;
        const __m256 w = _mm256_set1_ps(inv[g]);
        float tmp[D];
#pragma GCC unroll 16
        for (int j = 0; j < DV; ++j) _mm256_storeu_ps(tmp + 8 * j, _mm256_mul_ps(ac[gi][j], w));
        T* og = ob + g * a.o_stride_h;
        for (int64_t i = 0; i < D; ++i) from_float(tmp[i], og + i);
      }
    }
  }
}

#endif  // MESHSERVE_AVX2

using AttendFn = void (*)(const Args&, int64_t, int64_t, float*, float*, float*, float*);

template <typename T, typename KV>
AttendFn pick_avx2(int64_t D) {
#if MESHSERVE_AVX2
  switch (D) {
    case 16: return attend_avx2<T, KV, 2>;
    case 32: return attend_avx2<T, KV, 4>;
    case 64: return attend_avx2<T, KV, 8>;
    case 128: return attend_avx2<T, KV, 16>;
    default: break;
  }
#endif
  return attend_generic<T, KV>;
}

template <typename T, typename KV>
AttendFn pick(int64_t D) {
#if MESHSERVE_AVX512
  switch (D) {
    case 16: return attend_avx512<T, KV, 1>;
    case 32: return attend_avx512<T, KV, 2>;
    case 64: return attend_avx512<T, KV, 4>;
    case 128: return attend_avx512<T, KV, 8>;
    default: break;
  }
#endif
  return pick_avx2<T, KV>(D);  // AVX2 without AVX-512, else the plain loops
}

// Writes this step's keys and values into an int8 arena, quantizing each (token, head) row as
// kernels/paged_attention.py quantize_kv does, bit for bit: s = max|x| / 127, q = round-half-even(x / s)
// (x / 1 for an all-zero row). One pass over the new rows instead of a dozen small torch ops per layer.
template <typename T>
inline void quantize_into(const T* x, int64_t D, int8_t* dst) {
  float m = 0.f;
  for (int64_t i = 0; i < D; ++i) m = std::max(m, std::fabs(to_float(x[i])));
  const float s = m / 127.f;
  const float div = s > 0.f ? s : 1.f;
  for (int64_t i = 0; i < D; ++i) {
    const float r = std::nearbyint(to_float(x[i]) / div);
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  std::memcpy(dst + D, &s, sizeof(s));
}

}  // namespace paged_attention
