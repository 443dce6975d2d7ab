"""Dense projections. On the CPU, bf16 weights are re-laid out once into oneDNN's blocked format,
which runs a small-batch (decode) matrix product about twice as fast as the plain layout and gives
bit-identical results. The packed copy is private to the process (an opaque tensor), so a worker
that maps shared weights decides whether the speed is worth the memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _can_pack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x @ w.T (+ b), with the weight packed when that is faster."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.bias = bias
        self.packed = pack and _can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
