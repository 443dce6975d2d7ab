"""Dense projections, y = x @ w.T (+ b).

bf16 on a CPU with AVX-512 BF16: kernels/cpu/linear.cpp, from the weight in a blocked layout
("n32k2", `to_blocked`) that whoever loads the model makes once: the mesh's model loader writes it
into the node's shared memory, so every worker runs the fast kernel on one copy of the weights.
On a CPU with AMX the plain form is kept too (keeps_plain), and steps of many rows
(cpu_build.amx_gemm) go to F.linear on it. Everything else (fp32, other devices, shapes the
layout does not fit, the kernels disabled): F.linear on the plain weight, which is also the
kernel's oracle. int8 weights: kernels/int8_linear.py;
`projection` picks the class for the form a weights dict holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_build
from .int8_linear import Int8Linear, is_quantized

BLOCK_N = 32  # output columns per block of the layout
BLOCKED = "@n32k2"  # a weights dict holds a projection's blocked form under its name + this suffix


def kernel():
    """The compiled bf16 projection kernel, or None (not built, or no AVX-512 BF16 on this CPU)."""
    mod = cpu_build.load("meshserve_linear_cpu", "linear.cpp")
    return mod if mod is not None and mod.available() else None


def can_block(w: torch.Tensor) -> bool:
    return (w.dim() == 2 and w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.shape[0] % BLOCK_N == 0
            and w.shape[1] % 2 == 0 and kernel() is not None)


def to_blocked(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32, K/2, 32, 2]: per block of 32 output columns, each pair of inputs side by side."""
    n, k = w.shape
    return w.reshape(n // BLOCK_N, BLOCK_N, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def from_blocked(b: torch.Tensor) -> torch.Tensor:
    nb, k2, _, _ = b.shape
    return b.permute(0, 2, 1, 3).reshape(nb * BLOCK_N, k2 * 2)


def keeps_plain() -> bool:
    """Whether bf16 projections keep their plain form beside the blocked one: on a CPU with AMX,
    where torch's GEMM computes many rows (a prefill chunk, a large decode batch) far faster than
    the kernel, at the price of a second copy of those weights (docs/quantization.md, "AMX")."""
    return cpu_build.amx_gemm_min_rows() > 0 and kernel() is not None


def block_weights(weights: dict[str, torch.Tensor], names: list[str], keep: set[str] = frozenset()
                  ) -> dict[str, torch.Tensor]:
    """`weights` with each named projection also in the blocked layout (name + BLOCKED) where it
    fits; the plain form is dropped (one copy) unless its name is in `keep`, or keeps_plain()."""
    if keeps_plain():
        keep = set(keep) | set(names)
    out = dict(weights)
    for name in names:
        if can_block(weights[name]):
            out[name + BLOCKED] = to_blocked(weights[name])
            if name not in keep:
                del out[name]
    return out


class Linear:
    __slots__ = ("weight", "blocked", "bias", "kernel", "out_features")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 blocked: torch.Tensor | None = None):
        """From the plain weight [N, K], or its blocked form (kernels/cpu/linear.cpp's layout)."""
        self.kernel = kernel() if blocked is not None else None
        if blocked is not None and self.kernel is None:  # blocked by a loader, but no kernel here
            weight, blocked = from_blocked(blocked).contiguous(), None
        self.weight, self.blocked, self.bias = weight, blocked, bias
        self.out_features = blocked.shape[0] * BLOCK_N if blocked is not None else weight.shape[0]

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], name: str, bias: str | None = None) -> "Linear":
        """Both forms where the loader kept both (keeps_plain): the kernel for few rows, the GEMM for many."""
        if name not in weights and name + BLOCKED not in weights:
            raise KeyError(name)
        return cls(weights.get(name), weights.get(bias) if bias else None, weights.get(name + BLOCKED))

    def on_tiles(self, rows: int) -> bool:
        """Whether a bf16 step of `rows` rows runs this projection on the kernel's tiles (else many
        rows on AMX tiles: torch's GEMM on the plain form, other bits)."""
        return self.blocked is not None and not (self.weight is not None and cpu_build.amx_gemm(rows))

    def tiles(self, rows: int) -> "Linear | None":
        """What a bf16 step of `rows` rows runs on the kernel's tiles: this projection, or None."""
        return self if self.on_tiles(rows) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None and x.dtype == torch.bfloat16:
            if not self.on_tiles(x.shape[0]):  # many rows on AMX tiles
                return F.linear(x, self.weight, self.bias)
            x = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            self.kernel.linear_bf16(out, x, self.blocked, self.bias)
            return out
        w = self.weight if self.weight is not None else from_blocked(self.blocked)
        return F.linear(x, w, self.bias)


def converts_on_load(weights: dict[str, torch.Tensor]) -> bool:
    """Whether building projections from these weights reads them (a blocked layout with no kernel
    here to run it is copied back to plain): a layered load must then be complete first."""
    from . import int8_linear

    return (any(n.endswith(BLOCKED) for n in weights) and kernel() is None) or \
        (any(n.endswith(int8_linear.BLOCKED) for n in weights) and int8_linear.kernel() is None)


def projection(weights: dict[str, torch.Tensor], name: str, bias: str | None = None) -> Linear | Int8Linear:
    """The projection stored under `name`, in whichever form the loader wrote it (plain, blocked, int8)."""
    if is_quantized(weights, name):
        return Int8Linear.of(weights, name, bias)
    return Linear.of(weights, name, bias)
