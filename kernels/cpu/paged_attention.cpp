// Decode attention over a paged KV cache, CPU.
//
// One query token per sequence attends over that sequence's context, read straight out of the
// layer's KV arena through its block table: no gathered copy of the keys and values is made.
//
//   q, out        [B, Hq, D]            float32 or bfloat16 (last axis contiguous)
//   kv            [2, num_slots, Hkv, D] same dtype, contiguous; kv[0] keys, kv[1] values,
//                                        slot = block_id * block_size + offset
//                 or [2, num_slots, Hkv, D + 4] int8 (--kv-cache-dtype int8): each row's D values,
//                                        then the 4 bytes of its float32 scale (value = q * scale)
//   block_tables  [B, max_blocks]        int64, padded with any valid block id
//   context_lens  [B]                    int64, tokens of context including the current one
//                                        (a sequence with none gets zeros)
//
// Work is split over (sequence, KV head); each task handles the G = Hq / Hkv query heads of its KV
// head together, so every key row is read once, and every value row once per sweep of up to 8/4/2
// query heads (head_dim 16-32/64/128, their accumulators held in registers; G <= 4 at head_dim 64,
// e.g. SmolLM2's G = 3, is a single sweep). Scores go to a per-thread buffer
// (G x context_len floats), then a max-subtracted softmax, then the weighted sum of the values;
// everything accumulates in float32. With AVX-512 and head_dim in {16, 32, 64, 128} the inner
// loops are explicit intrinsics; any other shape or machine takes the plain (auto-vectorized) loops.
// An int8 arena is read as int8 and widened in registers; a row's scale multiplies its score (keys)
// or its softmax weight (values), never the D elements: dequantizing costs one multiply per row.

// Lighter than <torch/extension.h> (halves the compile): Tensor, parallel settings, pybind casters.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define MESHSERVE_AVX512 1
#else
#define MESHSERVE_AVX512 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MESHSERVE_AVX2 1
#else
#define MESHSERVE_AVX2 0
#endif

