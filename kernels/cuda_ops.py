"""The CUDA backend's paged KV cache kernels (kernels/cuda/paged_attention.cu), launched through CuPy.

- write_kv: this step's new keys and values into their arena slots (quantized into an int8 arena's
  rows, `--kv-cache-dtype int8`: kernels/paged_attention.py quantize_kv's bits);
- paged_decode_attention: decode attention read through block tables (same call as the CPU
  kernel's, so kernels/paged_attention.py dispatches to either), over a float or an int8 arena;
- copy_blocks: whole KV blocks between or within arenas, GPU or pinned host memory (swap);
- linear_int8: int8 weights' projections (kernels/int8_linear.py), read as int8 for a few rows.

CuPy compiles the source with NVRTC at first use (and caches the binary on disk); every launch
goes on torch's current stream, on tensors torch allocated, passed as raw device pointers (no
copies, no per-call DLPack). Importing this module needs neither CuPy nor a GPU: `available()`
says whether the kernels can run, and the torch reference path in kernels/paged_attention.py
(their oracle) runs otherwise. MESHSERVE_DISABLE_CUDA_KERNELS=1 forces that reference path.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "cuda" / "paged_attention.cu"
OPTIONS = ("--std=c++17",)
DECODE_THREADS = 128  # as DECODE_THREADS in the .cu
MAX_GROUP = 4  # as MAX_GROUP in the .cu
WARP = 32
WRITE_THREADS = 128
COPY_THREADS = 256
# A context is split over several blocks (then merged by paged_decode_reduce) only when the batch
# leaves SMs idle, and only in pieces of at least this many tokens.
MIN_PARTITION = 256

_TYPE = {torch.float32: "float", torch.bfloat16: "bf16_bits"}  # the model's (q, out, K/V rows)
_KV_TYPE = {**_TYPE, torch.int8: "signed char"}  # an arena's element
SCALE_BYTES = 4  # an int8 row's float32 scale (shared/kv_layout.py INT8_SCALE_BYTES)
# Elements of head_dim one lane reads per token (the instantiations); the first is one 16-byte load
# of float rows, four 32-bit loads of int8 rows.
_EPL = {torch.float32: (4, 8), torch.bfloat16: (8, 16), torch.int8: (16,)}
_UNITS = {16: "word16", 4: "unsigned int", 1: "unsigned char"}

NAME_EXPRESSIONS: tuple[str, ...] = tuple(
    [f"write_kv<{t}>" for t in _TYPE.values()]
    + [f"write_kv_int8<{t}>" for t in _TYPE.values()]
    + [f"paged_decode<{_TYPE[dt]}, {_TYPE[dt]}, {e}>" for dt in _TYPE for e in _EPL[dt]]
    + [f"paged_decode<{t}, signed char, {e}>" for t in _TYPE.values() for e in _EPL[torch.int8]]
    + [f"paged_decode_reduce<{t}>" for t in _TYPE.values()]
    + [f"copy_blocks<{u}>" for u in _UNITS.values()]
    + [f"linear_int8<{t}>" for t in _TYPE.values()]
    + [f"dequantize_int8<{t}>" for t in _TYPE.values()])
INT8_GEMV_ROWS = 8  # as INT8_GEMV_ROWS in the .cu: more rows dequantize once and run torch's GEMM
LINEAR_THREADS = 128


def disabled() -> bool:
    return os.environ.get("MESHSERVE_DISABLE_CUDA_KERNELS", "").strip().lower() not in ("", "0", "false", "no")


class CupyBackend:
    """Compiles the module once and launches its kernels with CuPy on torch's current stream.
    (The tests swap in a CPU emulation with the same methods.)"""

    device_type = "cuda"

    def __init__(self):
        self._lock = threading.Lock()
        self._kernels: dict | None = None
        self._error: str | None = None
        self._streams: dict[tuple[int, int], object] = {}
        self._sms: dict[int, int] = {}

    def kernels(self) -> dict:
        """name expression -> cupy.RawKernel; compiles on the first call (raises if it cannot)."""
        if self._kernels is None:
            with self._lock:
                if self._kernels is None:
                    import cupy

                    mod = cupy.RawModule(code=SOURCE.read_text(), options=OPTIONS,
                                         name_expressions=list(NAME_EXPRESSIONS))
                    self._kernels = {n: mod.get_function(n) for n in NAME_EXPRESSIONS}
        return self._kernels

    def available(self) -> bool:
        if self._kernels is not None:
            return True
        if self._error is not None or disabled():
            return False
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            self.kernels()
            return True
        except Exception as e:  # no cupy, no NVRTC, a compile error, ...
            self._error = f"{type(e).__name__}: {str(e).strip()[:500]}"
            log.warning("CUDA kernels unavailable, using the torch reference path (%s)", self._error)
            return False

    def _stream(self, device: torch.device):
        import cupy

        ptr = torch.cuda.current_stream(device).cuda_stream
        key = (ptr, device.index)
        s = self._streams.get(key)
        if s is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._streams[key] = cupy.cuda.ExternalStream(ptr, device.index)
        return s

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple, shared_mem: int,
               device: torch.device) -> None:
        import cupy

        kernel = self.kernels()[name]
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if cupy.cuda.runtime.getDevice() != device.index:
            with cupy.cuda.Device(device.index), self._stream(device):
                kernel(grid, block, args, shared_mem=shared_mem)
        else:
            with self._stream(device):
                kernel(grid, block, args, shared_mem=shared_mem)

    def host_pointer(self, t: torch.Tensor) -> int:
        """The device address of a pinned host tensor (mapped into the GPU's address space)."""
        import cupy

        if not t.is_pinned():
            raise ValueError("a host arena must be in pinned memory (tensor.pin_memory()) for the GPU to reach it")
        ptr = cupy.cuda.runtime.pointerGetAttributes(t.data_ptr()).devicePointer
        if not ptr:
            raise ValueError("this pinned host memory is not mapped into the GPU's address space")
        return ptr

    def sm_count(self, device: torch.device) -> int:
        i = device.index if device.index is not None else torch.cuda.current_device()
        if i not in self._sms:
            self._sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
        return self._sms[i]


_backend = CupyBackend()


def available() -> bool:
    """Whether the kernels run here (CuPy, a GPU, and the source compiled: compiles on first call)."""
    return _backend.available()


def head_dim_of(kv: torch.Tensor) -> int:
    """An arena's head_dim: its rows' length, less the scale's bytes of an int8 row."""
    return kv.shape[-1] - (SCALE_BYTES if kv.dtype == torch.int8 else 0)


def handles(kv: torch.Tensor) -> bool:
    """Whether write_kv and decode attention over this arena ([..., slots, kv_heads, row]) run here."""
    return (kv.device.type == _backend.device_type and kv.dtype in _KV_TYPE
            and head_dim_of(kv) <= WARP * _EPL[kv.dtype][-1] and kv.stride(-1) == 1
            and kv.stride(-2) == kv.shape[-1] and available())


def decode_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether paged_decode gives right answers for this head size: on an H200 it did only when a
    token's lanes (head_dim / elements per lane) are a power of two (16, 32, 64, 128, 256 here;
    80 and 36 came out wrong on the GPU while the CPU emulation of the same source passed: not yet
    understood). Other sizes take the gather + SDPA reference."""
    epl = next((e for e in _EPL.get(dtype, ()) if head_dim <= WARP * e), None)
    if epl is None or head_dim % epl:
        return False
    lanes = head_dim // epl
    return lanes & (lanes - 1) == 0


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [tokens, heads, head_dim] with each token's heads x head_dim contiguous (rows may be strided)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def _long(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.long).contiguous()


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv: one layer's arena [2, slots, kv_heads, head_dim] (or int8 rows [..., head_dim + 4]);
    k, v: [tokens, kv_heads, head_dim]; slot_mapping: [tokens] (a negative slot skips its token)."""
    n = k.shape[0]
    if n == 0:
        return
    slots = _long(slot_mapping, kv.device)
    es = kv.element_size()
    if kv.dtype == torch.int8:  # quantized row by row, one warp each
        dt = k.dtype if k.dtype in _TYPE else torch.float32
        k, v = _rows(k, dt), _rows(v, dt)
        _backend.launch(f"write_kv_int8<{_TYPE[dt]}>", (n, kv.shape[2]), (WARP,),
                        (kv.data_ptr(), kv.data_ptr() + kv.stride(0), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
                         np.int64(k.stride(0)), np.int64(v.stride(0)), np.int64(kv.stride(1)),
                         np.int32(k.shape[2])), 0, kv.device)
        return
    k, v = _rows(k, kv.dtype), _rows(v, kv.dtype)
    _backend.launch(f"write_kv<{_TYPE[kv.dtype]}>", (n,), (WRITE_THREADS,),
                    (kv.data_ptr(), kv.data_ptr() + kv.stride(0) * es, k.data_ptr(), v.data_ptr(),
                     slots.data_ptr(), np.int64(k.stride(0)), np.int64(v.stride(0)), np.int64(kv.stride(1)),
                     np.int32(kv.shape[2] * kv.shape[3])), 0, kv.device)


