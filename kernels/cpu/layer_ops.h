// One row of each of a decoder layer's element-wise steps, bf16 in and out, fp32 inside, rounding
// where Hugging Face's bf16 model rounds (layer_ops.cpp describes why): shared by layer_ops.cpp
// and fused_decode.cpp, so both compute the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace layer_ops {

using bf16 = c10::BFloat16;

// out = RMSNorm(x) * w over d elements.
inline void norm_row(const bf16* x, const bf16* w, bf16* out, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    float v = float(x[j]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / float(d) + eps);
  // As Hugging Face: normalize in fp32, round to bf16, then scale by the bf16 weight.
  for (int64_t j = 0; j < d; ++j) out[j] = bf16(float(w[j]) * float(bf16(float(x[j]) * r)));
}

// residual += a (rounded to bf16, as the residual stream is stored).
inline void add_row(bf16* residual, const bf16* a, int64_t d) {
  for (int64_t j = 0; j < d; ++j) residual[j] = bf16(float(residual[j]) + float(a[j]));
}

// Rotates `heads` heads of head_dim d in place (Hugging Face's rotate-half layout); c, s: the
// position's d/2 cos and sin values.
inline void rope_heads(bf16* row, int64_t heads, int64_t d, const bf16* c, const bf16* s) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    bf16* x = row + h * d;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = float(x[j]), x2 = float(x[j + half]), cj = float(c[j]), sj = float(s[j]);
      x[j] = bf16(x1 * cj - x2 * sj);
      x[j + half] = bf16(x2 * cj + x1 * sj);
    }
  }
}

// o[i] = silu(gate[i]) * up[i], i < n.
inline void silu_mul_row(const bf16* gate, const bf16* up, bf16* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // As torch in bf16: silu rounded to bf16, then the product rounded.
    const float gi = float(gate[i]);
    const float act = float(bf16(gi / (1.f + std::exp(-gi))));
    o[i] = bf16(act * float(up[i]));
  }
}

}  // namespace layer_ops
