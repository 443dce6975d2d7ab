// The bf16 projection kernel's building blocks (kernels/cpu/linear.cpp describes the layout and the
// design): shared by linear.cpp and fused_decode.cpp, which runs the same tiles.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MESHSERVE_BF16DOT 1
#else
#define MESHSERVE_BF16DOT 0
#endif

namespace bf16_linear {

using bf16 = c10::BFloat16;
constexpr int64_t kBlockN = 32;  // output columns per weight block
constexpr int kMaxMR = 12;       // input rows per tile: 24 accumulators + 2 weight vectors + 1 broadcast
constexpr int kPrefetchBytes = 2048;

#if MESHSERVE_BF16DOT
// out[0:MR, block columns] from one weight block ([K2][32][2] bf16) and MR input rows; bias: 32 fp32 or null.
template <int MR>
void tile(const bf16* x, int64_t K, const bf16* wblock, const float* bias, bf16* out, int64_t ldo) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const char* wp = reinterpret_cast<const char*>(wblock + k2 * 2 * kBlockN);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 64);
    // The stream from memory: without this, the hardware prefetcher alone left bf16 batch-1 decode's
    // layers 1.4x slower (2-core AMX Xeon; `python -m meshserve.bench.fused_decode_bench --rows 1`).
    _mm_prefetch(wp + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(wp + kPrefetchBytes + 64, _MM_HINT_T0);
    for (int m = 0; m < MR; ++m) {
      int32_t v;  // the row's pair of inputs, broadcast to every column
      std::memcpy(&v, x + m * K + 2 * k2, sizeof v);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(v);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
    }
  }
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    // round to nearest even, as torch rounds fp32 to bf16
    const __m256i r0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][0], b0));
    const __m256i r1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][1], b1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo), r0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + 16), r1);
  }
}

using TileFn = void (*)(const bf16*, int64_t, const bf16*, const float*, bf16*, int64_t);

template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1>...};
}
inline constexpr auto kTiles = tiles(std::make_integer_sequence<int, kMaxMR>{});

// out[0:M, blocks nb0..nb1) from M bf16 rows x [M, K]; w: the whole blocked weight; bias: its N
// columns' in fp32, or null; ldo: out's row stride. A block's result does not depend on which
// thread computes it or on the rows beside it in a tile's neighbours.
inline void bf16_blocks(const bf16* x, int64_t M, int64_t K, const bf16* w, const float* bias, bf16* out, int64_t ldo,
                        int64_t nb0, int64_t nb1) {
  const int64_t block_elems = (K / 2) * kBlockN * 2;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kBlockN;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxMR) {
      const int64_t mr = std::min<int64_t>(kMaxMR, M - m0);
      kTiles[mr - 1](x + m0 * K, K, w + nb * block_elems, bias ? bias + n0 : nullptr, out + m0 * ldo + n0, ldo);
    }
  }
}
#endif

}  // namespace bf16_linear
