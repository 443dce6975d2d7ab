"""A decode step's decoder layers in one C++ call (kernels/cpu/fused_decode.cpp), for a bf16 model
with int8 weights on a CPU with AVX2, or with bf16 weights in the blocked layout on one with AVX-512
BF16: at batch 1 the ~25 small operations of each layer and the fork and join of each projection
cost more than the layer's arithmetic (bf16 batch-1 decode of SmolLM2 took 22-24 ms a token per
operation on a 2-core AMX Xeon, where its 269 MB of weights stream in about 11).

It applies to steps of decodes only (one new token per row, up to `max_rows` rows; a sequence
verifying a proposal has one row per token) over a bf16 or int8 KV arena. Where int8 weights keep
a bf16 copy for many rows (AVX-512 BF16 without AMX), the steps of that many rows run fused on the
copy, as a bf16 model's do (two plans, one per kind of tiles). It runs the
per-operation path's own kernels (int8_linear.h or linear.h, layer_ops.h, paged_attention.h) in
the same order on the same inputs, so its output is bit for bit that path's: LlamaModel's
per-operation forward is its oracle, and everything else (prompts, LoRA, fp32, other devices, the
kernels disabled) runs that path.
"""

from __future__ import annotations

import torch

from . import cpu_build
from .int8_linear import Int8Linear
from .linear import Linear
from .paged_attention import AttentionMetadata

MAX_ROWS = 64  # kernels/cpu/fused_decode.cpp kMaxRows
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def kernel():
    mod = cpu_build.load("meshserve_fused_decode_cpu", "fused_decode.cpp")
    return mod if mod is not None and mod.available() else None


class FusedDecode:
    def __init__(self, plans: list[tuple[int, object]]):
        # (most rows, C++ plan) by rising row counts: a step of n rows runs the first plan whose
        # most rows is n or more. The plans hold raw pointers to the weights, which the model keeps alive.
        self.plans = plans
        self.max_rows = plans[-1][0]

    @classmethod
    def build(cls, layers: list[dict], attn_norm: list[torch.Tensor], mlp_norm: list[torch.Tensor],
              norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
              eps: float, scale: float, qk_norms: list[torch.Tensor] | None = None) -> "FusedDecode | None":
        """layers: each layer's projections by name (PROJECTIONS). A plan for each run of row counts
        (from 1, up to MAX_ROWS) where every projection runs the same kind of tiles in the
        per-operation path: the int8 kernel's (int8 weights) or the bf16 kernel's (bf16 weights, or
        int8 ones' kept bf16 copy from its threshold: AVX-512 BF16 without AMX). None unless the model
        is a bf16 CPU one whose first row counts are such a run, and the kernel is built. qk_norms: per
        layer its q and k head norms (Qwen3), or None."""
        if norm.dtype != torch.bfloat16 or norm.device.type != "cpu" or cos.dtype != torch.bfloat16:
            return None
        projs = [layer[name] for layer in layers for name in PROJECTIONS]
        mod = kernel() if all(isinstance(p, (Int8Linear, Linear)) for p in projs) else None
        if mod is None or any(layer[name].bias is not None for layer in layers for name in PROJECTIONS[1:]):
            return None
        biases = [layer["qkv"].bias for layer in layers]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None
        plans, rows = [], 1
        while rows <= MAX_ROWS:
            tiles = [p.tiles(rows) for p in projs]
            int8 = all(isinstance(t, Int8Linear) for t in tiles)
            if not int8 and not (all(isinstance(t, Linear) for t in tiles) and mod.bf16_weights()):
                break  # some projection leaves the tiles (torch's GEMM on AMX) or the kinds mix
            last = rows
            while last < MAX_ROWS and all(p.tiles(last + 1) is t for p, t in zip(projs, tiles)):
                last += 1
            plans.append((last, mod.FusedDecode(
                [t.blocked for t in tiles], [t.scale for t in tiles] if int8 else [],
                [] if biases[0] is None else biases, list(attn_norm) + list(mlp_norm) + [norm],
                cos.contiguous(), sin.contiguous(), heads, kv_heads, head_dim, eps, scale, list(qk_norms or []))))
            rows = last + 1
        return cls(plans) if plans else None

    def _plan(self, n: int) -> tuple[int, object]:
        """(most rows, plan) of the plan a step of n rows runs; (0, None) where none runs it."""
        return next(((most, plan) for most, plan in self.plans if n <= most), (0, None))

    def plan_rows(self, n: int) -> int:
        """The most rows of the plan a step of n rows runs (0: none runs it): a step may grow to
        that many (verifying proposals) and keep its tiles, hence its rows' bits."""
        return self._plan(n)[0]

    def applies(self, n: int, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        return (n <= self.max_rows and meta.num_decodes == n and not meta.prefills
                and meta.decode_block_tables is not None and kv_cache.device.type == "cpu"
                and kv_cache.dtype in (torch.bfloat16, torch.int8) and kv_cache.is_contiguous())

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        """x: the embedding rows [n, hidden]; returns the final hidden states, as the model's forward."""
        _, plan = self._plan(x.shape[0])
        out = torch.empty_like(x)
        plan.forward(out, x, positions, kv_cache, meta.slot_mapping, meta.decode_block_tables,
                     meta.decode_context_lens, meta.block_size, meta.verify_rows)
        return out
