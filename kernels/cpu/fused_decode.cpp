// A decode step's decoder layers in one call, CPU: bf16 activations, int8 weights in the n16k2 layout
// (kernels/cpu/int8_linear.cpp) or bf16 weights in the n32k2 layout (kernels/cpu/linear.cpp, with
// AVX-512 BF16), a bf16 or int8 paged KV arena.
//
// Why: at batch 1 a token of SmolLM2-135M is 30 layers of four projections of 0.3-1.8 MB each and
// about 25 small operations around them (views, RoPE, the KV write, attention, norms, SwiGLU), each a
// Python call of a few microseconds, and each projection one OpenMP fork and join. Here the whole
// stack is one parallel region: the threads split each projection's weight blocks and meet at a
// barrier only where one step needs another thread's results (five per layer); the small
// per-row steps a thread needs next (adding to the residual, RMSNorm, quantizing a projection's
// input to int16 for int8 weights) each thread computes for itself, which costs less than a
// barrier. Attention runs one task per (sequence, KV head): that head's RoPE, its new K/V row
// written into the arena, then the attention itself (with a proposal's rows being verified, all
// writes first, then a barrier, then the attention). gate|up's blocks go to threads in (gate, up) pairs, so SwiGLU is applied as
// soon as a pair is done.
//
// Every step runs the code of the per-operation path (int8_linear.h or linear.h, layer_ops.h,
// paged_attention.h) on the same inputs, so the result is bit for bit that path's: LlamaModel's
// per-operation forward is the oracle (tests/test_fused_decode.py).

#include "int8_linear.h"
#include "layer_ops.h"
#include "linear.h"
#include "paged_attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using bf16 = c10::BFloat16;

struct Proj {
  const int8_t* w8 = nullptr;  // int8 weights (n16k2) and their column scales,
  const float* scale = nullptr;
  const bf16* w16 = nullptr;  // or bf16 weights (n32k2)
  std::vector<float> bias;  // fp32, empty: none
  int64_t N = 0, K = 0;
};

// The most rows a step may have: the tiles of either kernel take any number (int8's without the
// widening its projection kernel does from kWidenRows: the same integer sums, so the same bits);
// each thread's copies of the residual and the projection input grow with them.
constexpr int64_t kMaxRows = 64;

// [begin, end) of `n` items for thread t of `threads` (contiguous chunks, as at::parallel_for).
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int threads) {
  const int64_t chunk = (n + threads - 1) / threads;
  return {std::min(n, t * chunk), std::min(n, (t + 1) * chunk)};
}

bool available() {
#if MESHSERVE_AVX2
  return true;
#else
  return false;
#endif
}

bool bf16_weights() { return MESHSERVE_AVX2 && MESHSERVE_BF16DOT; }

