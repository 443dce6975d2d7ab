"""The CUDA backend against its oracles: kernels/cuda/paged_attention.cu through kernels/cuda_ops.py,
the engine on a GPU, and CUDA IPC (shared/cuda_ipc.py).

Without a GPU (CI, the development machines) what can run here does:
- the source defines every kernel cuda_ops launches, includes nothing, and compiles with nvcc
  for sm_90 where nvcc is installed;
- the kernels run on the CPU: the .cu built as plain C++ with a small emulation of the CUDA
  built-ins it uses (each CUDA thread a fiber; __syncthreads and warp shuffles are barriers;
  shuffles checked for divergence), launched through cuda_ops' own wrappers, so the argument
  marshalling, the launch plans and the kernel code are all checked against the torch reference,
  and the whole engine runs on them against Transformers;
- dispatch leaves CPU arenas on the CPU path, and cuda_ops imports without CuPy.
On a GPU with CuPy: every kernel against the CPU reference (fp32 and bf16; block sizes 8/16/32;
GQA groups 1/3/4; head_dim 64/128; shuffled block tables; contexts 1..600), copy_blocks within the
GPU and to and from pinned host memory, CUDA IPC between two processes (the child's write is seen
by the parent: no copy), and the engine on CUDA against Transformers on CUDA (fp32 greedy, prefix
caching, preemption), in bf16, and with seeded sampling.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from oracle import hf_greedy

from meshserve.kernels import cuda_ops
from meshserve.kernels import paged_attention as pa
from meshserve.kernels.paged_attention import AttentionMetadata, PrefillChunk, decode_slots_and_mask
from meshserve.shared import cuda_ipc
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir


def _gpu_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    return None


GPU_MISSING = _gpu_missing()
gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=f"needs a CUDA GPU and CuPy: {GPU_MISSING}")
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# --- the CPU emulation of the CUDA built-ins the kernels use (tests only)

EMU_PREAMBLE = r'''
// A CPU emulation of the few CUDA built-ins kernels/cuda/paged_attention.cu uses: each CUDA thread
// is a fiber (ucontext); __syncthreads and warp shuffles are barriers between fibers; the blocks
// of a grid run one after another. Strict where it is cheap: a shuffle must be reached by all 32
// lanes from the same source line, shared memory is capped at 48 KiB, a deadlock is reported.
#include <ucontext.h>
#include <math.h>
#include <string.h>
#include <stdint.h>
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>
using std::max;
using std::min;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

struct emu_dim3 { unsigned int x, y, z; };

namespace emu {
struct Fiber {
  ucontext_t ctx;
  emu_dim3 tid;
  bool done;
  const int* wait_gen;  // blocked until *wait_gen != wait_val
  int wait_val;
  int parity;           // which of the two shuffle buffers the next shuffle uses
  std::vector<char> stack;
};
struct Barrier { int count = 0, gen = 0; };

static ucontext_t sched;
static Fiber* cur = nullptr;
static std::vector<Fiber> fibers;
static emu_dim3 grid_dim, block_idx, block_dim;
static Barrier block_bar;
static Barrier warp_bar[32];
static int alive_block, alive_warp[32];
static float shfl_val[32][2][32];
static int shfl_line[32][2][32];
static std::string error;
static std::function<void()> body;

static void fail(const std::string& what) {
  if (error.empty()) error = what;
}
static void wait_change(const int* gen, int val) {
  cur->wait_gen = gen;
  cur->wait_val = val;
  swapcontext(&cur->ctx, &sched);
}
static void arrive(Barrier& b, int participants) {
  const int my = b.gen;
  if (++b.count >= participants) { b.count = 0; b.gen++; return; }
  wait_change(&b.gen, my);
}
static void release_if_complete(Barrier& b, int participants) {
  if (b.count > 0 && b.count >= participants) { b.count = 0; b.gen++; }
}
static int linear_tid() { return cur->tid.x + block_dim.x * (cur->tid.y + block_dim.y * cur->tid.z); }
static void trampoline() {
  body();
  cur->done = true;
  const int w = linear_tid() / 32;
  alive_block--;
  alive_warp[w]--;
  release_if_complete(block_bar, alive_block);
  release_if_complete(warp_bar[w], alive_warp[w]);
}
}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

extern float smem[];
alignas(16) float smem[48 * 1024 / sizeof(float)];

inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int x; memcpy(&x, &f, 4); return x; }

inline void __syncthreads() { emu::arrive(emu::block_bar, emu::alive_block); }

inline float __shfl_xor_sync(unsigned int mask, float v, int lane_mask, int line = __builtin_LINE()) {
  using namespace emu;
  const int t = linear_tid(), w = t / 32, lane = t % 32;
  if (mask != 0xffffffffu) fail("__shfl_xor_sync: only the full mask is emulated");
  if (alive_warp[w] != 32) fail("__shfl_xor_sync with exited lanes in the warp");
  const int p = cur->parity;
  cur->parity ^= 1;
  shfl_val[w][p][lane] = v;
  shfl_line[w][p][lane] = line;
  arrive(warp_bar[w], alive_warp[w]);
  const int src = lane ^ lane_mask;
  if (shfl_line[w][p][src] != line) fail("divergent __shfl_xor_sync: lanes " + std::to_string(lane) + " and " +
                                         std::to_string(src) + " at lines " + std::to_string(line) + " and " +
                                         std::to_string(shfl_line[w][p][src]));
  return shfl_val[w][p][src];
}
'''

EMU_LAUNCH = r'''
namespace emu {
struct Kernel { std::function<void(void**)> call; std::vector<long long> sizes; };
static std::map<std::string, Kernel>& registry() { static std::map<std::string, Kernel> r; return r; }
template <typename... A, size_t... I>
static void invoke(void (*fn)(A...), void** a, std::index_sequence<I...>) { fn(*static_cast<A*>(a[I])...); }
template <typename... A>
static int add(const char* name, void (*fn)(A...)) {
  registry()[name] = Kernel{[fn](void** a) { invoke(fn, a, std::index_sequence_for<A...>{}); }, {(long long)sizeof(A)...}};
  return 0;
}
}  // namespace emu

extern "C" int emu_param_sizes(const char* name, long long* out, int cap) {
  auto it = emu::registry().find(name);
  if (it == emu::registry().end()) return -1;
  const auto& s = it->second.sizes;
  for (size_t i = 0; i < s.size() && (int)i < cap; ++i) out[i] = s[i];
  return (int)s.size();
}

// Runs a whole grid; returns 0, or -1 with a message in err.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, long long shared_mem, void** args, char* err, int errlen) {
  using namespace emu;
  error.clear();
  auto it = registry().find(name);
  const unsigned threads = bx * by * bz;
  if (it == registry().end()) error = std::string("no kernel ") + name;
  else if (threads == 0 || threads > 1024 || threads % 32) error = "block size must be a multiple of 32, at most 1024";
  else if (gy > 65535 || gz > 65535 || gx == 0 || gy == 0 || gz == 0) error = "bad grid";
  else if (shared_mem > (long long)sizeof(smem)) error = "more than 48 KiB of dynamic shared memory";
  if (!error.empty()) { snprintf(err, errlen, "%s", error.c_str()); return -1; }
  grid_dim = {gx, gy, gz};
  block_dim = {bx, by, bz};
  fibers.resize(threads);
  for (auto& f : fibers) if (f.stack.size() < (1 << 16)) f.stack.resize(1 << 16);
  body = [&]() { it->second.call(args); };
  for (unsigned z = 0; z < gz && error.empty(); ++z)
    for (unsigned y = 0; y < gy && error.empty(); ++y)
      for (unsigned x = 0; x < gx && error.empty(); ++x) {
        block_idx = {x, y, z};
        memset(smem, 0xff, shared_mem > 0 ? shared_mem : 0);  // NaN garbage: reading unwritten shared memory shows
        block_bar = Barrier();
        alive_block = threads;
        for (int w = 0; w < 32; ++w) { warp_bar[w] = Barrier(); alive_warp[w] = 0; }
        for (unsigned i = 0; i < threads; ++i) {
          Fiber& f = fibers[i];
          f.tid = {i % bx, (i / bx) % by, i / (bx * by)};
          f.done = false;
          f.wait_gen = nullptr;
          f.parity = 0;
          alive_warp[i / 32]++;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &sched;
          makecontext(&f.ctx, trampoline, 0);
        }
        for (int live = threads; live > 0 && error.empty();) {
          bool ran = false;
          live = 0;
          for (auto& f : fibers) {
            if (f.done) continue;
            live++;
            if (f.wait_gen && *f.wait_gen == f.wait_val) continue;
            f.wait_gen = nullptr;
            cur = &f;
            swapcontext(&sched, &f.ctx);
            ran = true;
          }
          if (live && !ran) error = "deadlock: every thread waits at a barrier";
        }
      }
  if (!error.empty()) { snprintf(err, errlen, "%s", error.c_str()); return -1; }
  return 0;
}
'''


class EmuBackend:
    """cuda_ops' backend interface over the emulation: "device" memory is the CPU's, launches run
    the grid block by block. Arguments are packed as cuLaunchKernel gets them, and each one's size
    must be its parameter's (a float passed as a double, an int as a long long, is an error)."""

    device_type = "cpu"

    def __init__(self, lib):
        self.lib, self.sms = lib, 8

    def available(self) -> bool:
        return True

    def sm_count(self, device) -> int:
        return self.sms

    def host_pointer(self, t: torch.Tensor) -> int:
        return t.data_ptr()

    def launch(self, name, grid, block, args, shared_mem, device) -> None:
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        sizes = (ctypes.c_longlong * 64)()
        n = self.lib.emu_param_sizes(name.encode(), sizes, 64)
        assert n == len(args), f"{name}: {len(args)} arguments for {n} parameters"
        cells = []
        for i, (a, size) in enumerate(zip(args, sizes[:n])):
            if isinstance(a, np.generic):
                assert a.itemsize == size, f"{name}: argument {i} is {a.dtype}, the parameter {size} bytes"
                cells.append((ctypes.c_char * a.itemsize).from_buffer_copy(a.tobytes()))
            else:  # a pointer (CuPy passes a Python int as a 64-bit integer)
                assert type(a) is int and size == 8, f"{name}: argument {i} ({a!r}) for a {size}-byte parameter"
                cells.append(ctypes.c_int64(a))
        argv = (ctypes.c_void_p * n)(*[ctypes.addressof(c) for c in cells])
        err = ctypes.create_string_buffer(512)
        if self.lib.emu_launch(name.encode(), *grid, *block, shared_mem, argv, err, 512):
            raise RuntimeError(f"{name}: {err.value.decode()}")