namespace {

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

#if MESHSERVE_AVX512

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (max-subtracted scores); Cephes expf polynomial, about 1 ulp.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

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

template <typename T, int64_t D>
inline void prefetch_row(const T* p) {
  const char* c = reinterpret_cast<const char*>(p);
#pragma GCC unroll 8
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Query heads handled per sweep over the values: accumulators stay in registers.
template <int DV>
constexpr int heads_per_sweep() { return DV >= 8 ? 2 : (DV >= 4 ? 4 : 8); }

template <typename T, int DV>
void attend_avx512(const Args& a, int64_t b, int64_t kh, float* s, float* qf, float* /*acc*/, float* inv) {
  constexpr int64_t D = 16 * DV;
  constexpr int GC = heads_per_sweep<DV>();
  const int64_t G = a.G, bs = a.block_size;
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

  const int64_t ts = a.Hkv * D;
  const T* kbase = static_cast<const T*>(a.kv) + kh * D;
  const T* vbase = kbase + a.num_slots * ts;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const int64_t nblocks = (ctx + bs - 1) / bs;

  // Pass 1: scores, one key row in registers against the G query heads.
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t t0 = blk * bs;
    const int64_t n = std::min(bs, ctx - t0);
    const T* kp = kbase + table[blk] * bs * ts;
    const T* kn = blk + 1 < nblocks ? kbase + table[blk + 1] * bs * ts : nullptr;
    for (int64_t o = 0; o < n; ++o) {
      const T* kr = kp + o * ts;
      if (kn) prefetch_row<T, D>(kn + o * ts);  // one block ahead: the next block is elsewhere
      __m512 k[DV];
#pragma GCC unroll 8
      for (int j = 0; j < DV; ++j) k[j] = load16(kr + 16 * j);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        __m512 d0 = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
#pragma GCC unroll 8
        for (int j = 1; j < DV; ++j) d0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), k[j], d0);
        s[g * ctx + t0 + o] = _mm512_reduce_add_ps(d0);
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
      const T* vp = vbase + table[blk] * bs * ts;
      const T* vn = blk + 1 < nblocks ? vbase + table[blk + 1] * bs * ts : nullptr;
      const float* sp = s + g0 * ctx + t0;
      for (int64_t o = 0; o < n; ++o) {
        const T* vr = vp + o * ts;
        if (vn) prefetch_row<T, D>(vn + o * ts);
        __m512 v[DV];
#pragma GCC unroll 8
        for (int j = 0; j < DV; ++j) v[j] = load16(vr + 16 * j);
#pragma GCC unroll 8
        for (int gi = 0; gi < GC; ++gi) {
          if (gi < gn) {
            const __m512 p = _mm512_set1_ps(sp[gi * ctx + o]);
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
// AVX2, int8 rows (also taken on AVX-512 machines): head_dim = 8 * DV, each row widened to float32
// in registers (8 values per vpmovsxbd + vcvtdq2ps), its scale applied once per row.
// ------------------------------------------------------------------------------------------------

#if MESHSERVE_AVX2

inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline void prefetch_int8_row(const int8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
}

template <typename T, int DV>
void attend_avx2_int8(const Args& a, int64_t b, int64_t kh, float* s, float* qf, float* /*acc*/, float* inv) {
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
  const int8_t* kbase = static_cast<const int8_t*>(a.kv) + kh * R;
  const int8_t* vbase = kbase + a.num_slots * ts;
  const int64_t* table = a.block_tables + b * a.max_blocks;
  const int64_t nblocks = (ctx + bs - 1) / bs;

  // Pass 1: scores, one key row in registers against the G query heads.
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t t0 = blk * bs;
    const int64_t n = std::min(bs, ctx - t0);
    const int8_t* kp = kbase + table[blk] * bs * ts;
    const int8_t* kn = blk + 1 < nblocks ? kbase + table[blk + 1] * bs * ts : nullptr;
    for (int64_t o = 0; o < n; ++o) {
      const int8_t* kr = kp + o * ts;
      if (kn) prefetch_int8_row(kn + o * ts, R);  // one block ahead: the next block is elsewhere
      __m256 k[DV];
#pragma GCC unroll 16
      for (int j = 0; j < DV; ++j) k[j] = load8_i8(kr + 8 * j);
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
      const int8_t* vp = vbase + table[blk] * bs * ts;
      const int8_t* vn = blk + 1 < nblocks ? vbase + table[blk + 1] * bs * ts : nullptr;
      const float* sp = s + g0 * ctx + t0;
      for (int64_t o = 0; o < n; ++o) {
        const int8_t* vr = vp + o * ts;
        if (vn && g0 == 0) prefetch_int8_row(vn + o * ts, R);
        const float vs = row_scale(vr, D);
        __m256 p[GC];
#pragma GCC unroll 16
        for (int gi = 0; gi < GC; ++gi) p[gi] = _mm256_set1_ps(gi < gn ? sp[gi * ctx + o] * vs : 0.f);
#pragma GCC unroll 16
        for (int j = 0; j < DV; ++j) {
          const __m256 v = load8_i8(vr + 8 * j);
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
AttendFn pick_int8(int64_t D) {
#if MESHSERVE_AVX2
  switch (D) {
    case 16: return attend_avx2_int8<T, 2>;
    case 32: return attend_avx2_int8<T, 4>;
    case 64: return attend_avx2_int8<T, 8>;
    case 128: return attend_avx2_int8<T, 16>;
    default: break;
  }
#endif
  return attend_generic<T, KV>;
}

template <typename T, typename KV>
AttendFn pick(int64_t D) {
  if (!std::is_same<T, KV>::value) return pick_int8<T, KV>(D);  // int8 rows
#if MESHSERVE_AVX512
  switch (D) {
    case 16: return attend_avx512<T, 1>;
    case 32: return attend_avx512<T, 2>;
    case 64: return attend_avx512<T, 4>;
    case 128: return attend_avx512<T, 8>;
    default: break;
  }
#endif
  return attend_generic<T>;
}

template <typename T, typename KV = T>
void run(const Args& a, int64_t B, int64_t max_ctx) {
  const AttendFn fn = pick<T, KV>(a.D);
  const int64_t tasks = B * a.Hkv;
  const int64_t buf = std::max<int64_t>(max_ctx, 1) * a.G;
  int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
  // A small batch's attention takes microseconds on one core; waking a second thread costs as
  // much, and far more when another process holds that core (the team then waits at the barrier).
  if (B * max_ctx * a.Hkv * a.D < (int64_t(1) << 18)) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // Per-thread buffers: scores (G x max context), scaled queries and accumulators (G x D),
    // softmax normalizers (G).
    std::vector<float> s(buf), qf(a.G * a.D), acc(a.G * a.D), inv(a.G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task)
      fn(a, task / a.Hkv, task % a.Hkv, s.data(), qf.data(), acc.data(), inv.data());
  }
}

}  // namespace

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor kv, at::Tensor block_tables,
                            at::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && kv.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_decode_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, Hq, D] of the same shape");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(), "kv must be a contiguous [2, num_slots, Hkv, D]");
  const bool int8_kv = kv.scalar_type() == at::kChar;
  TORCH_CHECK((int8_kv || q.scalar_type() == kv.scalar_type()) && out.scalar_type() == q.scalar_type(),
              "q, out and kv must share a dtype (or kv be int8 rows)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out must be contiguous along head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 [B]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_slots = kv.size(1), Hkv = kv.size(2);
  const int64_t R = int8_kv ? D + 4 : D;
  TORCH_CHECK(kv.size(3) == R, "kv rows of ", kv.size(3), " elements, ", R, " expected for q head_dim ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "q heads (", Hq, ") must be a multiple of kv heads (", Hkv, ")");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "block_tables/context_lens batch != ", B);
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  if (B == 0 || Hq == 0 || D == 0) return;

  // Bounds: every block a sequence reads must lie inside the arena (checked here, on the calling
  // thread, so the parallel loop cannot read out of bounds and never has to throw).
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_blocks = num_slots / block_size;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = cl[b];
    TORCH_CHECK(c >= 0 && c <= max_blocks * block_size, "context_lens[", b, "] = ", c,
                " does not fit block_tables of ", max_blocks, " blocks of ", block_size);
    for (int64_t j = 0, nb = (c + block_size - 1) / block_size; j < nb; ++j)
      TORCH_CHECK(bt[b * max_blocks + j] >= 0 && bt[b * max_blocks + j] < num_blocks, "block_tables[", b, ", ", j,
                  "] = ", bt[b * max_blocks + j], " is outside the arena's ", num_blocks, " blocks");
    max_ctx = std::max(max_ctx, c);
  }

  Args a;
  a.q = q.data_ptr();
  a.out = out.data_ptr();
  a.kv = kv.data_ptr();
  a.block_tables = bt;
  a.context_lens = cl;
  a.q_stride_b = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.o_stride_b = out.stride(0);
  a.o_stride_h = out.stride(1);
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.G = Hq / Hkv;
  a.D = D;
  a.R = R;
  a.block_size = block_size;
  a.max_blocks = max_blocks;
  a.num_slots = num_slots;
  a.scale = static_cast<float>(scale);

  switch (q.scalar_type()) {
    case at::kFloat: int8_kv ? run<float, int8_t>(a, B, max_ctx) : run<float>(a, B, max_ctx); break;
    case at::kBFloat16: int8_kv ? run<bf16, int8_t>(a, B, max_ctx) : run<bf16>(a, B, max_ctx); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

// Writes this step's keys and values into an int8 arena, quantizing each (token, head) row as
// kernels/paged_attention.py quantize_kv does, bit for bit: s = max|x| / 127, q = round-half-even(x / s)
// (x / 1 for an all-zero row). One pass over the new rows instead of a dozen small torch ops per layer.
template <typename T>
void quantize_into(const T* x, int64_t D, int8_t* dst) {
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

void write_kv_int8(at::Tensor kv, at::Tensor k, at::Tensor v, at::Tensor slot_mapping) {
  TORCH_CHECK(kv.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slot_mapping.device().is_cpu(),
              "write_kv_int8: all tensors must be on the CPU");
  TORCH_CHECK(kv.scalar_type() == at::kChar && kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(),
              "kv must be a contiguous int8 [2, num_slots, Hkv, D + 4]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be [n, Hkv, D] of one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must be contiguous along head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0), "slot_mapping must be a contiguous int64 [n]");
  const int64_t n = k.size(0), H = k.size(1), D = k.size(2), S = kv.size(1);
  TORCH_CHECK(kv.size(2) == H && kv.size(3) == D + 4, "kv rows must be [Hkv, D + 4] for k of [", H, ", ", D, "]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "slot_mapping[", t, "] = ", slots[t], " is outside the arena");
  int8_t* base = kv.data_ptr<int8_t>();
  const int64_t R = D + 4, plane = S * H * R;
  auto run = [&](auto* kp, auto* vp) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < H; ++h) {
        int8_t* dst = base + (slots[t] * H + h) * R;
        quantize_into(kp + t * k.stride(0) + h * k.stride(1), D, dst);
        quantize_into(vp + t * v.stride(0) + h * v.stride(1), D, dst + plane);
      }
  };
  switch (k.scalar_type()) {
    case at::kFloat: run(k.data_ptr<float>(), v.data_ptr<float>()); break;
    case at::kBFloat16: run(reinterpret_cast<const bf16*>(k.data_ptr()), reinterpret_cast<const bf16*>(v.data_ptr())); break;
    default: TORCH_CHECK(false, "write_kv_int8: unsupported dtype ", k.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_int8", &write_kv_int8, "Quantizes new K/V rows into an int8 paged arena (CPU)", py::arg("kv"),
        py::arg("k"), py::arg("v"), py::arg("slot_mapping"));
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache, reading K/V through the block tables (CPU)",
        py::arg("out"), py::arg("q"), py::arg("kv"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"));
}
