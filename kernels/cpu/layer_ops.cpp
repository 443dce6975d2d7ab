// The small element-wise steps of a decoder layer, fused, CPU, bf16.
//
// At batch 1 a layer's projections take ~0.3 ms, while PyTorch's RMSNorm on bf16 alone is ten
// tensor operations (casts, pow, mean, rsqrt, muls) of a few microseconds each, and RoPE and
// SwiGLU a handful more: the per-operation cost, not the arithmetic, was a third of a token's
// time. Each function here is one pass over its rows, fp32 inside, bf16 out, rounding where
// Hugging Face's bf16 model rounds (the residual stream is stored in bf16 after each add).
// Oracles: the torch expressions in shared/model/llama.py (tests/test_cpu_kernels.py).

#include "layer_ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>

using namespace layer_ops;

namespace {

// Rows are split across threads only when there is enough work to pay for waking them.
constexpr int64_t kParallelElems = 1 << 16;

template <typename F>
void for_rows(int64_t rows, int64_t row_elems, F&& f) {
  if (rows * row_elems < kParallelElems) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElems / row_elems), f);
  }
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, ": bfloat16 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": 2-d with contiguous rows");
}

}  // namespace

// out = RMSNorm(x) * w.
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm x");
  check_rows(out, "rms_norm out");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(out.size(0) == n && out.size(1) == d && w.numel() == d && w.is_contiguous(), "rms_norm: shapes");
  const bf16* wp = w.data_ptr<bf16>();
  for_rows(n, d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row(x.data_ptr<bf16>() + r * x.stride(0), wp, out.data_ptr<bf16>() + r * out.stride(0), d, float(eps));
  });
}

// residual += a (the residual stream, rounded to bf16); then a = RMSNorm(residual) * w, in place.
void add_rms_norm_(at::Tensor a, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(a, "add_rms_norm a");
  check_rows(residual, "add_rms_norm residual");
  const int64_t n = a.size(0), d = a.size(1);
  TORCH_CHECK(residual.size(0) == n && residual.size(1) == d && w.numel() == d && w.is_contiguous(),
              "add_rms_norm: shapes");
  const bf16* wp = w.data_ptr<bf16>();
  for_rows(n, d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      bf16* ap = a.data_ptr<bf16>() + r * a.stride(0);
      bf16* xp = residual.data_ptr<bf16>() + r * residual.stride(0);
      add_row(xp, ap, d);
      norm_row(xp, wp, ap, d, float(eps));
    }
  });
}

// Rotary embedding in place on the first `heads` heads of each row of qkv ([n, >= heads*d]),
// Hugging Face's rotate-half layout; cos/sin: [max_positions, d/2] tables, looked up by position.
void rope_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t heads, int64_t d) {
  check_rows(qkv, "rope qkv");
  check_rows(cos, "rope cos");
  check_rows(sin, "rope sin");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rope: int64 positions");
  const int64_t n = qkv.size(0), half = d / 2;
  TORCH_CHECK(positions.numel() == n && qkv.size(1) >= heads * d && cos.size(1) == half && sin.size(1) == half,
              "rope: shapes");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for_rows(n, heads * d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "rope: position out of range");
      const bf16* c = cos.data_ptr<bf16>() + pos[r] * cos.stride(0);
      const bf16* s = sin.data_ptr<bf16>() + pos[r] * sin.stride(0);
      rope_heads(qkv.data_ptr<bf16>() + r * qkv.stride(0), heads, d, c, s);
    }
  });
}

// out[n, i] = silu(gate_up[n, i]) * gate_up[n, I + i], with gate_up = [gate | up] of width 2I.
void silu_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul gate_up");
  check_rows(out, "silu_mul out");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(out.size(0) == n && out.size(1) == inter, "silu_mul: shapes");
  for_rows(n, inter, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* g = gate_up.data_ptr<bf16>() + r * gate_up.stride(0);
      silu_mul_row(g, g + inter, out.data_ptr<bf16>() + r * out.stride(0), inter);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * w");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += a; a = RMSNorm(residual) * w");
  m.def("rope_", &rope_, "rotary embedding in place on the first heads of each row");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
}
