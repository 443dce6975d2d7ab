"""A decoder layer's element-wise steps: RMSNorm (with the residual add), RoPE, SwiGLU.

Each is a torch expression (the reference, which fp32 and every non-CPU device run) or, for bf16
on the CPU, one call into kernels/cpu/layer_ops.cpp, where PyTorch would launch several small
operations whose fixed cost dominates decode at small batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_build


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference rotation. x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim // 2]
    (Hugging Face's rotate-half layout). The tables come from shared/model/rope.py."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def layer_ops_kernel():
    return cpu_build.load("meshserve_layer_ops_cpu", "layer_ops.cpp")


class LayerOps:
    """The element-wise steps for one model: compiled when `dtype` is bf16 on the CPU and the
    kernel builds, else the torch reference."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str, eps: float):
        self.eps = eps
        cpu = torch.device(device).type == "cpu"
        self.kernel = layer_ops_kernel() if dtype == torch.bfloat16 and cpu else None

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.stride(-1) == 1:
            out = torch.empty_like(x)
            self.kernel.rms_norm(out, x, w, self.eps)
            return out
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def add_rms_norm_(self, a: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """residual += a, in place; returns RMSNorm(residual) * w (written over `a` by the kernel)."""
        if self.kernel is not None and a.stride(-1) == 1 and residual.stride(-1) == 1:
            self.kernel.add_rms_norm_(a, residual, w, self.eps)
            return a
        residual.add_(a)
        return F.rms_norm(residual, (residual.shape[-1],), w, self.eps)

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              heads: int, head_dim: int) -> None:
        """Rotates the first `heads` heads of each row of qkv in place (Hugging Face's rotate-half
        layout); cos, sin: [max_positions, head_dim // 2] tables."""
        if self.kernel is not None and qkv.stride(-1) == 1:
            self.kernel.rope_(qkv, positions, cos, sin, heads, head_dim)
            return
        x = qkv[:, :heads * head_dim].view(qkv.shape[0], heads, head_dim)
        x.copy_(apply_rope(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up]."""
        if self.kernel is not None and gate_up.stride(-1) == 1:
            out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            self.kernel.silu_mul(out, gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