@pytest.fixture(scope="session")
def emu_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the CPU emulation of the CUDA kernels")
    d = tmp_path_factory.mktemp("cuda-emu")
    src, lib = d / "emu.cpp", d / "emu.so"
    registrations = " + ".join(f'emu::add("{n}", &{n})' for n in cuda_ops.NAME_EXPRESSIONS)
    src.write_text(EMU_PREAMBLE + f'#include "{cuda_ops.SOURCE}"\n' + EMU_LAUNCH
                   + f"static int registered = ({registrations});\n")
    r = subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-w", "-o", str(lib),
                        str(src)], capture_output=True, text=True)
    assert r.returncode == 0, f"the emulation build failed:\n{r.stderr[-4000:]}"
    lib = ctypes.CDLL(str(lib))
    lib.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.c_longlong, ctypes.c_void_p,
                                                                          ctypes.c_char_p, ctypes.c_int]
    lib.emu_param_sizes.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
    return lib


@pytest.fixture
def emu(emu_lib, monkeypatch) -> EmuBackend:
    """cuda_ops with its kernels running on the CPU emulation (CPU tensors stand for device memory)."""
    backend = EmuBackend(emu_lib)
    monkeypatch.setattr(cuda_ops, "_backend", backend)
    return backend


@pytest.fixture(scope="module")
def cuda():
    """The real backend on a GPU; its compile error (NVRTC's log) fails here, not as a skip."""
    if GPU_MISSING is not None:
        pytest.skip(f"needs a CUDA GPU and CuPy: {GPU_MISSING}")
    cuda_ops._backend.kernels()
    assert cuda_ops.available()
    return torch.device("cuda")


