"""Weight-only int8 projections: y = x @ (q * scale).T (+ b), q int8 [N, K] with one fp32 scale
per output channel (symmetric, round to nearest, |q| <= 127).

Quantized once at load (`quantize_weights`, from the source's own precision: bf16, fp32 or a
dequantized GGUF), half the bytes of bf16 per token. bf16 on a CPU with AVX2: kernels/cpu/
int8_linear.cpp (AVX-512 VNNI tiles where the CPU has them), from the weight in its blocked
layout (`to_blocked`) that the model loader writes into the node's shared memory (one copy per
node). A bf16 model on CUDA: kernels/cuda_ops.py `linear_int8` (the int8 weight read once for a
few rows; dequantized once into bf16 for torch's GEMM for many). Everything else (fp32 models,
other CPUs, the kernels disabled): the reference, F.linear on the dequantized weight, which is also
the kernels' oracle and what Transformers runs when given the dequantized weights. Per-group scales
were measured and not kept: on SmolLM2-135M groups of 32 or 64 were no closer to bf16 than
per-channel scales (docs/quantization.md).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import cpu_build, cuda_ops

if TYPE_CHECKING:
    from .linear import Linear

BLOCK_N = 16  # output columns per block of the layout
# A many-row bf16 step on a CPU with AMX hands int8 projections to torch's GEMM. On the dequantized
# copy the loader keeps (keeps_dequantized) that is where bf16 steps go; on a weight dequantized per
# call (by the kernel, one pass; no copy kept) from this many times cpu_build's bf16 threshold,
# where that beats the kernel's own tiles (linear_bench on SmolLM2's shapes: from 32 rows against
# the AVX2 tiles, 48-64 against the AVX-512 VNNI ones).
GEMM_FACTOR_AVX2 = 2
GEMM_FACTOR_VNNI = 3.5
# On the kept copy, from 1.5 times (24 rows): SmolLM2's four layer projections at 16 rows took
# 0.30 ms on the int8 tiles against 0.34 on the GEMM, at 24 rows 0.46 against 0.39 (linear_bench,
# AMX Xeon), so up to 23 rows a step loses little per operation, and a decode-only step of 16-23
# rows runs fused on the tiles (kernels/fused_decode.py), 1.3x the per-operation step
# (`python -m meshserve.bench.fused_decode_bench --quantization int8`).
GEMM_FACTOR_COPY = 1.5
# On a CPU with AVX-512 BF16 and no AMX, from this many rows on an int8 projection runs the bf16
# kernel (kernels/cpu/linear.cpp) on its kept dequantized copy in that kernel's blocked layout: a
# step of many rows is bound by arithmetic, where bf16 dot products (vdpbf16ps) outrun the int8
# tiles' int16 ones (vpdpwssd: 0.29 against 0.18 ms for SmolLM2's qkv at 64 rows), while fewer rows
# stream the weights from memory, where int8's half the bytes wins. Measured on a 2-core AVX-512 BF16
# EPYC with bench-quant's decode of 16-64 sequences: the int8 tiles ahead at 16-24 rows, even at
# 32-40, the copy ahead from 48; mixed-64 in the engine 165 -> 191 tokens/s from 32 rows (186 from
# 16). MESHSERVE_INT8_BF16_MIN_ROWS overrides it (0: keep no copy).
BF16_KERNEL_MIN_ROWS = 32
# Where another CPU was measured otherwise, by (vendor, family): a Zen 5 (AMD family 26: 43.9 GB/s,
# a bf16 peak of 871 GFLOP/s on two cores) runs the copy faster than the int8 tiles from about 12
# rows: 16 and 24 sequences decoding 1.17-1.42x with it from 12 (docs/quantization.md, "int8's
# bf16 copy fused").
BF16_KERNEL_MIN_ROWS_BY_CPU = {("AuthenticAMD", 26): 12}
INT8 = "@int8"  # a weights dict holds a projection's int8 weight [N, K] under its name + this suffix,
BLOCKED = "@int8n16k2"  # or its blocked form [N/16, K/2, 16, 2] (the CPU kernel's) under this one,
SCALE = "@scale"  # and its fp32 scales [N] under this one;
DEQUANTIZED = "@int8bf16"  # on an AMX CPU also q * scale in bf16, plain [N, K] (dequantized_form "plain")
DEQUANTIZED_BLOCKED = "@int8bf16n32k2"  # on AVX-512 BF16 without AMX, in linear.py's layout ("blocked")


def kernel():
    """The compiled int8 projection kernel, or None (not built, or no AVX2 on this CPU)."""
    mod = cpu_build.load("meshserve_int8_linear_cpu", "int8_linear.cpp")
    return mod if mod is not None and mod.available() else None


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scale fp32 [N]), w ~= q * scale[:, None]."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the int8 model computes with: q * scale in fp32, then `dtype`."""
    return (q.float() * scale[:, None]).to(dtype)


