// Small-batch bf16 matrix-vector products, CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Decode at batch 1..4 reads every weight once per token, so it is bound by memory bandwidth; the
// general GEMM libraries reach about half of it on these shapes. This reads each weight row once
// for all m, with AVX-512 BF16 dot products (32 products per instruction, fp32 accumulation),
// one row at a time in memory order, rows split across OpenMP threads. Reading four rows side by
// side (four short streams) reached under half of what a plain sum over the same bytes gets; one
// sequential stream comes close to it: the hardware prefetcher follows one stream. The weight stays in its plain [N, K]
// layout, so it can live in memory that other processes map. Oracle: F.linear (kernels/linear.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MESHSERVE_BF16DOT 1
#endif

namespace {

constexpr int kMaxM = 4;

inline float dot_scalar(const c10::BFloat16* a, const c10::BFloat16* b, int64_t k) {
  float s = 0.f;
  for (int64_t i = 0; i < k; ++i) s += float(a[i]) * float(b[i]);
  return s;
}

#ifdef MESHSERVE_BF16DOT
inline __m512bh load_bh(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
#endif

// Rows [n0, n1) of the output for all M inputs.
void rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
          int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
#ifdef MESHSERVE_BF16DOT
  const int64_t K32 = K / 32 * 32;
  // One row at a time, in memory order: a single sequential stream the prefetcher follows.
  for (; n < n1; ++n) {
    __m512 acc[kMaxM][2];
    for (int m = 0; m < M; ++m) { acc[m][0] = _mm512_setzero_ps(); acc[m][1] = _mm512_setzero_ps(); }
    const c10::BFloat16* wr = w + n * K;
    int64_t k = 0;
    for (; k + 64 <= K32; k += 64) {
      __m512bh w0 = load_bh(wr + k), w1 = load_bh(wr + k + 32);
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, load_bh(x + m * K + k));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, load_bh(x + m * K + k + 32));
      }
    }
    for (; k < K32; k += 32) {
      __m512bh w0 = load_bh(wr + k);
      for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, load_bh(x + m * K + k));
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
      if (K32 < K) s += dot_scalar(x + m * K + K32, wr + K32, K - K32);
      if (bias) s += float(bias[n]);
      out[m * N + n] = c10::BFloat16(s);
    }
  }
#endif
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = dot_scalar(x + m * K, w + n * K, K);
      if (bias) s += float(bias[n]);
      out[m * N + n] = c10::BFloat16(s);
    }
}

}  // namespace

bool available() {
#ifdef MESHSERVE_BF16DOT
  return true;
#else
  return false;
#endif
}

void gemv_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv_bf16: 2-d tensors");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "gemv_bf16: contiguous tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M <= kMaxM, "gemv_bf16: at most 4 rows");
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "gemv_bf16: shape mismatch");
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
                "gemv_bf16: bias must be bfloat16 [N]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  // Grains of 64 rows (multiples of 4) keep the fast path busy and the threads balanced.
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t g0, int64_t g1) {
    rows(xp, wp, b, op, M, N, K, g0 * 64, std::min(N, g1 * 64));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the AVX-512 BF16 path was compiled in");
  m.def("gemv_bf16", &gemv_bf16, "out = x @ w.T (+ bias) for 1..4 rows of bf16 x", py::arg("out"), py::arg("x"),
        py::arg("w"), py::arg("bias") = py::none());
}