# --- cases and the reference


def make_case(ctx_lens, hkv, group, d, block_size, dtype, seed=0, q_offset=0):
    """A random arena and, per sequence, a shuffled set of distinct blocks (padding: random ids).
    q_offset > 0 makes q a view that starts off 16-byte alignment (the kernel's scalar-load path)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 7  # some blocks belong to nobody
    kv = torch.randn(2, num_blocks * block_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(0, num_blocks, (len(ctx_lens), max(need) + 2), generator=g)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(len(ctx_lens), hkv * group * d + q_offset, generator=g).to(dtype)
    q = q[:, q_offset:].view(len(ctx_lens), hkv * group, d)
    return q, kv, table, torch.tensor(ctx_lens, dtype=torch.long)


def reference(q, kv, table, ctx, block_size, scale):
    """paged_attention()'s gather + SDPA path on the CPU, in fp32: [seqs, q_heads * head_dim]."""
    q, kv, table, ctx = q.float().cpu(), kv.float().cpu(), table.cpu(), ctx.cpu()
    slots, mask = decode_slots_and_mask(table, ctx, block_size)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(ctx),
                             decode_slots=slots, decode_mask=mask)
    return pa.paged_attention(q.contiguous(), None, None, kv, meta, scale)


def run_decode(q, kv, table, ctx, block_size, scale):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cuda_ops.paged_decode_attention(out, q, kv, table, ctx, block_size, scale)
    return out.reshape(q.shape[0], -1)


def check_decode(q, kv, table, ctx, block_size, dtype, msg=""):
    scale = q.shape[-1] ** -0.5
    got = run_decode(q, kv, table, ctx, block_size, scale)
    want = reference(q, kv, table, ctx, block_size, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL[dtype], rtol=0,
                               msg=lambda m: f"{msg} context lengths {ctx.tolist()}: {m}")


# --- the source, and what runs without a GPU


def test_source_defines_the_launched_kernels_and_includes_nothing():
    src = cuda_ops.SOURCE.read_text()
    assert not re.search(r"^\s*#\s*include", src, re.M), "NVRTC (CuPy) builds this without CUDA headers"
    defined = set(re.findall(r"template\s*<[^>]*>\s*__global__\s+void\s+(?:__launch_bounds__\(\w+\)\s*)?(\w+)\s*\(",
                             src))
    assert defined == {"write_kv", "write_kv_int8", "paged_decode", "paged_decode_reduce", "copy_blocks",
                       "linear_int8", "dequantize_int8"}
    assert {n.split("<")[0] for n in cuda_ops.NAME_EXPRESSIONS} == defined
    for const in ("DECODE_THREADS", "MAX_GROUP"):  # the wrapper's copies of the kernel's constants
        assert re.search(rf"#define {const} {getattr(cuda_ops, const)}\b", src), const