def decode_plan(num_seqs: int, q_heads: int, kv_heads: int, head_dim: int, max_context: int,
                dtype: torch.dtype, sms: int) -> dict:
    """How paged_decode is launched: elements and lanes per token, grid, context partitions."""
    epl = next((e for e in _EPL[dtype] if head_dim <= WARP * e), None)
    if epl is None:
        raise ValueError(f"head_dim {head_dim} is larger than the CUDA decode kernel supports "
                         f"({WARP * _EPL[dtype][-1]} for {dtype})")
    lanes = -(-head_dim // epl)
    tpt = 1 << (lanes - 1).bit_length()  # lanes per token: a power of two, so a warp holds whole tokens
    group = q_heads // kv_heads
    y = kv_heads * -(-group // MAX_GROUP)
    blocks = num_seqs * y
    parts = 1
    if blocks < 2 * sms and max_context > MIN_PARTITION:  # idle SMs: split each context
        parts = min(-(-2 * sms // blocks), -(-max_context // MIN_PARTITION))
    psize = max(1, -(-max_context // parts))
    parts = -(-max_context // psize) if max_context > 0 else 1
    return {"epl": epl, "tpt": tpt, "group": group, "grid": (num_seqs, y, parts), "partitions": parts,
            "partition_size": psize,
            "shared_mem": (DECODE_THREADS // WARP) * MAX_GROUP * (2 + head_dim) * 4}


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, scale: float) -> None:
    """Decode attention, one query token per sequence, as the CPU kernel's call.

    out: [seqs, q_heads, head_dim] (each sequence's row contiguous); q: [seqs, q_heads, head_dim]
    (head_dim contiguous, rows may be strided); kv: one layer's arena [2, slots, kv_heads, head_dim];
    block_tables: [seqs, max_blocks], wide enough for every context; context_lens: [seqs], >= 1."""
    nd, hq, d = q.shape
    if not decode_supported(d, kv.dtype) or head_dim_of(kv) != d:
        raise ValueError(f"paged_decode_attention: head_dim {d} in {kv.dtype} is not supported on CUDA "
                         "(see decode_supported); use the reference path")
    if nd == 0:
        return
    dt = kv.dtype if kv.dtype in _TYPE else (q.dtype if q.dtype in _TYPE else torch.float32)  # q and out's
    if q.stride(2) != 1 or q.dtype != dt:
        q = q.to(dt).contiguous()
    if out.stride(2) != 1 or out.stride(1) != d or out.dtype != dt:
        raise ValueError("out must be [seqs, q_heads, head_dim] in q's dtype (the arena's, for float rows), "
                         "each row contiguous")
    tables, ctx = _long(block_tables, kv.device), _long(context_lens, kv.device)
    hkv, es, qs = kv.shape[2], kv.element_size(), q.element_size()
    plan = decode_plan(nd, hq, hkv, d, tables.shape[1] * block_size, kv.dtype, _backend.sm_count(kv.device))
    k_ptr = kv.data_ptr()
    v_ptr = k_ptr + kv.stride(0) * es
    word = 4 if kv.dtype == torch.int8 else 16  # the arena's loads: 32-bit words of int8 rows, else 16 bytes
    vec = (d % plan["epl"] == 0 and all(x % 16 == 0 for x in (q.data_ptr(), q.stride(0) * qs, q.stride(1) * qs))
           and all(x % word == 0 for x in (k_ptr, v_ptr, kv.stride(1) * es, kv.stride(2) * es)))
    parts, psize = plan["partitions"], plan["partition_size"]
    partial = torch.empty(nd * hq * parts * (d + 2), dtype=torch.float32, device=kv.device) if parts > 1 else None
    t = _TYPE[dt]
    _backend.launch(
        f"paged_decode<{t}, {_KV_TYPE[kv.dtype]}, {plan['epl']}>", plan["grid"], (DECODE_THREADS,),
        (out.data_ptr(), 0 if partial is None else partial.data_ptr(), q.data_ptr(), k_ptr, v_ptr,
         tables.data_ptr(), ctx.data_ptr(), np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(out.stride(0)),
         np.int64(kv.stride(1)), np.int64(kv.stride(2)), np.int64(tables.stride(0)), np.int32(hq),
         np.int32(plan["group"]), np.int32(d), np.int32(block_size), np.int32(psize), np.int32(plan["tpt"]),
         np.int32(vec), np.float32(scale)),
        plan["shared_mem"], kv.device)
    if partial is not None:
        threads = min(128, -(-d // WARP) * WARP)
        _backend.launch(f"paged_decode_reduce<{t}>", (nd, hq), (threads,),
                        (out.data_ptr(), partial.data_ptr(), ctx.data_ptr(), np.int64(out.stride(0)),
                         np.int32(hq), np.int32(d), np.int32(parts), np.int32(psize)), 0, kv.device)


def _pointer(t: torch.Tensor) -> int:
    if t.device.type == _backend.device_type:
        return t.data_ptr()
    if t.device.type == "cpu":
        return _backend.host_pointer(t)
    raise ValueError(f"cannot copy blocks from or to a {t.device.type} tensor")


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs, block_size: int) -> None:
    """For each (s, d) in pairs: block s of `src` -> block d of `dst`, in every layer, K and V.

    src, dst: contiguous arenas [..., slots, kv_heads, head_dim] of the same dtype and shape but for
    the number of slots (a host swap arena may hold fewer blocks), each on the GPU or in pinned host
    memory. pairs: [(s, d), ...] or an int64 tensor [n, 2]. Runs on the GPU's current stream:
    synchronize before reading a host destination. A destination block must not be a source too."""
    if src.dtype != dst.dtype or src.shape[:-3] != dst.shape[:-3] or src.shape[-2:] != dst.shape[-2:]:
        raise ValueError(f"arenas differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_blocks needs contiguous arenas")
    device = src.device if src.device.type == _backend.device_type else dst.device
    if device.type != _backend.device_type:
        raise ValueError("one of the arenas must be on the GPU")
    pairs = torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)
    n = pairs.shape[0]
    if n == 0:
        return
    pairs = pairs.to(device, non_blocking=True).contiguous()
    row = src.shape[-2] * src.shape[-1] * src.element_size()  # bytes per slot
    chunks = src.numel() // max(1, src.shape[-3] * src.shape[-2] * src.shape[-1])
    block_bytes = block_size * row
    sp, dp = _pointer(src), _pointer(dst)
    src_chunk, dst_chunk = src.shape[-3] * row, dst.shape[-3] * row
    unit = next(u for u in (16, 4, 1) if all(x % u == 0 for x in (sp, dp, block_bytes, src_chunk, dst_chunk)))
    _backend.launch(f"copy_blocks<{_UNITS[unit]}>", (n, chunks), (COPY_THREADS,),
                    (sp, dp, pairs.data_ptr(), np.int64(src_chunk), np.int64(dst_chunk), np.int64(block_bytes),
                     np.int64(block_bytes), np.int64(block_bytes)), 0, device)


def runs(t: torch.Tensor) -> bool:
    """Whether the kernels here take tensors where `t` lives (its device, and they are available)."""
    return t.device.type == _backend.device_type and available()


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) @ (q [N, K] int8 * scale [N] fp32).T (+ bias [N]) -> [M, N] in x's dtype.
    Up to INT8_GEMV_ROWS rows: one pass over the int8 weights (linear_int8); more: the weight
    dequantized once into x's dtype (the bits dequantize gives), then torch's GEMM."""
    m, k = x.shape
    n = q.shape[0]
    dt = x.dtype
    q, scale = q.contiguous(), scale.to(torch.float32).contiguous()
    if m > INT8_GEMV_ROWS:
        w = torch.empty(n, k, dtype=dt, device=x.device)
        blocks = min(65535, -(-(n * k) // (4 * LINEAR_THREADS)))
        _backend.launch(f"dequantize_int8<{_TYPE[dt]}>", (blocks,), (LINEAR_THREADS,),
                        (w.data_ptr(), q.data_ptr(), scale.data_ptr(), np.int64(n * k), np.int32(k)), 0, x.device)
        return torch.nn.functional.linear(x, w, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=dt, device=x.device)
    if m == 0:
        return out
    xs = x.element_size()
    vec = int(k % 4 == 0 and q.data_ptr() % 4 == 0)
    x_vec = int(x.data_ptr() % 16 == 0 and (x.stride(0) * xs) % 16 == 0 and k % 16 == 0)
    b = bias.to(dt).contiguous() if bias is not None else None
    blocks = min(65535, -(-n // (LINEAR_THREADS // WARP)))
    _backend.launch(f"linear_int8<{_TYPE[dt]}>", (blocks,), (LINEAR_THREADS,),
                    (out.data_ptr(), x.data_ptr(), q.data_ptr(), scale.data_ptr(), 0 if b is None else b.data_ptr(),
                     np.int32(m), np.int32(n), np.int32(k), np.int64(x.stride(0)), np.int64(out.stride(0)),
                     np.int32(vec), np.int32(x_vec)), 0, x.device)
    return out
