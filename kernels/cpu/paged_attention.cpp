// Decode attention over a paged KV cache, CPU.
//
// One query token per sequence attends over that sequence's context, read straight out of the
// layer's KV arena through its block table: no gathered copy of the keys and values is made.
//
//   q, out        [B, Hq, D]            float32 or bfloat16 (last axis contiguous)
//   kv            [2, num_slots, Hkv, D] same dtype, contiguous; kv[0] keys, kv[1] values,
//                                        slot = block_id * block_size + offset
//                 or [2, num_slots, Hkv, D + 4] int8 (--kv-cache-dtype int8): each row's D values,
//                                        then the 4 bytes of its float32 scale (value = q * scale)
//   block_tables  [B, max_blocks]        int64, padded with any valid block id
//   context_lens  [B]                    int64, tokens of context including the current one
//                                        (a sequence with none gets zeros)
//
// Work is split over (sequence, KV head); each task handles the G = Hq / Hkv query heads of its KV
// head together, so every key row is read once, and every value row once per sweep of up to 8/4/2
// query heads (head_dim 16-32/64/128, their accumulators held in registers; G <= 4 at head_dim 64,
// e.g. SmolLM2's G = 3, is a single sweep). On AVX-512 the scores are taken 16 key rows at a time:
// the rows widened once into an L1 buffer, then each query head's 16 dot products summed by one
// transposing tree (sum_rows16) rather than 16 horizontal sums. Scores go to a per-thread buffer
// (G x context_len floats), then a max-subtracted softmax, then the weighted sum of the values;
// everything accumulates in float32. With head_dim in {16, 32, 64, 128} the inner loops are
// explicit intrinsics (AVX-512, else AVX2); any other shape or machine takes the plain
// (auto-vectorized) loops.
// An int8 arena is read as int8 and widened in registers; a row's scale multiplies its score (keys)
// or its softmax weight (values), never the D elements: dequantizing costs one multiply per row.
// (The int8 path ran on the AVX2 loops before; the AVX-512 one is 1.5-2.2x faster on SmolLM2's
// shapes, while bf16 and fp32 rows, bound by memory, stay within a few percent of what they were.)

#include "paged_attention.h"
#include "prefill_attention.h"

// Lighter than <torch/extension.h> (halves the compile): Tensor, parallel settings, pybind casters.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace paged_attention;

