// Weight-only int8 projections on the CPU: out[m, n] = sum_k x[m, k] * q[n, k] * scale[n] (+ bias[n]),
// x and out bf16, q int8 with one fp32 scale per output column (kernels/int8_linear.py quantizes).
//
// Layout ("int8 n16k2", made by kernels/int8_linear.py:to_blocked): q [N, K] (N a multiple of 16,
// K even) as [N/16][K/2][16][2]: per block of 16 output columns, each pair of inputs side by side.
// Written once by whoever loads the model (the node's model loader, into shared memory).
//
// Integer dot products, AVX2: each input row is quantized on the fly to int16 with one scale per
// row, as many levels as the int32 accumulators allow over K (32767 up to K = 516, 11008 at
// K = 1536): finer than bf16's own rounding of small values near large ones, so the result is
// the dequantized product up to the output's bf16 rounding. One step takes a pair of inputs for a
// block: 32 weight bytes widened to int16 (vpmovsxbw), then per row one broadcast of the row's
// int16 pair and vpmaddwd + vpaddd into 8-column int32 accumulators that stay in registers for
// the whole K loop; the scales are applied once at the end. Integer sums are exact, so a row's
// result does not depend on the tile or the batch it ran in. Measured on this design's
// alternatives (docs/quantization.md): int8 activations with vpmaddubsw are ~25% faster at
// 16-64 rows but cost 3.4% perplexity (over the 2% bar); dequantizing into fp32 and FMA is
// 1.6-2.5x slower at every row count. Batch 1 reads each weight byte once (bound by memory
// bandwidth). With AVX-512 VNNI the tiles are 16 columns wide, one vpdpwssd per row and step, and
// give the AVX2 tiles' bits (int8_linear.h). Oracle: F.linear on the dequantized weight
// (tests/test_int8.py).

#include "int8_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

using namespace int8_linear;

bool available() {
#if MESHSERVE_AVX2
  return true;
#else
  return false;
#endif
}

bool uses_vnni() {
#if MESHSERVE_INT8_VNNI
  return vnni_enabled();
#else
  return false;
#endif
}

// Off: the AVX2 tiles on a VNNI machine (tests and linear_bench compare the two); on where built.
void set_vnni(bool on) {
#if MESHSERVE_INT8_VNNI
  vnni_enabled() = on;
#else
  (void)on;
#endif
}

void linear_int8(at::Tensor out, const at::Tensor& x, const at::Tensor& wb, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "linear_int8: built without AVX2");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "linear_int8: bf16 x and out");
  TORCH_CHECK(wb.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "linear_int8: int8 w, fp32 scale");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && wb.dim() == 4, "linear_int8: x [M, K], out [M, N], w [N/16, K/2, 16, 2]");
  TORCH_CHECK(x.is_contiguous() && wb.is_contiguous() && out.is_contiguous() && scale.is_contiguous(),
              "linear_int8: contiguous tensors");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NB = wb.size(0);
  TORCH_CHECK(K % 2 == 0 && wb.size(1) == K / 2 && wb.size(2) == kBlockN && wb.size(3) == 2,
              "linear_int8: weight blocks do not match x");
  TORCH_CHECK(out.size(0) == M && N == NB * kBlockN && scale.numel() == N, "linear_int8: out/scale do not match w");
  std::vector<float> b;  // fp32
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "linear_int8: bias must be [N]");
    b.resize(N);
    if (bias->scalar_type() == at::kBFloat16) {
      const auto* bp = bias->data_ptr<bf16>();
      for (int64_t n = 0; n < N; ++n) b[n] = float(bp[n]);
    } else {
      TORCH_CHECK(bias->scalar_type() == at::kFloat, "linear_int8: bias bf16 or fp32");
      std::memcpy(b.data(), bias->data_ptr<float>(), N * sizeof(float));
    }
  }
#if MESHSERVE_AVX2
  const auto* xp = x.data_ptr<bf16>();
  std::vector<int16_t> xq(M * K);
  std::vector<float> sx(M);
  const float levels = float(levels_for(K));
  const auto quantize = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, levels, xq.data() + m * K, sx.data() + m);
  };
  if (M * K < (1 << 16)) {
    quantize(0, M);  // waking the threads costs more than the rows
  } else {
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 15) / K), quantize);
  }
  const auto* wp = wb.data_ptr<int8_t>();
  const auto* sp = scale.data_ptr<float>();
  auto* op = out.data_ptr<bf16>();
  const float* bp = b.empty() ? nullptr : b.data();
  const int64_t block_elems = (K / 2) * kBlockN * 2;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    if (M < kWidenRows || uses_vnni()) {  // VNNI tiles widen in the same instruction they load with
      int8_blocks(xq.data(), sx.data(), M, K, wp, sp, bp, op, N, nb0, nb1);
      return;
    }
    std::vector<int16_t> wide(block_elems);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t n0 = nb * kBlockN;
      const int8_t* block = wp + nb * block_elems;
      for (int64_t i = 0; i < block_elems; i += 16) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide.data() + i), _mm256_cvtepi8_epi16(v));
      }
      for (int64_t m0 = 0; m0 < M; m0 += kWideMR) {
        const int64_t mr = std::min<int64_t>(kWideMR, M - m0);
        kWideTiles[mr - 1](xq.data() + m0 * K, K, wide.data(), sp + n0, sx.data() + m0, bp ? bp + n0 : nullptr,
                           op + m0 * N + n0, N);
      }
    }
  });
