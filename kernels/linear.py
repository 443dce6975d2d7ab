"""Dense projections, y = x @ w.T (+ b).

- 1 to 4 rows of bf16 (decode at small batch, memory-bound): kernels/cpu/gemv.cpp, which reads
  each weight row once with AVX-512 BF16 dot products, on the plain weight (shareable memory);
- more rows: bf16 weights re-laid out once into oneDNN's blocked format when `pack` (a private
  copy: a mesh worker that maps shared weights decides whether the speed is worth the memory);
- otherwise F.linear, which is also the oracle of both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_build

GEMV_MAX_ROWS = 4


def _can_pack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def gemv_kernel():
    """The compiled small-batch bf16 kernel, or None (not built, or no AVX-512 BF16 on this CPU)."""
    mod = cpu_build.load("meshserve_gemv_cpu", "gemv.cpp")
    return mod if mod is not None and mod.available() else None


class Linear:
    __slots__ = ("weight", "bias", "packed", "gemv")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight, self.bias = weight, bias
        self.gemv = gemv_kernel() if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" \
            and weight.is_contiguous() else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if pack and _can_pack(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16:
            x = x.contiguous()
            out = torch.empty(x.shape[0], self.weight.shape[0], dtype=x.dtype)
            self.gemv.gemv_bf16(out, x, self.weight, self.bias)
            return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
