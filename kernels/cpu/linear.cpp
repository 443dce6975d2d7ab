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

#include "linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

using bf16_linear::kBlockN;

bool available() {
#if MESHSERVE_BF16DOT
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
#if MESHSERVE_BF16DOT
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = wb.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    bf16_linear::bf16_blocks(xp, M, K, wp, b.empty() ? nullptr : b.data(), op, N, nb0, nb1);
  });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the AVX-512 BF16 path was compiled in");
  m.def("linear_bf16", &linear_bf16, "out = x @ w.T (+ bias), w in the n32k2 blocked layout", py::arg("out"),
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
}