#endif
}

// out [N, K] bf16 = q * scale, q in the n16k2 blocked layout: the plain bf16 weight torch's GEMM
// takes (a step of many rows on AMX tiles), in one pass. Bit for bit dequantize(from_blocked(q),
// scale, bf16) of kernels/int8_linear.py, which took four passes (a re-layout, a widening to
// fp32, the product, the rounding): about 10x slower with the GEMM after it (linear_bench).
void dequantize_bf16(at::Tensor out, const at::Tensor& wb, const at::Tensor& scale) {
  TORCH_CHECK(wb.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && out.scalar_type() == at::kBFloat16,
              "dequantize_bf16: int8 w, fp32 scale, bf16 out");
  TORCH_CHECK(wb.dim() == 4 && wb.size(2) == kBlockN && wb.size(3) == 2 && wb.is_contiguous() && scale.is_contiguous() &&
              out.is_contiguous(), "dequantize_bf16: w [N/16, K/2, 16, 2], contiguous tensors");
  const int64_t NB = wb.size(0), K2 = wb.size(1), K = 2 * K2, N = NB * kBlockN;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && scale.numel() == N, "dequantize_bf16: shapes");
  const int8_t* wp = wb.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int8_t* block = wp + nb * K2 * kBlockN * 2;  // [K2][16][2]
      const int64_t n0 = nb * kBlockN;
      int64_t k2 = 0;
#if MESHSERVE_AVX2
      // Eight k2 steps at a time: the 8 x 16 matrix of int16 pairs (k2, row) transposed to rows, both
      // 128-bit halves at once (rows 0-7 and 8-15): each result holds 16 int8 of one row.
      for (; k2 + 8 <= K2; k2 += 8) {
        __m256i r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (k2 + i) * 32));
        __m256i a[8], b[8], c[8];
        for (int i = 0; i < 4; ++i) {
          a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
          a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
        }
        for (int h = 0; h < 2; ++h) {  // h: k2 steps 0-3 or 4-7
          b[4 * h + 0] = _mm256_unpacklo_epi32(a[4 * h], a[4 * h + 2]);
          b[4 * h + 1] = _mm256_unpackhi_epi32(a[4 * h], a[4 * h + 2]);
          b[4 * h + 2] = _mm256_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);
          b[4 * h + 3] = _mm256_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);
        }
        for (int i = 0; i < 4; ++i) {
          c[2 * i] = _mm256_unpacklo_epi64(b[i], b[i + 4]);
          c[2 * i + 1] = _mm256_unpackhi_epi64(b[i], b[i + 4]);
        }
        for (int j = 0; j < 8; ++j) {  // c[j]: row j (low half) and row j + 8 (high half)
          for (int half = 0; half < 2; ++half) {
            const int64_t n = n0 + j + 8 * half;
            const __m128i q = half ? _mm256_extracti128_si256(c[j], 1) : _mm256_castsi256_si128(c[j]);
            const __m256 s = _mm256_set1_ps(sp[n]);
            bf16* o = op + n * K + 2 * k2;
            vec_math::store8(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s));
            vec_math::store8(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), s));
          }
        }
      }
#endif
      for (; k2 < K2; ++k2)
        for (int64_t j = 0; j < kBlockN; ++j)
          for (int64_t t = 0; t < 2; ++t)
            op[(n0 + j) * K + 2 * k2 + t] = bf16(float(block[(k2 * kBlockN + j) * 2 + t]) * sp[n0 + j]);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the AVX2 path was compiled in");
  m.def("uses_vnni", &uses_vnni, "whether the projections run the AVX-512 VNNI tiles");
  m.def("set_vnni", &set_vnni, "run the VNNI tiles (where built) or the AVX2 ones");
  m.def("levels_for", &levels_for, "the int16 levels an input row of K elements is quantized to");
  m.def("linear_int8", &linear_int8, "out = x @ (q * scale).T (+ bias), q in the int8 n16k2 blocked layout",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("dequantize_bf16", &dequantize_bf16, "out [N, K] bf16 = q * scale from the blocked int8 weight");
}
