// Vector helpers the CPU kernels share: which instruction sets this build has, bf16 loads and
// round-to-nearest-even stores (the bits c10::BFloat16 and torch give), and the exponential.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

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

namespace vec_math {

using bf16 = c10::BFloat16;

// The Cephes expf polynomial (about 1 ulp), for x clamped to [-87.3, 89] (below, e^x
// is under float's normal range and comes out as 2^-126 * e^r; from 88.73 on it is inf, as expf).
constexpr float kExpLo = -87.3f, kExpHi = 89.f;

#if MESHSERVE_AVX512

inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to bf16 as c10::BFloat16(float) rounds (to nearest, ties to even; NaN to the quiet
// NaN 0x7FC0), still as floats: what a bf16 tensor between two operations would hold.
inline __m512 round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

inline void store16(bf16* p, __m512 v) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
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

#endif  // MESHSERVE_AVX512

#if MESHSERVE_AVX2

inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// As round16 and store16, 8 at a time.
inline __m256 round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                               _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(r);
}

inline void store8(bf16* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8(v)), 16);
  // 32-bit lanes to 16: packus works within 128-bit halves, then the quadwords are put in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
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
  // times 2^n, -126 <= n <= 128 here: n + 127 in the exponent bits (255: inf)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif  // MESHSERVE_AVX2

}  // namespace vec_math
