// The CUDA backend's paged KV cache kernels. kernels/cuda_ops.py compiles this file at first use
// (CuPy, NVRTC) and launches them on torch's current stream; kernels/paged_attention.py is their
// oracle (the same metadata, computed with torch).
//
//   write_kv             stores this step's new K/V rows into their arena slots
//   write_kv_int8        the same into an int8 arena (--kv-cache-dtype int8), quantizing each row
//   paged_decode         decode attention (one query token per sequence) read through block tables
//   paged_decode_reduce  merges the partial results of a context split over several blocks
//   copy_blocks          copies whole KV blocks between or within arenas (block copy, swap to host)
//   linear_int8          int8 weights (--quantization int8): y = x @ (q * scale).T for a few rows
//   dequantize_int8      q * scale in the model's dtype, for steps of many rows (then torch's GEMM)
//
// No #include: bf16 travels as its raw 16 bits and is converted by hand, so NVRTC needs no CUDA
// headers, nvcc compiles the file as it is, and the tests also build it as plain C++ on a CPU
// (tests/test_cuda_kernels.py emulates the few CUDA built-ins used here).
//
// Layout of one layer's arena, strides in elements: K of (slot, kv head) starts at
// k_cache + slot * slot_stride + head * head_stride (V likewise), head_dim elements contiguous;
// slot = block_tables[seq][pos / block_size] * block_size + pos % block_size. An int8 arena's row
// is head_dim int8 values then the 4 bytes of their float32 scale (value = q * scale;
// kernels/paged_attention.py quantize_kv is the format's reference): a row's scale multiplies its
// score (keys) or its softmax weight (values), never its elements.

struct bf16_bits {
  unsigned short bits;
};

// 16 bytes read or written by one instruction.
struct alignas(16) word16 {
  unsigned int w[4];
};

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
// Query heads one block serves (all share one KV head, so K/V are read once for them); a larger
// group is split over grid.y. Bounds the registers: the queries and accumulators live there.
#define MAX_GROUP 4
#define DECODE_THREADS 128

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_bits x) { return __uint_as_float((unsigned int)x.bits << 16); }
__device__ __forceinline__ float to_float(signed char x) { return (float)x; }

// The scale of a KV row that starts at `row` (head_dim elements): 1 for float rows; for int8 rows
// the float32 after the values (read byte by byte: a row is only 4-byte aligned when head_dim is).
template <typename KV>
__device__ __forceinline__ float row_scale(const KV*, int) { return 1.f; }
__device__ __forceinline__ float row_scale(const signed char* row, int head_dim) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(row + head_dim);
  return __uint_as_float((unsigned int)b[0] | ((unsigned int)b[1] << 8) | ((unsigned int)b[2] << 16) |
                         ((unsigned int)b[3] << 24));
}

__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(bf16_bits* p, float x) {
  const unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p->bits = (unsigned short)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  } else {
    p->bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // nearest even, as torch rounds
  }
}

// The elements packed in one 32-bit word, as floats (little-endian: the first element is the low half).
__device__ __forceinline__ void unpack(unsigned int w, float* out, const float*) { out[0] = __uint_as_float(w); }
__device__ __forceinline__ void unpack(unsigned int w, float* out, const bf16_bits*) {
  out[0] = __uint_as_float(w << 16);
  out[1] = __uint_as_float(w & 0xffff0000u);
}

// EPL consecutive elements from p as floats, of which the first `valid` exist (the rest read as 0).
// `vec`: p is 16-byte aligned and the slice is whole, so it is read in 16-byte words.
template <typename T, int EPL>
__device__ __forceinline__ void load_floats(const T* __restrict__ p, float (&out)[EPL], int valid, bool vec) {
  static_assert((EPL * sizeof(T)) % 16 == 0, "a lane's slice is whole 16-byte words");
  if (vec && valid == EPL) {
    constexpr int PER_WORD = 4 / sizeof(T);
    const word16* wp = reinterpret_cast<const word16*>(p);
#pragma unroll
    for (int i = 0; i < EPL * (int)sizeof(T) / 16; ++i) {
      const word16 w = wp[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) unpack(w.w[j], out + (i * 4 + j) * PER_WORD, p);
    }
  } else {
#pragma unroll
    for (int j = 0; j < EPL; ++j) out[j] = j < valid ? to_float(p[j]) : 0.f;
  }
}