#if MESHSERVE_AVX2
class FusedDecode {
 public:
  // weights, scales: per layer qkv, o, gate_up, down (4 x layers): blocked int8 and their fp32
  // scales, or blocked bf16 and no scales;
  // qkv_bias: per layer, or empty; norms: the layers' attn_norm, then their mlp_norm, then the final
  // norm (bf16); cos, sin: [max_positions, head_dim / 2] bf16 tables; scale: attention's;
  // qk_norms: per layer its q and k head norms (Qwen3: RMSNorm over each head before RoPE), or empty.
  FusedDecode(std::vector<at::Tensor> weights, std::vector<at::Tensor> scales, std::vector<at::Tensor> qkv_bias,
              std::vector<at::Tensor> norms, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale, std::vector<at::Tensor> qk_norms)
      : keep_(weights), hq_(heads), hkv_(kv_heads), d_(head_dim), eps_(float(eps)), scale_(float(scale)) {
    TORCH_CHECK(available(), "fused_decode: built without AVX2");
    TORCH_CHECK(weights.size() % 4 == 0 && !weights.empty(), "fused_decode: 4 weights per layer");
    int8_ = weights[0].scalar_type() == at::kChar;
    bn_ = int8_ ? int8_linear::kBlockN : bf16_linear::kBlockN;
    TORCH_CHECK(int8_ || bf16_weights(), "fused_decode: bf16 weights need AVX-512 BF16");
    TORCH_CHECK(scales.size() == (int8_ ? weights.size() : 0), "fused_decode: 4 scales per layer for int8 weights, none for bf16");
    layers_ = int64_t(weights.size() / 4);
    TORCH_CHECK(qkv_bias.empty() || int64_t(qkv_bias.size()) == layers_, "fused_decode: one qkv bias per layer");
    TORCH_CHECK(int64_t(norms.size()) == 2 * layers_ + 1, "fused_decode: 2 norms per layer and the final one");
    TORCH_CHECK(hkv_ > 0 && hq_ % hkv_ == 0 && d_ % 2 == 0, "fused_decode: heads");
    for (size_t i = 0; i < weights.size(); ++i) {
      const at::Tensor& w = weights[i];
      TORCH_CHECK(w.scalar_type() == (int8_ ? at::kChar : at::kBFloat16) && w.dim() == 4 && w.is_contiguous() &&
                      w.size(2) == bn_ && w.size(3) == 2,
                  "fused_decode: all weights in the int8 n16k2 layout or all in the bf16 n32k2 one");
      Proj p;
      if (int8_) {
        const at::Tensor& s = scales[i];
        TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == w.size(0) * bn_,
                    "fused_decode: fp32 scales, one per output column");
        p.w8 = w.data_ptr<int8_t>();
        p.scale = s.data_ptr<float>();
        keep_.push_back(s);
      } else {
        p.w16 = w.data_ptr<bf16>();
      }
      p.N = w.size(0) * bn_;
      p.K = w.size(1) * 2;
      if (i % 4 == 0 && !qkv_bias.empty() && qkv_bias[i / 4].defined()) {
        const at::Tensor b = qkv_bias[i / 4].to(at::kFloat).contiguous();
        TORCH_CHECK(b.numel() == p.N, "fused_decode: qkv bias of ", b.numel(), " for ", p.N, " columns");
        p.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + p.N);
      }
      proj_.push_back(std::move(p));
    }
    hidden_ = proj_[1].N;
    const int64_t qkv_n = (hq_ + 2 * hkv_) * d_;
    for (int64_t l = 0; l < layers_; ++l) {
      const Proj &qkv = proj(l, 0), &o = proj(l, 1), &gu = proj(l, 2), &down = proj(l, 3);
      TORCH_CHECK(qkv.N == qkv_n && qkv.K == hidden_, "fused_decode: layer ", l, " q|k|v is ", qkv.N, "x", qkv.K);
      TORCH_CHECK(o.N == hidden_ && o.K == hq_ * d_, "fused_decode: layer ", l, " o does not fit");
      TORCH_CHECK(gu.K == hidden_ && gu.N % (2 * bn_) == 0, "fused_decode: layer ", l, " gate|up");
      TORCH_CHECK(down.N == hidden_ && down.K == gu.N / 2, "fused_decode: layer ", l, " down does not fit");
    }
    for (const at::Tensor& n : norms)
      TORCH_CHECK(n.scalar_type() == at::kBFloat16 && n.is_contiguous() && n.numel() == hidden_,
                  "fused_decode: bf16 norm weights of the hidden size");
    for (const at::Tensor& n : norms) norms_.push_back(n.data_ptr<bf16>());
    keep_.insert(keep_.end(), norms.begin(), norms.end());
    TORCH_CHECK(qk_norms.empty() || int64_t(qk_norms.size()) == 2 * layers_, "fused_decode: 2 q/k norms per layer");
    for (const at::Tensor& n : qk_norms) {
      TORCH_CHECK(n.scalar_type() == at::kBFloat16 && n.is_contiguous() && n.numel() == d_,
                  "fused_decode: bf16 q/k norm weights of the head size");
      qk_norms_.push_back(n.data_ptr<bf16>());
    }
    keep_.insert(keep_.end(), qk_norms.begin(), qk_norms.end());
    TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == d_ / 2,
                "fused_decode: bf16 cos/sin tables [max_positions, head_dim / 2]");
    cos_ = cos;
    sin_ = sin;
  }

  // x: the step's embedding rows [n, hidden] bf16 (one decode token per row; verify_rows: some
  // sequence has several consecutive rows, a proposal being verified, so every row's K/V is
  // written before any row attends: one more barrier per layer); out [n, hidden]
  // gets the final hidden states (the last layer's output through the final norm), as LlamaModel's
  // forward returns them. kv_cache: [layers, 2, slots, kv_heads, head_dim] bf16 or [..., head_dim + 4] int8.
  void forward(at::Tensor out, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens,
                     int64_t block_size, bool verify_rows) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous(),
                "fused_decode: x must be contiguous bf16 [n, ", hidden_, "]");
    const int64_t n = x.size(0);
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.sizes() == x.sizes(),
                "fused_decode: out must be contiguous bf16 like x");
    TORCH_CHECK(n >= 1 && n <= kMaxRows, "fused_decode: 1 to ", kMaxRows, " rows");
    const bool int8_kv = kv_cache.scalar_type() == at::kChar;
    const int64_t R = int8_kv ? d_ + paged_attention::kScaleBytes : d_;
    TORCH_CHECK((int8_kv || kv_cache.scalar_type() == at::kBFloat16) && kv_cache.is_contiguous() && kv_cache.dim() == 5 &&
                    kv_cache.size(0) == layers_ && kv_cache.size(1) == 2 && kv_cache.size(3) == hkv_ &&
                    kv_cache.size(4) == R,
                "fused_decode: kv_cache must be a contiguous bf16 or int8 [layers, 2, slots, kv_heads, row]");
    for (const at::Tensor* t : {&positions, &slot_mapping, &context_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                  "fused_decode: positions, slot_mapping and context_lens: int64 [n]");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                    block_tables.size(0) == n, "fused_decode: block_tables int64 [n, max_blocks]");
    TORCH_CHECK(block_size > 0, "fused_decode: block_size must be positive");
    // Bounds, here on the calling thread, so the parallel region never reads or writes outside.
    const int64_t num_slots = kv_cache.size(2), max_blocks = block_tables.size(1), num_blocks = num_slots / block_size;
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* cl = context_lens.data_ptr<int64_t>();
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < n; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_.size(0), "fused_decode: position ", pos[b], " out of range");
      TORCH_CHECK(slots[b] >= 0 && slots[b] < num_slots, "fused_decode: slot ", slots[b], " outside the arena");
      TORCH_CHECK(cl[b] >= 1 && cl[b] <= max_blocks * block_size, "fused_decode: context_lens[", b, "] = ", cl[b],
                  " does not fit block_tables of ", max_blocks, " blocks");
      for (int64_t j = 0, nb = (cl[b] + block_size - 1) / block_size; j < nb; ++j)
        TORCH_CHECK(bt[b * max_blocks + j] >= 0 && bt[b * max_blocks + j] < num_blocks, "fused_decode: block_tables[",
                    b, ", ", j, "] = ", bt[b * max_blocks + j], " is outside the arena's ", num_blocks, " blocks");
      max_ctx = std::max(max_ctx, cl[b]);
    }

    const int64_t H = hidden_, G = hq_ / hkv_, qkv_n = (hq_ + 2 * hkv_) * d_, inter = proj(0, 2).N / 2;
    const int64_t kmax = std::max(H, std::max(hq_ * d_, inter));
    std::vector<bf16> qkv(n * qkv_n), attn(n * hq_ * d_), o(n * H), gu(n * 2 * inter), g(n * inter);
    paged_attention::Args a;
    a.q = qkv.data();
    a.out = attn.data();
    a.block_tables = bt;
    a.context_lens = cl;
    a.q_stride_b = qkv_n;
    a.q_stride_h = d_;
    a.o_stride_b = hq_ * d_;
    a.o_stride_h = d_;
    a.Hq = hq_;
    a.Hkv = hkv_;
    a.G = G;
    a.D = d_;
    a.R = R;
    a.block_size = block_size;
    a.max_blocks = max_blocks;
    a.num_slots = num_slots;
    a.scale = scale_;
    const paged_attention::AttendFn attend =
        int8_kv ? paged_attention::pick<bf16, int8_t>(d_) : paged_attention::pick<bf16, bf16>(d_);
    char* kvbase = static_cast<char*>(kv_cache.data_ptr());
    const int64_t layer_bytes = 2 * num_slots * hkv_ * R * kv_cache.element_size();  // one layer's arena
    const float levels_h = float(int8_linear::levels_for(H)), levels_a = float(int8_linear::levels_for(hq_ * d_)),
                levels_i = float(int8_linear::levels_for(inter));
    const bf16* xp = x.data_ptr<bf16>();
    const bf16* cosp = cos_.data_ptr<bf16>();
    const bf16* sinp = sin_.data_ptr<bf16>();
    bf16* outp = out.data_ptr<bf16>();
    const int threads = std::max(1, std::min<int>(at::get_num_threads(), 64));

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
      const int t = 0, T = 1;
