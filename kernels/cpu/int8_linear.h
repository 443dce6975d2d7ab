// The int8 projection kernel's building blocks (kernels/cpu/int8_linear.cpp describes the format
// and the design): shared by int8_linear.cpp and fused_decode.cpp, which runs the same tiles.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "vec_math.h"  // MESHSERVE_AVX2: the int8 tiles need AVX2 and FMA

// AVX-512 VNNI (vpdpwssd: an int16 pair's two products and their sum into an int32 lane, one
// instruction): a tile's step for one block is one widened weight vector and, per row, one
// broadcast and one vpdpwssd, against AVX2's two widenings and, per row, two vpmaddwd and two
// vpaddd. The same integer sums and the same epilogue, so the same bits as the AVX2 tiles.
#if MESHSERVE_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MESHSERVE_INT8_VNNI 1
#else
#define MESHSERVE_INT8_VNNI 0
#endif

namespace int8_linear {

using bf16 = c10::BFloat16;
constexpr int64_t kBlockN = 16;  // output columns per weight block: two vectors of 8 int32 accumulators
constexpr int kMaxMR = 6;        // rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast + 1 product
// From this many rows on, each block is first widened to int16 (once, into a per-thread buffer)
// and tiles of kWideMR rows read it with no conversion: 10-15% faster at 64-128 rows.
constexpr int64_t kWidenRows = 2 * kMaxMR + 1;
constexpr int kWideMR = 4;
constexpr int kPrefetchBytes = 2048;

#if MESHSERVE_AVX2
// fp32 -> bf16, round to nearest even as torch does; NaN stays NaN.
inline __m128i to_bf16(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

inline __m256 load_bf16(const bf16* p) {  // 8 bf16 -> 8 fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// out[0:MR, block columns] from one weight block ([K/2][16][2], int8 as stored or int16 once widened)
// and MR quantized rows. scale: the block's 16 column scales; sx: the rows' scales; bias: 16 fp32 or null.
template <int MR, typename W>
void tile(const int16_t* xq, int64_t K, const W* wblock, const float* scale, const float* sx, const float* bias,
          bf16* out, int64_t ldo) {
  __m256i acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const W* wp = wblock + k2 * 2 * kBlockN;
    __m256i w0, w1;
    if constexpr (sizeof(W) == 1) {
      // The stream from memory: the hardware prefetcher alone left batch 1-4 ~15% slower.
      _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
    } else {
      w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
    }
    for (int m = 0; m < MR; ++m) {
      int32_t v;  // the row's pair of inputs, broadcast to every column
      std::memcpy(&v, xq + m * K + 2 * k2, sizeof v);
      const __m256i xb = _mm256_set1_epi32(v);
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(xb, w0));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(xb, w1));
    }
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    const __m256 r = _mm256_set1_ps(sx[m]);
    const __m256 y0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(s0, r), b0);
    const __m256 y1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(s1, r), b1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + m * ldo), to_bf16(y0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + m * ldo + 8), to_bf16(y1));
  }
}

template <typename W>
using TileFn = void (*)(const int16_t*, int64_t, const W*, const float*, const float*, const float*, bf16*, int64_t);

template <typename W, int... R>
constexpr std::array<TileFn<W>, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, W>...};
}
constexpr auto kTiles = tiles<int8_t>(std::make_integer_sequence<int, kMaxMR>{});
constexpr auto kWideTiles = tiles<int16_t>(std::make_integer_sequence<int, kWideMR>{});

#if MESHSERVE_INT8_VNNI
constexpr int kVnniMR = 16;  // rows per tile: 16 accumulators of 16 columns + the weights + a broadcast

// Whether int8_blocks runs the VNNI tiles (the tests and linear_bench turn them off to run the
// AVX2 ones on the same machine).
inline bool& vnni_enabled() {
  static bool on = true;
  return on;
}

// As tile, one 16-column int32 accumulator per row; reads the int8 block as stored.
template <int MR>
void tile_vnni(const int16_t* xq, int64_t K, const int8_t* wblock, const float* scale, const float* sx,
               const float* bias, bf16* out, int64_t ldo) {
  __m512i acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_si512();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const int8_t* wp = wblock + k2 * 2 * kBlockN;
    if (k2 % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
    for (int m = 0; m < MR; ++m) {
      int32_t v;
      std::memcpy(&v, xq + m * K + 2 * k2, sizeof v);
      acc[m] = _mm512_dpwssd_epi32(acc[m], _mm512_set1_epi32(v), w);
    }
  }
  const __m512 s = _mm512_loadu_ps(scale);
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(s, _mm512_set1_ps(sx[m])), b);
    vec_math::store16(out + m * ldo, y);
  }
}

template <int... R>
constexpr std::array<TileFn<int8_t>, sizeof...(R)> vnni_tiles(std::integer_sequence<int, R...>) {
  return {&tile_vnni<R + 1>...};
}
constexpr auto kVnniTiles = vnni_tiles(std::make_integer_sequence<int, kVnniMR>{});
#endif

// One row to int16 with its scale: q = round(x / s), s = max|x| / levels.
inline void quantize_row(const bf16* x, int64_t K, float levels, int16_t* q, float* s) {
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load_bf16(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float a = 0.f;
  for (float l : lanes) a = std::max(a, l);
  for (; k < K; ++k) a = std::max(a, std::fabs(float(x[k])));
  *s = a / levels;
  const float inv = a > 0.f ? levels / a : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (k = 0; k + 16 <= K; k += 16) {  // cvtps rounds to nearest even; packs interleaves 128-bit lanes, the permute restores the order
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16(x + k), vinv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16(x + k + 8), vinv));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), p);
  }
  for (; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(float(x[k]) * inv));
}

// out[0:M, blocks nb0..nb1) from M rows quantized by quantize_row (xq [M, K], sx [M]); w: the whole
// blocked weight, scale/bias its N columns' (bias fp32 or null); ldo: out's row stride.
inline void int8_blocks(const int16_t* xq, const float* sx, int64_t M, int64_t K, const int8_t* w,
                        const float* scale, const float* bias, bf16* out, int64_t ldo, int64_t nb0, int64_t nb1) {
  const int64_t block_elems = (K / 2) * kBlockN * 2;
  const TileFn<int8_t>* tile_for = kTiles.data();  // by rows - 1
  int64_t max_mr = kMaxMR;
#if MESHSERVE_INT8_VNNI
  if (vnni_enabled()) {
    tile_for = kVnniTiles.data();
    max_mr = kVnniMR;
  }
#endif
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t n0 = nb * kBlockN;
    for (int64_t m0 = 0; m0 < M; m0 += max_mr) {
      const int64_t mr = std::min<int64_t>(max_mr, M - m0);
      tile_for[mr - 1](xq + m0 * K, K, w + nb * block_elems, scale + n0, sx + m0, bias ? bias + n0 : nullptr,
                       out + m0 * ldo + n0, ldo);
    }
  }
}
#endif

// The int16 levels a row gets: int32 accumulators hold K products of |q| <= 127 and |x| <= levels.
inline double levels_for(int64_t K) { return std::min(32767.0, std::floor(2147483647.0 / (127.0 * double(K)))); }

}  // namespace int8_linear