// int8 rows: EPL values from p; `vec`: p is 4-byte aligned, so it is read in 32-bit words.
template <int EPL>
__device__ __forceinline__ void load_floats(const signed char* __restrict__ p, float (&out)[EPL], int valid,
                                            bool vec) {
  static_assert(EPL % 4 == 0, "a lane's slice is whole 32-bit words");
  if (vec && valid == EPL) {
    const unsigned int* wp = reinterpret_cast<const unsigned int*>(p);
#pragma unroll
    for (int i = 0; i < EPL / 4; ++i) {
      const unsigned int w = wp[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) out[i * 4 + j] = (float)(signed char)((w >> (8 * j)) & 0xffu);
    }
  } else {
#pragma unroll
    for (int j = 0; j < EPL; ++j) out[j] = j < valid ? (float)p[j] : 0.f;
  }
}

// exp(m - m_new), with an empty state (m = -inf) weighing nothing, even against another empty one.
__device__ __forceinline__ float rescale(float m, float m_new) { return m == neg_inf() ? 0.f : expf(m - m_new); }

// One block per token; a token's [kv_heads * head_dim] row is contiguous in k, v and the arena.
// A negative slot is a padding token and is skipped.
template <typename T>
__global__ void write_kv(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ k,
                         const T* __restrict__ v, const long long* __restrict__ slot_mapping,
                         long long k_token_stride, long long v_token_stride, long long cache_slot_stride,
                         int row_elems) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  T* kd = k_cache + slot * cache_slot_stride;
  T* vd = v_cache + slot * cache_slot_stride;
  const T* ks = k + (long long)blockIdx.x * k_token_stride;
  const T* vs = v + (long long)blockIdx.x * v_token_stride;
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

// grid (token, kv head), one warp: the row's max |x| reduced over the warp, s = max / 127, each
// value round-half-even(x / s) (x / 1 for an all-zero row), clamped to +-127, then s's 4 bytes:
// quantize_kv's bits (float32 division, as torch's). k, v: [tokens][kv heads][head_dim] of T.
template <typename T>
__global__ void write_kv_int8(signed char* __restrict__ k_cache, signed char* __restrict__ v_cache,
                              const T* __restrict__ k, const T* __restrict__ v,
                              const long long* __restrict__ slot_mapping, long long k_token_stride,
                              long long v_token_stride, long long cache_slot_stride, int head_dim) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int head = blockIdx.y, lane = threadIdx.x;
  const long long row_bytes = head_dim + 4;
  for (int plane = 0; plane < 2; ++plane) {
    const T* x = (plane ? v + blockIdx.x * v_token_stride : k + blockIdx.x * k_token_stride) + head * head_dim;
    signed char* dst = (plane ? v_cache : k_cache) + slot * cache_slot_stride + head * row_bytes;
    float m = 0.f;
    for (int i = lane; i < head_dim; i += WARP_SIZE) m = fmaxf(m, fabsf(to_float(x[i])));
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    const float s = m / 127.f;
    const float div = s > 0.f ? s : 1.f;
    for (int i = lane; i < head_dim; i += WARP_SIZE) {
      const float r = rintf(to_float(x[i]) / div);
      dst[i] = (signed char)fminf(127.f, fmaxf(-127.f, r));
    }
    if (lane < 4) dst[head_dim + lane] = (signed char)((__float_as_uint(s) >> (8 * lane)) & 0xffu);
  }
}