def test_nvcc_compiles_the_source_for_hopper(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    refs = ", ".join(f"(void*)&{n}" for n in cuda_ops.NAME_EXPRESSIONS)
    src = tmp_path / "kernels.cu"  # the source, plus a host function that instantiates every kernel
    src.write_text(cuda_ops.SOURCE.read_text() + f"\nvoid* instantiate_all[] = {{{refs}}};\n")
    r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "error" not in r.stderr.lower()
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    assert spills and all(s == "0" for s in spills), r.stderr


def test_import_needs_no_cupy_and_cpu_arenas_stay_on_the_cpu_path():
    code = ("import sys; import meshserve.kernels.cuda_ops, meshserve.kernels.paged_attention, "
            "meshserve.shared.cuda_ipc; assert 'cupy' not in sys.modules, 'imported cupy'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kv = torch.zeros(2, 64, 2, 16)
    assert not cuda_ops.handles(kv)
    assert pa.decode_kernel(kv) is not cuda_ops
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_ipc.export(kv)
    with pytest.raises(ValueError, match="kind"):
        cuda_ipc.open({"kind": "nope", "dtype": "float32", "shape": [1], "strides": [1]})


def test_decode_plan():
    bf16 = torch.bfloat16
    p = cuda_ops.decode_plan(64, 9, 3, 64, 1024, bf16, sms=132)  # SmolLM2, 64 sequences
    assert (p["epl"], p["tpt"], p["group"]) == (8, 8, 3)
    assert p["grid"][:2] == (64, 3) and p["partitions"] == 2  # 192 blocks leave SMs idle: split in two
    assert cuda_ops.decode_plan(256, 9, 3, 64, 1024, bf16, sms=132)["partitions"] == 1
    one = cuda_ops.decode_plan(1, 9, 3, 64, 4096, bf16, sms=132)
    assert one["partitions"] == 16 and one["partition_size"] == 256  # batch 1: many pieces, none tiny
    assert cuda_ops.decode_plan(1, 9, 3, 64, 100, bf16, sms=132)["partitions"] == 1
    assert cuda_ops.decode_plan(2, 28, 4, 128, 64, torch.float32, sms=8)["grid"][1] == 4 * 2  # group 7: 2 chunks
    assert cuda_ops.decode_plan(2, 4, 2, 80, 64, torch.float32, sms=8)["tpt"] == 32  # 20 lanes -> 32
    assert cuda_ops.decode_plan(2, 4, 2, 256, 64, torch.float32, sms=8)["epl"] == 8
    with pytest.raises(ValueError, match="head_dim"):
        cuda_ops.decode_plan(2, 4, 2, 512, 64, torch.float32, sms=8)


# --- the kernels on the CPU emulation

EMU_LENS = [1, 7, 16, 17, 40, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_emulated_decode_matches_reference(emu, monkeypatch, dtype, group, block_size):
    hkv, d = (3, 64) if group == 3 else (2, 64 if group == 1 else 128)
    q, kv, table, ctx = make_case(EMU_LENS, hkv, group, d, block_size, dtype, seed=group * 100 + block_size)
    emu.sms = 0  # one partition per sequence
    check_decode(q, kv, table, ctx, block_size, dtype, "whole:")
    emu.sms = 1000  # idle SMs: contexts split into partitions, then merged by the reduce kernel
    monkeypatch.setattr(cuda_ops, "MIN_PARTITION", 16)
    assert cuda_ops.decode_plan(len(EMU_LENS), hkv * group, hkv, d, table.shape[1] * block_size, dtype,
                                emu.sms)["partitions"] > 1
    check_decode(q, kv, table, ctx, block_size, dtype, "split:")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,group,q_offset", [(16, 2, 0), (36, 2, 0), (80, 7, 0), (96, 1, 0), (64, 3, 1),
                                              (256, 2, 0)])
def test_emulated_head_dims_groups_and_alignment(emu, monkeypatch, dtype, d, group, q_offset):
    """Odd head_dims (padded lanes; 36 also takes the scalar loads), a group split over two blocks
    (7 > MAX_GROUP), q off 16-byte alignment, the largest head_dim of the small instantiation."""
    q, kv, table, ctx = make_case([5, 33, 70], 2, group, d, 16, dtype, seed=d + group, q_offset=q_offset)
    monkeypatch.setattr(cuda_ops, "MIN_PARTITION", 16)
    # The emulation runs the kernel source for every size, also those the GPU dispatch refuses
    # (cuda_ops.decode_supported): they pass here and failed on an H200, which is worth keeping in view.
    monkeypatch.setattr(cuda_ops, "decode_supported", lambda d, dtype: True)
    for sms in (0, 1000):
        emu.sms = sms
        check_decode(q, kv, table, ctx, 16, dtype, f"sms={sms}:")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_emulated_write_kv(emu, dtype):
    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d = 6, 6, 2, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)  # k and v: strided views of the fused rows
    k = qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    kv = torch.randn(2, 64, hkv, d, generator=g).to(dtype)
    slots = torch.tensor([5, 63, 0, -1, 17, 32])  # -1: a padding token, not stored
    want = kv.clone()
    keep = slots >= 0
    want[0, slots[keep]] = k[keep]
    want[1, slots[keep]] = v[keep]
    cuda_ops.write_kv(kv, k, v, slots)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("dtype,d,bs,unit", [(torch.bfloat16, 64, 4, 16), (torch.float32, 3, 1, 4),
                                             (torch.bfloat16, 3, 1, 1)])
def test_emulated_copy_blocks(emu, dtype, d, bs, unit):
    """Whole blocks in every layer and for K and V, into an arena of another size; the copy unit
    is the widest the alignment allows (16, 4 or 1 bytes)."""
    g = torch.Generator().manual_seed(d)
    layers, hkv = 3, 1
    src = torch.randn(layers, 2, 10 * bs, hkv, d, generator=g).to(dtype)
    dst = torch.zeros(layers, 2, 6 * bs, hkv, d, dtype=dtype)
    pairs = [(7, 0), (2, 5), (9, 3)]
    row = hkv * d * src.element_size()
    assert next(u for u in (16, 4, 1) if (bs * row) % u == 0 and (10 * bs * row) % u == 0
                and (6 * bs * row) % u == 0) == unit
    cuda_ops.copy_blocks(src, dst, pairs, bs)
    want = torch.zeros_like(dst)
    for s, t in pairs:
        want[:, :, t * bs:(t + 1) * bs] = src[:, :, s * bs:(s + 1) * bs]
    assert torch.equal(dst, want)
    # within one arena (a copy-on-write block copy)
    cuda_ops.copy_blocks(src, src, [(0, 8)], bs)
    assert torch.equal(src[:, :, 8 * bs:9 * bs], src[:, :, :bs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_emulated_dispatch_with_prefill(emu, dtype):
    """paged_attention() and write_kv() route a handled arena to cuda_ops; prefill chunks keep the
    torch path; the result equals the all-reference one."""
    hkv, group, d, bs = 3, 3, 64, 16
    q0, kv, table, ctx = make_case([5, 300, 33, 40], hkv, group, d, bs, dtype, seed=11)
    table, ctx = table[:3], ctx[:3]
    g = torch.Generator().manual_seed(2)
    n = 3 + 4  # three decodes, then a 4-token prefill chunk over 40 cached slots
    qkv = torch.randn(n, (group + 2) * hkv, d, generator=g).to(dtype)
    q, k, v = qkv[:, :group * hkv], qkv[:, group * hkv:(group + 1) * hkv], qkv[:, (group + 1) * hkv:]
    prefill = PrefillChunk(start=3, length=4, context_len=40, slots=torch.randperm(kv.shape[1], generator=g)[:40])
    scale = d ** -0.5
    slots, mask = decode_slots_and_mask(table, ctx, bs)
    ref_meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=3, decode_slots=slots,
                                 decode_mask=mask, prefills=[prefill])
    want = pa.paged_attention(q, k, v, kv, ref_meta, scale)
    assert cuda_ops.handles(kv) and pa.decode_kernel(kv) is cuda_ops
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=3, decode_block_tables=table,
                             decode_context_lens=ctx, block_size=bs, prefills=[prefill])
    torch.testing.assert_close(pa.paged_attention(q, k, v, kv, meta, scale).float(), want.float(),
                               atol=ATOL[dtype], rtol=0)