namespace {

template <typename T, typename KV = T>
void run(const Args& a, int64_t B, int64_t max_ctx) {
  const AttendFn fn = pick<T, KV>(a.D);
  const int64_t tasks = B * a.Hkv;
  const int64_t buf = std::max<int64_t>(max_ctx, 1) * a.G;
  int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
  // A small batch's attention takes microseconds on one core; waking a second thread costs as
  // much, and far more when another process holds that core (the team then waits at the barrier).
  if (B * max_ctx * a.Hkv * a.D < (int64_t(1) << 18)) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // Per-thread buffers: scores (G x max context), scaled queries and accumulators (G x D),
    // softmax normalizers (G).
    std::vector<float> s(buf), qf(a.G * a.D), acc(a.G * a.D), inv(a.G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task)
      fn(a, task / a.Hkv, task % a.Hkv, s.data(), qf.data(), acc.data(), inv.data());
  }
}

}  // namespace

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor kv, at::Tensor block_tables,
                            at::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && kv.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_decode_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, Hq, D] of the same shape");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(), "kv must be a contiguous [2, num_slots, Hkv, D]");
  const bool int8_kv = kv.scalar_type() == at::kChar;
  TORCH_CHECK((int8_kv || q.scalar_type() == kv.scalar_type()) && out.scalar_type() == q.scalar_type(),
              "q, out and kv must share a dtype (or kv be int8 rows)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out must be contiguous along head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 [B]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_slots = kv.size(1), Hkv = kv.size(2);
  const int64_t R = int8_kv ? D + kScaleBytes : D;
  TORCH_CHECK(kv.size(3) == R, "kv rows of ", kv.size(3), " elements, ", R, " expected for q head_dim ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "q heads (", Hq, ") must be a multiple of kv heads (", Hkv, ")");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "block_tables/context_lens batch != ", B);
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  if (B == 0 || Hq == 0 || D == 0) return;

  // Bounds: every block a sequence reads must lie inside the arena (checked here, on the calling
  // thread, so the parallel loop cannot read out of bounds and never has to throw).
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_blocks = num_slots / block_size;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = cl[b];
    TORCH_CHECK(c >= 0 && c <= max_blocks * block_size, "context_lens[", b, "] = ", c,
                " does not fit block_tables of ", max_blocks, " blocks of ", block_size);
    for (int64_t j = 0, nb = (c + block_size - 1) / block_size; j < nb; ++j)
      TORCH_CHECK(bt[b * max_blocks + j] >= 0 && bt[b * max_blocks + j] < num_blocks, "block_tables[", b, ", ", j,
                  "] = ", bt[b * max_blocks + j], " is outside the arena's ", num_blocks, " blocks");
    max_ctx = std::max(max_ctx, c);
  }

  Args a;
  a.q = q.data_ptr();
  a.out = out.data_ptr();
  a.kv = kv.data_ptr();
  a.block_tables = bt;
  a.context_lens = cl;
  a.q_stride_b = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.o_stride_b = out.stride(0);
  a.o_stride_h = out.stride(1);
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.G = Hq / Hkv;
  a.D = D;
  a.R = R;
  a.block_size = block_size;
  a.max_blocks = max_blocks;
  a.num_slots = num_slots;
  a.scale = static_cast<float>(scale);

  switch (q.scalar_type()) {
    case at::kFloat: int8_kv ? run<float, int8_t>(a, B, max_ctx) : run<float>(a, B, max_ctx); break;
    case at::kBFloat16: int8_kv ? run<bf16, int8_t>(a, B, max_ctx) : run<bf16>(a, B, max_ctx); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

void write_kv_int8(at::Tensor kv, at::Tensor k, at::Tensor v, at::Tensor slot_mapping) {
  TORCH_CHECK(kv.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slot_mapping.device().is_cpu(),
              "write_kv_int8: all tensors must be on the CPU");
  TORCH_CHECK(kv.scalar_type() == at::kChar && kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(),
              "kv must be a contiguous int8 [2, num_slots, Hkv, D + 4]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be [n, Hkv, D] of one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must be contiguous along head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0), "slot_mapping must be a contiguous int64 [n]");
  const int64_t n = k.size(0), H = k.size(1), D = k.size(2), S = kv.size(1);
  TORCH_CHECK(kv.size(2) == H && kv.size(3) == D + 4, "kv rows must be [Hkv, D + 4] for k of [", H, ", ", D, "]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "slot_mapping[", t, "] = ", slots[t], " is outside the arena");
  int8_t* base = kv.data_ptr<int8_t>();
  const int64_t R = D + 4, plane = S * H * R;
  auto run = [&](auto* kp, auto* vp) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < H; ++h) {
        int8_t* dst = base + (slots[t] * H + h) * R;
        quantize_into(kp + t * k.stride(0) + h * k.stride(1), D, dst);
        quantize_into(vp + t * v.stride(0) + h * v.stride(1), D, dst + plane);
      }
  };
  switch (k.scalar_type()) {
    case at::kFloat: run(k.data_ptr<float>(), v.data_ptr<float>()); break;
    case at::kBFloat16: run(reinterpret_cast<const bf16*>(k.data_ptr()), reinterpret_cast<const bf16*>(v.data_ptr())); break;
    default: TORCH_CHECK(false, "write_kv_int8: unsupported dtype ", k.scalar_type());
  }
}

// Keys and values of `slots` out of an int8 arena, dequantized: out[p][t] = kv[p][slots[t]]'s
// values times their row's scale, computed in float32 and rounded once into out's dtype (bit for
// bit kernels/paged_attention.py dequantize_kv). A prefill chunk's attention (torch's SDPA) reads
// these; one pass instead of a gather and four torch operations over the rows.
void dequantize_slots(at::Tensor out, at::Tensor kv, at::Tensor slots) {
  TORCH_CHECK(out.device().is_cpu() && kv.device().is_cpu() && slots.device().is_cpu(),
              "dequantize_slots: all tensors must be on the CPU");
  TORCH_CHECK(kv.scalar_type() == at::kChar && kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(),
              "kv must be a contiguous int8 [2, num_slots, Hkv, D + 4]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous int64 [T]");
  const int64_t T = slots.size(0), S = kv.size(1), H = kv.size(2), R = kv.size(3), D = R - kScaleBytes;
  TORCH_CHECK(D > 0 && out.is_contiguous() && out.dim() == 4 && out.size(0) == 2 && out.size(1) == T &&
                  out.size(2) == H && out.size(3) == D,
              "out must be a contiguous [2, ", T, ", ", H, ", ", D, "]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "slots[", t, "] = ", sl[t], " is outside the arena");
  const int8_t* base = kv.data_ptr<int8_t>();
  auto run = [&](auto* dst) {
    using T_ = std::remove_pointer_t<decltype(dst)>;
    const int64_t rows = 2 * T * H;  // (plane, token, head), in out's order
    const int threads = rows * D < (int64_t(1) << 16) ? 1 : at::get_num_threads();
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = r / (T * H), t = (r / H) % T, h = r % H;
      const int8_t* row = base + ((p * S + sl[t]) * H + h) * R;
      const float sc = row_scale(row, D);
      T_* o = dst + r * D;
      int64_t i = 0;
#if MESHSERVE_AVX512
      const __m512 vs = _mm512_set1_ps(sc);
      for (; i + 16 <= D; i += 16) {
        const __m512 x = _mm512_mul_ps(load16(row + i), vs);
        if constexpr (std::is_same<T_, float>::value) _mm512_storeu_ps(o + i, x);
        else vec_math::store16(o + i, x);
      }
#endif
      for (; i < D; ++i) from_float(static_cast<float>(row[i]) * sc, o + i);
    }
  };
  switch (out.scalar_type()) {
    case at::kFloat: run(out.data_ptr<float>()); break;
    case at::kBFloat16: run(reinterpret_cast<bf16*>(out.data_ptr())); break;
    default: TORCH_CHECK(false, "dequantize_slots: unsupported dtype ", out.scalar_type());
  }
}


// A prefill chunk's attention (prefill_attention.h): q, out [L, Hq, D] bf16 (last axis contiguous),
// kv a bf16 or int8 arena, slots [T] the context's slot ids (T >= L; the last L are the chunk's
// own, already written). Query i sees keys [0, T - L + i].
bool prefill_available() { return MESHSERVE_PREFILL_BF16; }

void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor kv, at::Tensor slots, double scale) {
  TORCH_CHECK(prefill_available(), "paged_prefill_attention: built without AVX-512 BF16");
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && kv.device().is_cpu() && slots.device().is_cpu(),
              "paged_prefill_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: q and out must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [L, Hq, D] of one shape, contiguous along head_dim");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(), "kv must be a contiguous [2, num_slots, Hkv, row]");
  const bool int8_kv = kv.scalar_type() == at::kChar;
  TORCH_CHECK(int8_kv || kv.scalar_type() == at::kBFloat16, "kv must be bfloat16 or int8 rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous int64 [T]");
  const int64_t L = q.size(0), Hq = q.size(1), D = q.size(2), T = slots.size(0);
  const int64_t S = kv.size(1), Hkv = kv.size(2), R = int8_kv ? D + kScaleBytes : D;
  TORCH_CHECK(D == 32 || D == 64 || D == 128, "paged_prefill_attention: head_dim 32, 64 or 128, not ", D);
  TORCH_CHECK(kv.size(3) == R, "kv rows of ", kv.size(3), " elements, ", R, " expected for q head_dim ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "q heads (", Hq, ") must be a multiple of kv heads (", Hkv, ")");
  TORCH_CHECK(T >= L, "the context (", T, " slots) must hold the chunk's ", L, " tokens");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "slots[", t, "] = ", sl[t], " is outside the arena");
  if (L == 0 || Hq == 0) return;