// Decode attention over a paged KV cache, one query token per sequence.
//
// grid (sequence, kv head x query-head chunk, partition of the context), DECODE_THREADS threads.
// Each block serves up to MAX_GROUP query heads that share one KV head, so every K/V row it reads
// serves all of them. A warp reads 32 / lanes_per_token tokens at once: lanes_per_token lanes
// cover one token's head_dim, EPL elements each (16-byte loads), and each such lane group keeps
// its own online-softmax state (running max, sum, weighted V) in fp32. States are merged across
// the lane groups of a warp (shuffles), then across warps (shared memory).
//
// T: q and out; KV: the arena's element, T or signed char (int8 rows, their scale applied to the
// score and to the softmax weight).
//
// One partition (gridDim.z == 1): the result goes to `out`. Several (a long context and too few
// blocks to fill the GPU otherwise): each writes [head_dim outputs, max, sum] to `partial`
// ([seq][q_head][partition][head_dim + 2]) and paged_decode_reduce merges them.
template <typename T, typename KV, int EPL>
__global__ void __launch_bounds__(DECODE_THREADS)
paged_decode(T* __restrict__ out, float* __restrict__ partial, const T* __restrict__ q,
             const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
             const long long* __restrict__ block_tables, const long long* __restrict__ context_lens,
             long long q_seq_stride, long long q_head_stride, long long out_seq_stride,
             long long cache_slot_stride, long long cache_head_stride, long long table_stride,
             int q_heads, int group, int head_dim, int block_size, int partition_size, int lanes_per_token,
             int vec, float scale) {
  const int seq = blockIdx.x;
  const int chunks = (group + MAX_GROUP - 1) / MAX_GROUP;
  const int kv_head = blockIdx.y / chunks;
  const int g0 = (blockIdx.y % chunks) * MAX_GROUP;
  const int gn = min(MAX_GROUP, group - g0);  // query heads of this block
  const int head0 = kv_head * group + g0;     // the first one among all query heads
  const int ctx = (int)context_lens[seq];
  const int start = blockIdx.z * partition_size;
  if (start >= ctx) return;  // a partition past this sequence's context (the reduce skips it too)
  const int end = min(ctx, start + partition_size);

  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int nwarps = blockDim.x / WARP_SIZE;
  const int tpt = lanes_per_token, per_warp = WARP_SIZE / tpt;
  const int sub = lane % tpt;  // which EPL-wide slice of head_dim this lane reads
  const int tok = lane / tpt;  // which of the warp's tokens it reads
  const int d0 = sub * EPL;
  const int valid = max(0, min(EPL, head_dim - d0));  // lanes past head_dim (padding) hold nothing

  float qr[MAX_GROUP][EPL];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g) {
    if (g < gn) {
      load_floats(q + seq * q_seq_stride + (head0 + g) * q_head_stride + d0, qr[g], valid, vec);
#pragma unroll
      for (int j = 0; j < EPL; ++j) qr[g][j] *= scale;  // scaled once, not per token
    }
  }

  float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][EPL];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < EPL; ++j) acc[g][j] = 0.f;
  }

  const long long* table = block_tables + seq * table_stride;
  const long long head_off = kv_head * cache_head_stride;
  // The loop bounds are the same for the whole warp (shuffles need every lane); a lane whose
  // token is past the end reads nothing and keeps its state.
  for (int base = start + warp * per_warp; base < end; base += nwarps * per_warp) {
    const int t = base + tok;
    const bool active = t < end;
    float kf[EPL], vf[EPL], ks = 1.f, vs = 1.f;
    if (active) {
      const long long slot = table[t / block_size] * block_size + t % block_size;
      const KV* kr = k_cache + slot * cache_slot_stride + head_off;
      const KV* vr = v_cache + slot * cache_slot_stride + head_off;
      load_floats(kr + d0, kf, valid, vec);
      load_floats(vr + d0, vf, valid, vec);
      ks = row_scale(kr, head_dim);
      vs = row_scale(vr, head_dim);
    } else {
#pragma unroll
      for (int j = 0; j < EPL; ++j) kf[j] = vf[j] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g < gn) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; ++j) s += qr[g][j] * kf[j];
        for (int off = tpt / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
        if (active) {
          s *= ks;
          const float m_new = fmaxf(m[g], s);
          const float c = rescale(m[g], m_new), p = expf(s - m_new), pv = p * vs;
          l[g] = l[g] * c + p;
#pragma unroll
          for (int j = 0; j < EPL; ++j) acc[g][j] = acc[g][j] * c + pv * vf[j];
          m[g] = m_new;
        }
      }
    }
  }

  // Merge the states of the warp's lane groups: lanes with the same slice, different tokens.
  for (int off = tpt; off < WARP_SIZE; off <<= 1) {
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g < gn) {
        const float mo = __shfl_xor_sync(FULL_MASK, m[g], off);
        const float lo = __shfl_xor_sync(FULL_MASK, l[g], off);
        const float mn = fmaxf(m[g], mo);
        const float a = rescale(m[g], mn), b = rescale(mo, mn);
        l[g] = l[g] * a + lo * b;
#pragma unroll
        for (int j = 0; j < EPL; ++j) acc[g][j] = acc[g][j] * a + __shfl_xor_sync(FULL_MASK, acc[g][j], off) * b;
        m[g] = mn;
      }
    }
  }

  // Then across warps, through shared memory: [nwarps][MAX_GROUP][max, sum], then [nwarps][MAX_GROUP][head_dim].
  extern __shared__ float smem[];
  float* sm_ml = smem;
  float* sm_acc = smem + nwarps * MAX_GROUP * 2;
  if (tok == 0) {
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g < gn) {
        const int w = warp * MAX_GROUP + g;
        if (sub == 0) {
          sm_ml[w * 2] = m[g];
          sm_ml[w * 2 + 1] = l[g];
        }
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
          if (j < valid) sm_acc[w * head_dim + d0 + j] = acc[g][j];
        }
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < gn * head_dim; idx += blockDim.x) {
    const int g = idx / head_dim, i = idx % head_dim;
    float mx = neg_inf();
    for (int w = 0; w < nwarps; ++w) mx = fmaxf(mx, sm_ml[(w * MAX_GROUP + g) * 2]);
    float sum = 0.f, a = 0.f;
    for (int w = 0; w < nwarps; ++w) {
      const int s = w * MAX_GROUP + g;
      const float c = rescale(sm_ml[s * 2], mx);
      sum += sm_ml[s * 2 + 1] * c;
      a += sm_acc[s * head_dim + i] * c;
    }
    const int head = head0 + g;
    if (gridDim.z == 1) {
      store(out + seq * out_seq_stride + head * head_dim + i, a / sum);
    } else {
      float* pp = partial + (((long long)seq * q_heads + head) * gridDim.z + blockIdx.z) * (head_dim + 2);
      pp[i] = a / sum;
      if (i == 0) {
        pp[head_dim] = mx;
        pp[head_dim + 1] = sum;
      }
    }
  }
}