def int8_arena(kv: torch.Tensor) -> torch.Tensor:
    """The arena as `--kv-cache-dtype int8` stores it (kernels/paged_attention.py quantize_kv)."""
    return torch.stack([pa.quantize_kv(kv[0]), pa.quantize_kv(kv[1])])


def check_decode_int8(q, kv8, table, ctx, block_size, msg=""):
    """Decode attention over an int8 arena against the reference on its dequantized rows."""
    scale = q.shape[-1] ** -0.5
    got = run_decode(q, kv8, table, ctx, block_size, scale)
    want = reference(q, pa.dequantize_kv(kv8.cpu(), torch.float32), table, ctx, block_size, scale)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL[q.dtype], rtol=0,
                               msg=lambda m: f"{msg} context lengths {ctx.tolist()}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,group", [(64, 3), (128, 2), (32, 5)])
def test_emulated_int8_arena_decode_and_write(emu, monkeypatch, dtype, d, group):
    """An int8 arena (--kv-cache-dtype int8): write_kv quantizes rows bit for bit as quantize_kv
    does (an all-zero row too), and decode attention over it (whole and split contexts; 32-bit
    loads, and byte loads for q off alignment) equals the reference on the dequantized rows."""
    hkv = 2 if group != 3 else 3
    q, kv, table, ctx = make_case(EMU_LENS, hkv, group, d, 16, dtype, seed=d + group)
    kv8 = int8_arena(kv)
    assert cuda_ops.handles(kv8) and pa.decode_kernel(kv8) is cuda_ops
    for sms in (0, 1000):
        emu.sms = sms
        monkeypatch.setattr(cuda_ops, "MIN_PARTITION", 16)
        check_decode_int8(q, kv8, table, ctx, 16, f"sms={sms}:")
    q_off, *_ = make_case(EMU_LENS, hkv, group, d, 16, dtype, seed=d + group, q_offset=1)
    check_decode_int8(q_off, kv8, table, ctx, 16, "q unaligned:")
    # write_kv: strided k and v rows of the fused qkv, a padding token, an all-zero row
    g = torch.Generator().manual_seed(d)
    n = 5
    qkv = torch.randn(n, (group + 2) * hkv * d, generator=g).to(dtype)
    k = qkv[:, group * hkv * d:(group + 1) * hkv * d].view(n, hkv, d)
    v = qkv[:, (group + 1) * hkv * d:].view(n, hkv, d)
    k[2, 0] = 0
    slots = torch.tensor([3, 40, 0, -1, 17])
    want = kv8.clone()
    keep = slots >= 0
    want[0, slots[keep]] = pa.quantize_kv(k[keep])
    want[1, slots[keep]] = pa.quantize_kv(v[keep])
    cuda_ops.write_kv(kv8, k, v, slots)
    assert torch.equal(kv8, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,k,bias", [(1, 576, False), (3, 576, True), (8, 100, True), (5, 37, False),
                                      (9, 576, True), (40, 100, False)])
def test_emulated_linear_int8(emu, dtype, m, k, bias):
    """int8 weights on the CUDA backend: up to INT8_GEMV_ROWS rows read the int8 weight once (32-bit
    loads, a tail of K past them; x a strided view), within rounding of x @ (q * scale).T in fp32;
    more rows dequantize once (bit for bit dequantize) and run torch's GEMM, exactly as the
    reference path does."""
    from meshserve.kernels import int8_linear as il

    g = torch.Generator().manual_seed(m * k)
    n = 96
    q, s = il.quantize(torch.randn(n, k, generator=g) * 0.05)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    x = torch.randn(m, k + 3, generator=g).to(dtype)[:, 3:]  # rows strided, off alignment
    got = cuda_ops.linear_int8(x, q, s, b)
    assert got.dtype == dtype and got.shape == (m, n)
    if m > cuda_ops.INT8_GEMV_ROWS:
        assert torch.equal(got, torch.nn.functional.linear(x, il.dequantize(q, s, dtype), b))
        return
    want = x.float() @ (q.float() * s[:, None]).T + (b.float() if b is not None else 0)
    torch.testing.assert_close(got.float(), want, atol={torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype], rtol=0)
    # a bf16 model's Int8Linear on the plain weight takes it (fp32 stays on the reference)
    lin = il.Int8Linear(s, q=q, bias=b)
    if dtype == torch.bfloat16:
        assert torch.equal(lin(x), got)


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Eight prompts of 1..120 tokens; the last shares 60 tokens with the first (a prefix hit)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (70, 1, 9, 16, 17, 45, 120)]
    return prompts + [prompts[0][:60] + torch.randint(3, vocab, (12,), generator=g).tolist()]


