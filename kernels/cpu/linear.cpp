// bf16 projections on the CPU from a blocked weight layout: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// The layout ("n32k2", made by kernels/linear.py:to_blocked) stores w [N, K] (N a multiple of 32,
// K even) as [N/32][K/2][32][2]: for each block of 32 output columns, the weights of every pair of
// inputs side by side. It is written once by whoever loads the model (the node's model
// loader, into memory every worker maps), so a worker needs no private repacked copy to be fast.
//
// One AVX-512 BF16 dot-product instruction then takes one pair of inputs for 16 columns at once:
// a step loads the block's 32 columns (two 64-byte vectors, one sequential stream through the
// weights) and, for each of up to 12 input rows, broadcasts the row's pair of inputs and
// accumulates into 2 x 12 fp32 accumulators that stay in registers for the whole K loop. Outputs
// are whole vectors: no horizontal sums. Decode at batch 1..4 reads each weight once (bound by
// memory bandwidth); bigger batches keep the block in L1/L2 while every tile of 12 rows passes it.
// Oracle: F.linear on the plain weight (tests/test_cpu_kernels.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MESHSERVE_BF16DOT 1
#endif

namespace {

constexpr int64_t kBlockN = 32;  // output columns per weight block
constexpr int kMaxMR = 12;       // input rows per tile: 24 accumulators + 2 weight vectors + 1 broadcast

#ifdef MESHSERVE_BF16DOT
// out[m0:m0+MR, block columns] from one weight block ([K2][32][2] bf16) and MR input rows.
template <int MR>
void tile(const c10::BFloat16* x, int64_t K, const c10::BFloat16* wblock, const float* bias, c10::BFloat16* out,
          int64_t ldo) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const char* wp = reinterpret_cast<const char*>(wblock + k2 * 2 * kBlockN);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 64);
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

using TileFn = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, const float*, c10::BFloat16*, int64_t);

template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1>...};
}
constexpr auto kTiles = tiles(std::make_integer_sequence<int, kMaxMR>{});
#endif

}  // namespace

bool available() {
#ifdef MESHSERVE_BF16DOT
  return true;
#else
  return false;
#endif
}

void linear_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& wb, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "linear_bf16: built without AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wb.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && wb.dim() == 4, "linear_bf16: x [M, K], out [M, N], w [N/32, K/2, 32, 2]");
  TORCH_CHECK(x.is_contiguous() && wb.is_contiguous() && out.is_contiguous(), "linear_bf16: contiguous tensors");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NB = wb.size(0);
  TORCH_CHECK(K % 2 == 0 && wb.size(1) == K / 2 && wb.size(2) == kBlockN && wb.size(3) == 2,
              "linear_bf16: weight blocks do not match x");
  TORCH_CHECK(out.size(0) == M && N == NB * kBlockN, "linear_bf16: out does not match the weight");
  std::vector<float> b;  // fp32
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
                "linear_bf16: bias must be bfloat16 [N]");
    b.resize(N);
    const auto* bp = bias->data_ptr<c10::BFloat16>();
    for (int64_t n = 0; n < N; ++n) b[n] = float(bp[n]);
  }
#ifdef MESHSERVE_BF16DOT
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = wb.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t block_elems = wb.size(1) * kBlockN * 2;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t n0 = nb * kBlockN;
      const float* bb = b.empty() ? nullptr : b.data() + n0;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMR) {
        const int64_t mr = std::min<int64_t>(kMaxMR, M - m0);
        kTiles[mr - 1](xp + m0 * K, K, wp + nb * block_elems, bb, op + m0 * N + n0, N);
      }
    }
  });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the AVX-512 BF16 path was compiled in");
  m.def("linear_bf16", &linear_bf16, "out = x @ w.T (+ bias), w in the n32k2 blocked layout", py::arg("out"),
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
}