#endif
      // This thread's own copy of the residual stream and of the next projection's input (int8
      // weights: the rows quantized to int16; bf16: the rows themselves, read where they are).
      std::vector<bf16> r(xp, xp + n * H), h(n * H);
      std::vector<int16_t> xq(int8_ ? n * kmax : 0);
      std::vector<float> sx(n), s(max_ctx * G), qf(G * d_), acc(G * d_), inv(G);
      const bf16* xin = nullptr;
      const auto input = [&](const bf16* rows, int64_t k, float levels) {
        if (!int8_) {
          xin = rows;
          return;
        }
        for (int64_t b = 0; b < n; ++b) int8_linear::quantize_row(rows + b * k, k, levels, xq.data() + b * k, sx.data() + b);
      };
      // y's columns of blocks [nb0, nb1) of p, from the input set last.
      const auto blocks = [&](const Proj& p, bf16* y, int64_t nb0, int64_t nb1) {
        const float* bias = p.bias.empty() ? nullptr : p.bias.data();
        if (int8_) {
          int8_linear::int8_blocks(xq.data(), sx.data(), n, p.K, p.w8, p.scale, bias, y, p.N, nb0, nb1);
        } else {
#if MESHSERVE_BF16DOT
          bf16_linear::bf16_blocks(xin, n, p.K, p.w16, bias, y, p.N, nb0, nb1);
#endif
        }
      };
      const auto project = [&](const Proj& p, bf16* y) {
        const auto [nb0, nb1] = share(p.N / bn_, t, T);
        blocks(p, y, nb0, nb1);
      };
      // r += y, then h = RMSNorm(r) * w, the next projection's input.
      const auto add_norm = [&](const bf16* y, const bf16* w) {
        for (int64_t b = 0; b < n; ++b) {
          layer_ops::add_row(r.data() + b * H, y + b * H, H);
          layer_ops::norm_row(r.data() + b * H, w, h.data() + b * H, H, eps_);
        }
        input(h.data(), H, levels_h);
      };
      for (int64_t b = 0; b < n; ++b) layer_ops::norm_row(r.data() + b * H, norms_[0], h.data() + b * H, H, eps_);
      input(h.data(), H, levels_h);
      for (int64_t l = 0; l < layers_; ++l) {
        project(proj(l, 0), qkv.data());
#pragma omp barrier
        // One task per (sequence, KV head): RoPE on its query heads and its key, its new K/V row
        // into the arena, then attention over the sequence's context.
        void* kv_layer = kvbase + l * layer_bytes;
        paged_attention::Args al = a;
        al.kv = kv_layer;
        const auto [k0, k1] = share(n * hkv_, t, T);
        for (int64_t task = k0; task < k1; ++task) {
          const int64_t b = task / hkv_, kh = task % hkv_;
          bf16* row = qkv.data() + b * qkv_n;
          const bf16* c = cosp + pos[b] * (d_ / 2);
          const bf16* sn = sinp + pos[b] * (d_ / 2);
          bf16* k = row + (hq_ + kh) * d_;
          if (!qk_norms_.empty()) {  // in place, as the per-operation path's rms_norm rows
            for (int64_t g = 0; g < G; ++g)
              layer_ops::norm_row(row + (kh * G + g) * d_, qk_norms_[2 * l], row + (kh * G + g) * d_, d_, eps_);
            layer_ops::norm_row(k, qk_norms_[2 * l + 1], k, d_, eps_);
          }
          layer_ops::rope_heads(row + kh * G * d_, G, d_, c, sn);
          const bf16* v = row + (hq_ + hkv_ + kh) * d_;
          layer_ops::rope_heads(k, 1, d_, c, sn);
          write_row(kv_layer, 0, slots[b], kh, R, int8_kv, k, num_slots);
          write_row(kv_layer, 1, slots[b], kh, R, int8_kv, v, num_slots);
          if (!verify_rows) attend(al, b, kh, s.data(), qf.data(), acc.data(), inv.data());
        }
        if (verify_rows) {  // a row may attend to another's new K/V (a proposal's earlier tokens)
#pragma omp barrier
          for (int64_t task = k0; task < k1; ++task)
            attend(al, task / hkv_, task % hkv_, s.data(), qf.data(), acc.data(), inv.data());
        }
#pragma omp barrier
        input(attn.data(), hq_ * d_, levels_a);
        project(proj(l, 1), o.data());
#pragma omp barrier
        add_norm(o.data(), norms_[layers_ + l]);
        {  // gate|up in (gate, up) block pairs, then SwiGLU on the pair's columns
          const Proj& p = proj(l, 2);
          const int64_t half_blocks = inter / bn_;
          const auto [j0, j1] = share(half_blocks, t, T);
          for (int64_t j = j0; j < j1; ++j) {
            blocks(p, gu.data(), j, j + 1);
            blocks(p, gu.data(), j + half_blocks, j + half_blocks + 1);
            for (int64_t b = 0; b < n; ++b) {
              const bf16* gr = gu.data() + b * 2 * inter + j * bn_;
              layer_ops::silu_mul_row(gr, gr + inter, g.data() + b * inter + j * bn_, bn_);
            }
          }
        }
#pragma omp barrier
        input(g.data(), inter, levels_i);
        project(proj(l, 3), o.data());
#pragma omp barrier
        add_norm(o.data(), norms_[l + 1 < layers_ ? l + 1 : 2 * layers_]);
        // o is written again only after the next layer's first two barriers: every thread has read it.
      }
      if (t == 0) std::copy(h.begin(), h.end(), outp);
    }
  }

 private:
  const Proj& proj(int64_t layer, int which) const { return proj_[layer * 4 + which]; }

  // Stores one new K (plane 0) or V (plane 1) row of KV head kh at `slot` of a layer's arena.
  void write_row(void* layer, int plane, int64_t slot, int64_t kh, int64_t R, bool int8_kv, const bf16* x,
                 int64_t num_slots) const {
    const int64_t row = ((plane * num_slots + slot) * hkv_ + kh) * R;
    if (int8_kv) {
      paged_attention::quantize_into(x, d_, static_cast<int8_t*>(layer) + row);
    } else {
      std::copy(x, x + d_, static_cast<bf16*>(layer) + row);
    }
  }

  std::vector<at::Tensor> keep_;  // what the pointers below point into
  std::vector<Proj> proj_;
  std::vector<const bf16*> norms_;
  std::vector<const bf16*> qk_norms_;  // per layer q's then k's; empty: none
  at::Tensor cos_, sin_;
  int64_t layers_ = 0, hidden_ = 0, hq_, hkv_, d_;
  bool int8_ = true;  // int8 weights, else bf16
  int64_t bn_ = 0;    // the weights' output columns per block
  float eps_, scale_;
};
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the AVX2 path was compiled in");
  m.def("bf16_weights", &bf16_weights, "whether bf16 weights can run fused too (AVX-512 BF16)");
#if MESHSERVE_AVX2
  py::class_<FusedDecode>(m, "FusedDecode")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double, std::vector<at::Tensor>>(),
           py::arg("weights"), py::arg("scales"), py::arg("qkv_bias"), py::arg("norms"), py::arg("cos"), py::arg("sin"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("qk_norms") = std::vector<at::Tensor>())
      // Without the GIL: one call is a whole step (several ms), and the worker's event loop streams
      // the last step's tokens meanwhile.
      .def("forward", &FusedDecode::forward, "the decoder layers of a decode step: out = the final hidden states",
           py::call_guard<py::gil_scoped_release>(), py::arg("out"), py::arg("x"), py::arg("positions"), py::arg("kv_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("context_lens"), py::arg("block_size"), py::arg("verify_rows") = false);
#endif
}