def run_two_waves(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The second wave arrives while the first decodes, once the shared prefix is computed."""
    first = [eng.add_request(f"a{i}", p, params) for i, p in enumerate(prompts[:5])]
    while eng.scheduler.waiting or any(s.num_output_tokens == 0 for s in first if not s.is_finished):
        eng.step()
    second = [eng.add_request(f"b{i}", p, params) for i, p in enumerate(prompts[5:])]
    while eng.has_unfinished():
        eng.step()
    return [s.output_token_ids for s in first + second]


def small_pool_engine(model) -> LLMEngine:
    """24 blocks of 8 tokens cannot hold every sequence at once: some are preempted."""
    sched = SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=64, max_num_seqs=16)
    return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=24, enable_prefix_caching=True,
                                         scheduler=sched))


def test_emulated_engine_matches_transformers(emu, tiny_llama):
    """The whole engine with write_kv and decode attention on the emulated kernels: the same greedy
    tokens as Transformers, with prefix hits and preemptions."""
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size)
    ref = hf_greedy(hf, prompts, 10, cfg.eos_token_ids)
    eng = small_pool_engine(model)
    assert pa.use_decode_kernel(eng.kv_cache[0]) and pa.decode_kernel(eng.kv_cache[0]) is cuda_ops
    got = run_two_waves(eng, prompts, SamplingParams(max_tokens=10, temperature=0))
    assert got == ref
    assert eng.stats["num_preemptions"] > 0 and eng.stats["prefix_hits"] > 0


def test_emulated_engine_with_an_int8_kv_cache_matches_transformers_on_the_same_rounding(emu, tiny_llama):
    """--kv-cache-dtype int8 on the CUDA kernels (emulated): write_kv quantizes, decodes read int8
    rows, prompt chunks dequantize through the torch path; the greedy tokens are Transformers' with
    each K/V row rounded as the arena stores it, with prefix hits and preemptions."""
    from test_kv_int8 import int8_kv_cache
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size)
    ref = hf_greedy(hf, prompts, 10, cfg.eos_token_ids, cache=int8_kv_cache)
    sched = SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=64, max_num_seqs=16)
    eng = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=24, enable_prefix_caching=True,
                                        kv_cache_dtype="int8", scheduler=sched))
    assert eng.kv_cache.dtype == torch.int8 and pa.decode_kernel(eng.kv_cache[0]) is cuda_ops
    assert run_two_waves(eng, prompts, SamplingParams(max_tokens=10, temperature=0)) == ref
    assert eng.stats["num_preemptions"] > 0 and eng.stats["prefix_hits"] > 0


# --- on a GPU

GPU_LENS = [1, 600, 2, 15, 16, 17, 255, 257, 333, 599]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_decode_matches_reference(cuda, monkeypatch, dtype, block_size, group, d):
    hkv = 3 if group == 3 else 2
    g = torch.Generator().manual_seed(d * 7 + group * 3 + block_size)
    lens = [GPU_LENS[i] for i in torch.randperm(len(GPU_LENS), generator=g).tolist()]
    q, kv, table, ctx = make_case(lens, hkv, group, d, block_size, dtype, seed=d + group + block_size)
    q, kv, table, ctx = q.to(cuda), kv.to(cuda), table.to(cuda), ctx.to(cuda)
    check_decode(q, kv, table, ctx, block_size, dtype, "batch:")
    for n in (1, 2):  # few sequences: the contexts are split over partitions
        check_decode(q[:n], kv, table[:n], ctx[:n], block_size, dtype, "split:")
    monkeypatch.setattr(cuda_ops, "MIN_PARTITION", 1 << 30)  # never split
    check_decode(q[:2], kv, table[:2], ctx[:2], block_size, dtype, "whole:")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,group,q_offset", [(80, 7, 0), (36, 2, 0), (64, 3, 1), (256, 2, 0)])
def test_gpu_head_dims_groups_and_alignment(cuda, dtype, d, group, q_offset):
    q, kv, table, ctx = make_case([5, 333, 70, 1], 2, group, d, 16, dtype, seed=d + group, q_offset=q_offset)
    q, kv, table, ctx = q.to(cuda), kv.to(cuda), table.to(cuda), ctx.to(cuda)
    if cuda_ops.decode_supported(d, dtype):
        check_decode(q, kv, table, ctx, 16, dtype)
        return
    # Sizes the kernel does not handle (see cuda_ops.decode_supported): it refuses them, and the
    # dispatch takes the reference path, which is still right.
    with pytest.raises(ValueError, match="not supported"):
        run_decode(q, kv, table, ctx, 16, q.shape[-1] ** -0.5)
    assert pa.decode_kernel(kv) is None


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_write_kv(cuda, dtype):
    g = torch.Generator().manual_seed(5)
    n, hq, hkv, d = 300, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    slots = torch.randperm(4096, generator=g)[:n]
    slots[7] = -1
    kv = torch.randn(2, 4096, hkv, d, generator=g).to(dtype)
    want = kv.clone()
    k = qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    keep = slots >= 0
    want[0, slots[keep]] = k[keep]
    want[1, slots[keep]] = v[keep]
    qkv_d, kv_d = qkv.to(cuda), kv.to(cuda)
    cuda_ops.write_kv(kv_d, qkv_d[:, hq * d:(hq + hkv) * d].view(n, hkv, d), qkv_d[:, (hq + hkv) * d:].view(n, hkv, d),
                      slots.to(cuda))
    assert torch.equal(kv_d.cpu(), want)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,group", [(64, 3), (128, 2)])
def test_gpu_int8_arena_decode_and_write(cuda, monkeypatch, dtype, d, group):
    """As the emulated test, on the GPU: write_kv's rows are quantize_kv's bits, decode attention
    over the int8 arena equals the reference on its dequantized rows, whole and split."""
    hkv = 3 if group == 3 else 2
    g = torch.Generator().manual_seed(d + group)
    lens = [GPU_LENS[i] for i in torch.randperm(len(GPU_LENS), generator=g).tolist()]
    q, kv, table, ctx = make_case(lens, hkv, group, d, 16, dtype, seed=d + group)
    kv8 = int8_arena(kv).to(cuda)
    q, table, ctx = q.to(cuda), table.to(cuda), ctx.to(cuda)
    check_decode_int8(q, kv8, table, ctx, 16, "batch:")
    check_decode_int8(q[:1], kv8, table[:1], ctx[:1], 16, "split:")
    n = 300
    qkv = torch.randn(n, (group + 2) * hkv * d, generator=g).to(dtype)
    k = qkv[:, group * hkv * d:(group + 1) * hkv * d].view(n, hkv, d)
    v = qkv[:, (group + 1) * hkv * d:].view(n, hkv, d)
    slots = torch.randperm(kv8.shape[1], generator=g)[:n]
    want = kv8.cpu().clone()
    want[0, slots] = pa.quantize_kv(k)
    want[1, slots] = pa.quantize_kv(v)
    cuda_ops.write_kv(kv8, k.to(cuda), v.to(cuda), slots.to(cuda))
    assert torch.equal(kv8.cpu(), want)


@gpu
@pytest.mark.parametrize("m", [1, 4, 8, 64])
def test_gpu_linear_int8(cuda, m):
    """As the emulated test, bf16 on the GPU: a few rows within rounding of the fp32 product, many
    rows the dequantized weight's GEMM exactly."""
    from meshserve.kernels import int8_linear as il

    g = torch.Generator().manual_seed(m)
    q, s = il.quantize(torch.randn(960, 576, generator=g) * 0.05)
    x = torch.randn(m, 576, generator=g).bfloat16()
    got = cuda_ops.linear_int8(x.to(cuda), q.to(cuda), s.to(cuda)).cpu()
    if m > cuda_ops.INT8_GEMV_ROWS:
        want = torch.nn.functional.linear(x.to(cuda), il.dequantize(q, s, torch.bfloat16).to(cuda)).cpu()
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), x.float() @ (q.float() * s[:, None]).T, atol=2e-2, rtol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_copy_blocks_on_device_and_to_and_from_pinned_host(cuda, dtype):
    g = torch.Generator().manual_seed(9)
    layers, bs, hkv, d = 4, 16, 3, 64
    gpu_arena = torch.randn(layers, 2, 32 * bs, hkv, d, generator=g).to(dtype).to(cuda)
    host = torch.zeros(layers, 2, 8 * bs, hkv, d, dtype=dtype).pin_memory()
    blk = lambda a, i: a[:, :, i * bs:(i + 1) * bs]  # noqa: E731

    cuda_ops.copy_blocks(gpu_arena, gpu_arena, [(3, 30), (4, 31)], bs)  # within the GPU arena
    torch.cuda.synchronize()
    assert torch.equal(blk(gpu_arena, 30), blk(gpu_arena, 3)) and torch.equal(blk(gpu_arena, 31), blk(gpu_arena, 4))

    out = [(5, 0), (17, 7), (29, 2)]  # swap out: GPU -> pinned host
    cuda_ops.copy_blocks(gpu_arena, host, out, bs)
    torch.cuda.synchronize()
    for s, t in out:
        assert torch.equal(blk(host, t), blk(gpu_arena, s).cpu())

    back = [(0, 20), (7, 21), (2, 22)]  # swap in: pinned host -> GPU
    cuda_ops.copy_blocks(host, gpu_arena, back, bs)
    torch.cuda.synchronize()
    for (s, _), (h, t) in zip(out, back):
        assert torch.equal(blk(gpu_arena, t), blk(gpu_arena, s))
    with pytest.raises(ValueError, match="pinned"):
        cuda_ops.copy_blocks(gpu_arena, torch.zeros_like(host), [(0, 0)], bs)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_dispatch_with_prefill(cuda, dtype):
    """paged_attention() on a CUDA arena (kernel decodes, torch prefill) equals the CPU reference."""
    hkv, group, d, bs = 3, 3, 64, 16
    _, kv, table, ctx = make_case([5, 600, 33, 40], hkv, group, d, bs, dtype, seed=12)
    table, ctx = table[:3], ctx[:3]
    g = torch.Generator().manual_seed(4)
    n = 3 + 4
    qkv = torch.randn(n, (group + 2) * hkv, d, generator=g).to(dtype)
    split = lambda x: (x[:, :group * hkv], x[:, group * hkv:(group + 1) * hkv], x[:, (group + 1) * hkv:])  # noqa: E731
    pslots = torch.randperm(kv.shape[1], generator=g)[:40]
    scale = d ** -0.5
    slots, mask = decode_slots_and_mask(table, ctx, bs)
    q, k, v = split(qkv.float())
    want = pa.paged_attention(q, k, v, kv.float(), AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=3, decode_slots=slots, decode_mask=mask,
        prefills=[PrefillChunk(3, 4, 40, pslots)]), scale)
    kv_d = kv.to(cuda)
    assert pa.decode_kernel(kv_d) is cuda_ops
    q, k, v = split(qkv.to(cuda))
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=cuda), num_decodes=3,
                             decode_block_tables=table.to(cuda), decode_context_lens=ctx.to(cuda), block_size=bs,
                             prefills=[PrefillChunk(3, 4, 40, pslots.to(cuda))])
    got = pa.paged_attention(q, k, v, kv_d, meta, scale)
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL[dtype], rtol=0)


