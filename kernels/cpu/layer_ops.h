// One row of each of a decoder layer's element-wise steps, bf16 in and out, fp32 inside, rounding
// where Hugging Face's bf16 model rounds (layer_ops.cpp describes why): shared by layer_ops.cpp
// and fused_decode.cpp, so both compute the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace layer_ops {

using bf16 = c10::BFloat16;

// Each loop runs 16 (AVX-512) or 8 (AVX2) elements at a time and the rest one by one; the vector
// and scalar forms round alike (vec_math.h rounds as c10::BFloat16 does).

// out = RMSNorm(x) * w over d elements.
inline void norm_row(const bf16* x, const bf16* w, bf16* out, int64_t d, float eps) {
  float ss = 0.f;
  int64_t j = 0;
#if MESHSERVE_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= d; j += 16) {
    const __m512 v = vec_math::load16(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#elif MESHSERVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= d; j += 8) {
    const __m256 v = vec_math::load8(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) ss += l;
#endif
  for (; j < d; ++j) {
    const float v = float(x[j]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / float(d) + eps);
  // As Hugging Face: normalize in fp32, round to bf16, then scale by the bf16 weight.
  j = 0;
#if MESHSERVE_AVX512
  const __m512 vr = _mm512_set1_ps(r);
  for (; j + 16 <= d; j += 16) {
    const __m512 normed = vec_math::round16(_mm512_mul_ps(vec_math::load16(x + j), vr));
    vec_math::store16(out + j, _mm512_mul_ps(vec_math::load16(w + j), normed));
  }
#elif MESHSERVE_AVX2
  const __m256 vr = _mm256_set1_ps(r);
  for (; j + 8 <= d; j += 8) {
    const __m256 normed = vec_math::round8(_mm256_mul_ps(vec_math::load8(x + j), vr));
    vec_math::store8(out + j, _mm256_mul_ps(vec_math::load8(w + j), normed));
  }
#endif
  for (; j < d; ++j) out[j] = bf16(float(w[j]) * float(bf16(float(x[j]) * r)));
}

// residual += a (rounded to bf16, as the residual stream is stored).
inline void add_row(bf16* residual, const bf16* a, int64_t d) {
  int64_t j = 0;
#if MESHSERVE_AVX512
  for (; j + 16 <= d; j += 16)
    vec_math::store16(residual + j, _mm512_add_ps(vec_math::load16(residual + j), vec_math::load16(a + j)));
#elif MESHSERVE_AVX2
  for (; j + 8 <= d; j += 8)
    vec_math::store8(residual + j, _mm256_add_ps(vec_math::load8(residual + j), vec_math::load8(a + j)));
#endif
  for (; j < d; ++j) residual[j] = bf16(float(residual[j]) + float(a[j]));
}

// Rotates `heads` heads of head_dim d in place (Hugging Face's rotate-half layout); c, s: the
// position's d/2 cos and sin values.
inline void rope_heads(bf16* row, int64_t heads, int64_t d, const bf16* c, const bf16* s) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    bf16* x = row + h * d;
    int64_t j = 0;
#if MESHSERVE_AVX512
    for (; j + 16 <= half; j += 16) {
      const __m512 x1 = vec_math::load16(x + j), x2 = vec_math::load16(x + j + half);
      const __m512 cj = vec_math::load16(c + j), sj = vec_math::load16(s + j);
      vec_math::store16(x + j, _mm512_sub_ps(_mm512_mul_ps(x1, cj), _mm512_mul_ps(x2, sj)));
      vec_math::store16(x + j + half, _mm512_add_ps(_mm512_mul_ps(x2, cj), _mm512_mul_ps(x1, sj)));
    }
#elif MESHSERVE_AVX2
    for (; j + 8 <= half; j += 8) {
      const __m256 x1 = vec_math::load8(x + j), x2 = vec_math::load8(x + j + half);
      const __m256 cj = vec_math::load8(c + j), sj = vec_math::load8(s + j);
      vec_math::store8(x + j, _mm256_sub_ps(_mm256_mul_ps(x1, cj), _mm256_mul_ps(x2, sj)));
      vec_math::store8(x + j + half, _mm256_add_ps(_mm256_mul_ps(x2, cj), _mm256_mul_ps(x1, sj)));
    }
#endif
    for (; j < half; ++j) {
      const float x1 = float(x[j]), x2 = float(x[j + half]), cj = float(c[j]), sj = float(s[j]);
      x[j] = bf16(x1 * cj - x2 * sj);
      x[j + half] = bf16(x2 * cj + x1 * sj);
    }
  }
}

// o[i] = silu(gate[i]) * up[i], i < n.
inline void silu_mul_row(const bf16* gate, const bf16* up, bf16* o, int64_t n) {
  int64_t i = 0;
  // As torch in bf16: silu rounded to bf16, then the product rounded. The exponential is
  // vec_math's polynomial (about 1 ulp, as torch's own vectorized one), not libm's, which does
  // not vectorize: scalar, this loop was 7x slower than torch's two operations.
#if MESHSERVE_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = vec_math::load16(gate + i);
    const __m512 act = vec_math::round16(
        _mm512_div_ps(g, _mm512_add_ps(one, vec_math::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    vec_math::store16(o + i, _mm512_mul_ps(act, vec_math::load16(up + i)));
  }
#elif MESHSERVE_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = vec_math::load8(gate + i);
    const __m256 act = vec_math::round8(
        _mm256_div_ps(g, _mm256_add_ps(one, vec_math::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
    vec_math::store8(o + i, _mm256_mul_ps(act, vec_math::load8(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float gi = float(gate[i]);
    const float act = float(bf16(gi / (1.f + std::exp(-gi))));
    o[i] = bf16(act * float(up[i]));
  }
}

}  // namespace layer_ops