// grid (sequence, query head): merges the partitions paged_decode wrote for that head, each
// weighted by its softmax sum rescaled to the common max.
template <typename T>
__global__ void paged_decode_reduce(T* __restrict__ out, const float* __restrict__ partial,
                                    const long long* __restrict__ context_lens, long long out_seq_stride,
                                    int q_heads, int head_dim, int partitions, int partition_size) {
  const int seq = blockIdx.x, head = blockIdx.y;
  const int ctx = (int)context_lens[seq];
  const int used = min(partitions, (ctx + partition_size - 1) / partition_size);
  const float* pp = partial + ((long long)seq * q_heads + head) * partitions * (head_dim + 2);
  float mx = neg_inf();
  for (int p = 0; p < used; ++p) mx = fmaxf(mx, pp[p * (head_dim + 2) + head_dim]);
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int p = 0; p < used; ++p) {
      const float* r = pp + p * (head_dim + 2);
      const float w = r[head_dim + 1] * rescale(r[head_dim], mx);
      num += w * r[i];
      den += w;
    }
    store(out + seq * out_seq_stride + head * head_dim + i, num / den);
  }
}

// grid (pair, chunk): copies block pairs[2p] of `src` to block pairs[2p + 1] of `dst`, in every
// chunk (a chunk is one layer's K or V: an arena [layers, 2, slots, ...] has 2 x layers of them).
// Byte strides, so it is blind to dtype and shape; U is the unit one thread moves (16, 4 or 1
// bytes, the widest the alignment allows). Either side may be pinned host memory mapped into
// the device's address space (swap), or the same arena (copy-on-write); a destination block
// must not also be a source in the same call.
template <typename U>
__global__ void copy_blocks(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                            const long long* __restrict__ pairs, long long src_chunk_stride,
                            long long dst_chunk_stride, long long src_block_stride, long long dst_block_stride,
                            long long block_bytes) {
  const long long s = pairs[2 * blockIdx.x], d = pairs[2 * blockIdx.x + 1];
  const U* from = reinterpret_cast<const U*>(src + blockIdx.y * src_chunk_stride + s * src_block_stride);
  U* to = reinterpret_cast<U*>(dst + blockIdx.y * dst_chunk_stride + d * dst_block_stride);
  const long long n = block_bytes / (long long)sizeof(U);
  for (long long i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

// Weight-only int8 projections for steps of at most INT8_GEMV_ROWS rows (decodes): out[m, n] =
// scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]), summed in float32. Such a step is bound by
// reading the weights, so each int8 row of q is read once, by one warp (16 values a lane, in 32-bit
// words when `vec`: K and q 4-byte aligned), against every x row (read from cache); the lanes'
// sums meet by shuffles. grid-stride over the output columns, a warp per column.
#define INT8_GEMV_ROWS 8
template <typename T>
__global__ void __launch_bounds__(128)
linear_int8(T* __restrict__ out, const T* __restrict__ x, const signed char* __restrict__ q,
            const float* __restrict__ scale, const T* __restrict__ bias, int rows, int n_out, int k_in,
            long long x_stride, long long out_stride, int vec, int x_vec) {
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int nwarps = blockDim.x / WARP_SIZE;
  for (int n = blockIdx.x * nwarps + warp; n < n_out; n += gridDim.x * nwarps) {
    float acc[INT8_GEMV_ROWS];
#pragma unroll
    for (int m = 0; m < INT8_GEMV_ROWS; ++m) acc[m] = 0.f;
    const signed char* qr = q + (long long)n * k_in;
    for (int k0 = lane * 16; k0 < k_in; k0 += WARP_SIZE * 16) {
      const int valid = min(16, k_in - k0);
      float w[16];
      load_floats(qr + k0, w, valid, vec);
#pragma unroll
      for (int m = 0; m < INT8_GEMV_ROWS; ++m) {
        if (m < rows) {
          float xs[16];
          load_floats(x + m * x_stride + k0, xs, valid, x_vec);
          float s = 0.f;
#pragma unroll
          for (int j = 0; j < 16; ++j) s += xs[j] * w[j];
          acc[m] += s;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < INT8_GEMV_ROWS; ++m) {
      if (m < rows) {
        float s = acc[m];
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
        if (lane == 0) store(out + m * out_stride + n, s * scale[n] + (bias ? to_float(bias[n]) : 0.f));
      }
    }
  }
}

// w[n, k] = q[n, k] * scale[n] rounded once into T: kernels/int8_linear.py dequantize's bits.
template <typename T>
__global__ void dequantize_int8(T* __restrict__ w, const signed char* __restrict__ q, const float* __restrict__ scale,
                                long long elems, int k_in) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < elems; i += (long long)gridDim.x * blockDim.x)
    store(w + i, (float)q[i] * scale[i / k_in]);
}