IPC_CHILD = r"""
import json, sys
import torch
from meshserve.shared import cuda_ipc
desc = json.loads(sys.stdin.read())
t = cuda_ipc.open(desc)
want = (torch.arange(t.numel(), device=t.device) % 251).to(t.dtype).view(t.shape)
seen = bool(torch.equal(t, want))
t.mul_(-1).add_(3)  # the parent must see this: the same memory, not a copy
torch.cuda.synchronize()
print(json.dumps({"seen": seen, "device": str(t.device), "shape": list(t.shape)}))
"""


@gpu
@pytest.mark.parametrize("kind", ["cudaipc", "torch"])
def test_gpu_ipc_between_two_processes(cuda, kind):
    if kind == "cudaipc":  # a dedicated allocation, a bf16 tensor at an offset inside it
        buf = cuda_ipc.empty(1 << 20)
        t = cuda_ipc.view(buf, 4096, "bfloat16", [64, 3, 8])
    else:  # a tensor from torch's caching allocator, a strided view at an offset in its storage
        big = torch.zeros(4000, 16, device=cuda)
        t = big[100:700:2, 3:13]
    t.copy_((torch.arange(t.numel(), device=cuda) % 251).to(t.dtype).view(t.shape))
    torch.cuda.synchronize()
    desc = cuda_ipc.export(t)
    assert desc["kind"] == kind
    text = json.dumps(desc)  # a descriptor is JSON as it is
    assert cuda_ipc.open(json.loads(text)).data_ptr() == t.data_ptr()  # the exporter gets its own memory back
    r = subprocess.run([sys.executable, "-c", IPC_CHILD], input=text, capture_output=True, text=True, timeout=180,
                       env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-4000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert child["seen"] and child["shape"] == list(t.shape)
    want = ((torch.arange(t.numel(), device=cuda) % 251).to(t.dtype) * -1 + 3).view(t.shape)
    torch.cuda.synchronize()
    assert torch.equal(t, want), "the child's write is not visible in the parent"


class _OnDevice:
    """Transformers' model on the GPU, fed the CPU tensors tests/oracle.py builds."""

    def __init__(self, hf):
        self.hf = hf

    def generate(self, input_ids, attention_mask=None, **kw):
        dev = self.hf.device
        return self.hf.generate(input_ids.to(dev), attention_mask=attention_mask.to(dev), **kw).cpu()


@pytest.fixture(scope="module")
def tiny_cuda(cuda, tiny_llama):
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).to(cuda).eval()
    prompts = make_prompts(cfg.vocab_size)
    ref = hf_greedy(_OnDevice(hf), prompts, 16, cfg.eos_token_ids)
    return cfg, sd, prompts, ref