def can_block(q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a bf16 model on this machine runs this weight through the CPU kernel."""
    return (dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[0] % BLOCK_N == 0 and q.shape[1] % 2 == 0
            and kernel() is not None)


def to_blocked(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 16, 2]: per block of 16 output columns, each pair of inputs side by side."""
    n, k = q.shape
    return q.reshape(n // BLOCK_N, BLOCK_N, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def from_blocked(b: torch.Tensor) -> torch.Tensor:
    nb, k2, _, _ = b.shape
    return b.permute(0, 2, 1, 3).reshape(nb * BLOCK_N, k2 * 2)


@functools.cache
def bf16_kernel_min_rows() -> int:
    """This CPU's threshold (BF16_KERNEL_MIN_ROWS_BY_CPU, else BF16_KERNEL_MIN_ROWS), or its override;
    0: never."""
    default = BF16_KERNEL_MIN_ROWS_BY_CPU.get(cpu_build.cpu_family(), BF16_KERNEL_MIN_ROWS)
    try:
        return max(0, int(os.environ.get("MESHSERVE_INT8_BF16_MIN_ROWS", default)))
    except ValueError:
        return default


def dequantized_form() -> str | None:
    """Which copy of q * scale in bf16 int8 projections keep beside their blocked int8 weight, for
    steps of many rows: "plain" on a CPU with AMX (torch's GEMM on AMX tiles, as bf16 projections
    keep their plain form: kernels/linear.py keeps_plain), "blocked" on a CPU with AVX-512 BF16 and
    no AMX (the bf16 kernel, from bf16_kernel_min_rows rows), None elsewhere. The same bits as
    dequantizing per call; 1.5x the int8 weights' memory: a trade of memory for the many-row steps'
    speed with the few-row steps' (docs/quantization.md)."""
    if kernel() is None:
        return None
    if cpu_build.amx_gemm_min_rows() > 0:
        return "plain"
    from . import linear

    return "blocked" if bf16_kernel_min_rows() > 0 and linear.kernel() is not None else None


def keeps_dequantized() -> bool:
    return dequantized_form() is not None


def quantize_weights(weights: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype,
                     device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """`weights` with each named projection replaced by its int8 weight (blocked where the CPU
    kernel will run it, with its dequantized copy in the dequantized_form) and scales; every other
    tensor in `dtype`."""
    from . import linear

    out, form = {}, dequantized_form()
    for name, w in weights.items():
        if name not in names:
            out[name] = w.to(dtype).contiguous()
            continue
        q, out[name + SCALE] = quantize(w)
        if torch.device(device).type == "cpu" and can_block(q, dtype):
            out[name + BLOCKED] = to_blocked(q)
            if form is not None:
                w = Int8Linear(out[name + SCALE], blocked=out[name + BLOCKED]).weight(dtype)
                if form == "plain":
                    out[name + DEQUANTIZED] = w
                elif linear.can_block(w):
                    out[name + DEQUANTIZED_BLOCKED] = linear.to_blocked(w)
        else:
            out[name + INT8] = q
    return out


def is_quantized(weights: dict[str, torch.Tensor], name: str) -> bool:
    return name + SCALE in weights


class Int8Linear:
    __slots__ = ("q", "blocked", "scale", "bias", "kernel", "out_features", "dequantized", "bf16")

    def __init__(self, scale: torch.Tensor, q: torch.Tensor | None = None, blocked: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, dequantized: torch.Tensor | None = None,
                 dequantized_blocked: torch.Tensor | None = None):
        """From the int8 weight [N, K] or its blocked form, and its scales [N] (and, beside a blocked
        weight, its dequantized bf16 copy, plain or blocked, as quantize_weights keeps it)."""
        self.kernel = kernel() if blocked is not None else None
        if blocked is not None and self.kernel is None:  # blocked by a loader, but no kernel here
            q, blocked = from_blocked(blocked).contiguous(), None
        self.q, self.blocked, self.scale, self.bias = q, blocked, scale, bias
        self.dequantized = dequantized if self.blocked is not None else None
        # The bf16 kernel's projection on the blocked copy (None where it cannot run it).
        self.bf16 = None
        if self.blocked is not None and dequantized_blocked is not None:
            from .linear import Linear

            self.bf16 = Linear(bias=bias, blocked=dequantized_blocked)
            if self.bf16.kernel is None:
                self.bf16 = None
        self.out_features = scale.shape[0]

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], name: str, bias: str | None = None) -> "Int8Linear":
        return cls(weights[name + SCALE], weights.get(name + INT8), weights.get(name + BLOCKED),
                   weights.get(bias) if bias else None, weights.get(name + DEQUANTIZED),
                   weights.get(name + DEQUANTIZED_BLOCKED))

    def gemm(self, rows: int) -> bool:
        """Whether a bf16 step of `rows` rows runs this projection as torch's GEMM on AMX tiles."""
        if self.dequantized is not None:
            return cpu_build.amx_gemm(rows, GEMM_FACTOR_COPY)
        vnni = self.kernel is not None and self.kernel.uses_vnni()
        return cpu_build.amx_gemm(rows, GEMM_FACTOR_VNNI if vnni else GEMM_FACTOR_AVX2)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight [N, K] (the reference computes with it; a many-row bf16 step on
        AMX tiles takes the kept copy, or the kernel's one pass: the same bits)."""
        if self.dequantized is not None and dtype == self.dequantized.dtype:
            return self.dequantized
        if self.blocked is not None and dtype == torch.bfloat16 and self.kernel is not None:
            out = torch.empty(self.out_features, 2 * self.blocked.shape[1], dtype=dtype)
            self.kernel.dequantize_bf16(out, self.blocked, self.scale)
            return out
        return dequantize(self.q if self.q is not None else from_blocked(self.blocked), self.scale, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: the embedding lookup of a tied int8 embedding."""
        if self.dequantized is not None and dtype == self.dequantized.dtype:
            return F.embedding(ids, self.dequantized)
        if self.q is not None:
            q = F.embedding(ids, self.q)
        else:  # gathered straight from the blocked layout: row n is block n // 16, column n % 16
            q = self.blocked[ids // BLOCK_N, :, ids % BLOCK_N, :].reshape(ids.shape[0], -1)
        return (q.float() * self.scale[ids, None]).to(dtype)

    def copy_rows(self, rows: int) -> bool:
        """Whether a bf16 step of `rows` rows runs the kept bf16 copy (many rows, no AMX)."""
        return self.bf16 is not None and 0 < bf16_kernel_min_rows() <= rows

    def on_tiles(self, rows: int) -> bool:
        """Whether a bf16 step of `rows` rows runs this projection on the int8 kernel's tiles."""
        return self.blocked is not None and not self.copy_rows(rows) and not self.gemm(rows)

    def tiles(self, rows: int) -> "Int8Linear | Linear | None":
        """What a bf16 step of `rows` rows runs on a kernel's tiles: these int8 weights, or their kept
        bf16 copy (many rows, no AMX); None where torch's GEMM runs it."""
        if self.copy_rows(rows):
            return self.bf16.tiles(rows)
        return self if self.on_tiles(rows) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None and x.dtype == torch.bfloat16:
            if self.copy_rows(x.shape[0]):  # many rows, no AMX
                return self.bf16(x)
            if self.gemm(x.shape[0]):  # a prefill chunk or a big decode step, on AMX tiles
                return F.linear(x, self.weight(x.dtype), self.bias)
            x = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            self.kernel.linear_int8(out, x, self.blocked, self.scale, self.bias)
            return out
        if self.q is not None and x.dtype == torch.bfloat16 and cuda_ops.runs(self.q):  # a bf16 model on the GPU
            return cuda_ops.linear_int8(x, self.q, self.scale, self.bias)
        return F.linear(x, self.weight(x.dtype), self.bias)