#if MESHSERVE_PREFILL_BF16
  namespace pa = prefill_attention;
  pa::Args a{reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()), q.stride(0),
             q.stride(1), out.stride(0), out.stride(1), L, T, T - L, Hq, Hkv, Hq / Hkv, D, static_cast<float>(scale)};
  const int64_t T2 = (T + 1) / 2;
  std::vector<bf16> kc(Hkv * T * D), vp(Hkv * T2 * D * 2);
  const char* base = static_cast<const char*>(kv.data_ptr());
  const int64_t esize = int8_kv ? 1 : 2, plane = S * Hkv * R * esize;
  auto gather = [&](int64_t h, int64_t t2) {  // keys 2 t2 and 2 t2 + 1 of head h
    alignas(64) bf16 v0[128], v1[128];
    for (int64_t u = 0; u < 2; ++u) {
      const int64_t t = 2 * t2 + u;
      bf16* vr = u ? v1 : v0;
      if (t >= T) {
        std::fill(vr, vr + D, bf16());
        continue;
      }
      const char* row = base + (sl[t] * Hkv + h) * R * esize;
      if (int8_kv) {
        pa::row_to_bf16(reinterpret_cast<const int8_t*>(row), D, kc.data() + (h * T + t) * D);
        pa::row_to_bf16(reinterpret_cast<const int8_t*>(row + plane), D, vr);
      } else {
        pa::row_to_bf16(reinterpret_cast<const bf16*>(row), D, kc.data() + (h * T + t) * D);
        pa::row_to_bf16(reinterpret_cast<const bf16*>(row + plane), D, vr);
      }
    }
    pa::interleave_pair(v0, v1, D, vp.data() + (h * T2 + t2) * D * 2);
  };
  const int64_t tiles = (L + pa::kLanes - 1) / pa::kLanes, tasks = Hkv * tiles;
  int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  // A short chunk over a short context takes microseconds: a second thread's wake-up costs as much.
  if (L * T * Hq * D < (int64_t(1) << 18)) threads = 1;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < Hkv * T2; ++i) gather(i / T2, i % T2);
    pa::Scratch w;
    w.s.resize(T * a.G * pa::kLanes);
    w.pp.resize(T2 * a.G * pa::kLanes);
    w.inv.resize(a.G * pa::kLanes);
    w.mx.resize(a.G);
    // The last tiles of the chunk see the most keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t h = task % Hkv, tile = tiles - 1 - task / Hkv;
      const bf16* k = kc.data() + h * T * D;
      const bf16* v = vp.data() + h * T2 * D * 2;
      switch (D) {
        case 32: pa::attend_task<2>(a, h, tile * pa::kLanes, k, v, w); break;
        case 64: pa::attend_task<4>(a, h, tile * pa::kLanes, k, v, w); break;
        default: pa::attend_task<8>(a, h, tile * pa::kLanes, k, v, w); break;
      }
    }
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_int8", &write_kv_int8, "Quantizes new K/V rows into an int8 paged arena (CPU)", py::arg("kv"),
        py::arg("k"), py::arg("v"), py::arg("slot_mapping"));
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache, reading K/V through the block tables (CPU)",
        py::arg("out"), py::arg("q"), py::arg("kv"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"));
  m.def("prefill_available", &prefill_available, "whether the AVX-512 BF16 prefill path was compiled in");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "A prefill chunk's causal attention over its context slots of a paged KV cache (CPU, bf16)",
        py::arg("out"), py::arg("q"), py::arg("kv"), py::arg("slots"), py::arg("scale"));
  m.def("dequantize_slots", &dequantize_slots, "K/V rows of the given slots out of an int8 arena, dequantized (CPU)",
        py::arg("out"), py::arg("kv"), py::arg("slots"));
}