@gpu
def test_gpu_engine_matches_transformers(tiny_cuda):
    cfg, sd, prompts, ref = tiny_cuda
    model = LlamaModel.from_hf(cfg, sd, torch.float32, device="cuda")
    eng = small_pool_engine(model)
    assert eng.kv_cache.is_cuda and pa.decode_kernel(eng.kv_cache[0]) is cuda_ops
    assert run_two_waves(eng, prompts, SamplingParams(max_tokens=16, temperature=0)) == ref
    assert eng.stats["num_preemptions"] > 0 and eng.stats["prefix_hits"] > 0
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


@gpu
def test_gpu_engine_with_an_int8_kv_cache_matches_transformers_on_the_same_rounding(cuda, tiny_llama):
    """As the emulated test, on the GPU: --kv-cache-dtype int8, write_kv and decode attention on
    int8 rows, against Transformers (on the GPU) with each K/V row rounded as the arena stores it."""
    from test_kv_int8 import int8_kv_cache
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).to(cuda).eval()
    prompts = make_prompts(cfg.vocab_size)
    ref = hf_greedy(_OnDevice(hf), prompts, 10, cfg.eos_token_ids, cache=int8_kv_cache)
    sched = SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=64, max_num_seqs=16)
    eng = LLMEngine(LlamaModel.from_hf(cfg, sd, torch.float32, device="cuda"),
                    EngineConfig(block_size=8, num_kv_blocks=24, enable_prefix_caching=True, kv_cache_dtype="int8",
                                 scheduler=sched))
    assert eng.kv_cache.is_cuda and eng.kv_cache.dtype == torch.int8 and pa.decode_kernel(eng.kv_cache[0]) is cuda_ops
    assert run_two_waves(eng, prompts, SamplingParams(max_tokens=10, temperature=0)) == ref
    assert eng.stats["num_preemptions"] > 0 and eng.stats["prefix_hits"] > 0


@gpu
def test_gpu_int8_weights_match_transformers_on_the_dequantized_weights(cuda, tiny_llama, monkeypatch):
    """--quantization int8 on the GPU: fp32 computes on the dequantized weights, so the greedy tokens
    are Transformers' on them; bf16 runs its decode steps of up to INT8_GEMV_ROWS rows through
    linear_int8 and its first tokens mostly agree."""
    from test_int8 import dequantized_hf

    cfg, sd = load_hf_dir(tiny_llama)
    prompts = make_prompts(cfg.vocab_size)
    ref = hf_greedy(_OnDevice(dequantized_hf(tiny_llama, tied=False).to(cuda)), prompts, 16, cfg.eos_token_ids)
    model = LlamaModel.from_hf(cfg, sd, torch.float32, device="cuda", quantization="int8")
    assert model.proj[0]["qkv"].q.is_cuda and model.proj[0]["qkv"].q.dtype == torch.int8
    assert run_two_waves(small_pool_engine(model), prompts, SamplingParams(max_tokens=16, temperature=0)) == ref

    calls = []
    real = cuda_ops.linear_int8
    monkeypatch.setattr(cuda_ops, "linear_int8", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    bf = LlamaModel.from_hf(cfg, sd, torch.bfloat16, device="cuda", quantization="int8")
    got = small_pool_engine(bf).generate(prompts[:4], SamplingParams(max_tokens=16, temperature=0))
    assert any(m <= cuda_ops.INT8_GEMV_ROWS for m in calls) and any(m > cuda_ops.INT8_GEMV_ROWS for m in calls)
    assert all(len(g) == 16 or g[-1] in cfg.eos_token_ids for g in got)
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= 3


@gpu
def test_gpu_engine_bf16_runs(tiny_cuda):
    cfg, sd, prompts, ref = tiny_cuda
    model = LlamaModel.from_hf(cfg, sd, torch.bfloat16, device="cuda")
    got = small_pool_engine(model).generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert all(len(g) == 16 or g[-1] in cfg.eos_token_ids for g in got)  # ran to the end, or stopped at EOS
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= len(ref) * 0.75  # bf16 rounds differently


@gpu
def test_gpu_seeded_sampling_reproducible_and_batch_invariant(tiny_cuda):
    cfg, sd, prompts, _ = tiny_cuda
    model = LlamaModel.from_hf(cfg, sd, torch.float32, device="cuda")
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = small_pool_engine(model).generate([prompts[2]], params)[0]
    assert small_pool_engine(model).generate([prompts[2]], params)[0] == alone
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(4)]
    mixed = small_pool_engine(model).generate(prompts[3:7] + [prompts[2]], others + [params])[-1]
    assert mixed == alone
