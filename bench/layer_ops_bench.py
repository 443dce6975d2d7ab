"""The element-wise steps of a decoder layer: kernels/cpu/layer_ops.cpp against the torch
expressions it replaces (kernels/layer_ops.py), bf16, on SmolLM2-135M's widths, by row count.

    python -m meshserve.bench.layer_ops_bench [--rows 1,16,64,160,512] [--json OUT]

Prints, per step and row count, microseconds per call (median of repeats) for the kernel and for
torch, and their largest difference relative to the output's largest value (the kernel rounds
where Hugging Face's bf16 model rounds, torch's expressions after each operation: a bf16 unit in
the last place or two, 0.004-0.008, is expected).
"""

from __future__ import annotations

import argparse
import sys

import torch

from meshserve.bench.report import emit_json, median_seconds
from meshserve.kernels.layer_ops import LayerOps

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def _us(f, reps: int) -> float:
    return 1e6 * median_seconds(f, reps)


def _cases(rows: int, g: torch.Generator) -> dict:
    """step -> its call on a LayerOps (a copy of the inputs it works on in place, each call)."""
    x = torch.randn(rows, HIDDEN, generator=g).bfloat16()
    w = (torch.rand(HIDDEN, generator=g) + 0.5).bfloat16()
    res = torch.randn(rows, HIDDEN, generator=g).bfloat16()
    gu = torch.randn(rows, 2 * INTER, generator=g).bfloat16()
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (rows,), generator=g)
    ang = torch.outer(torch.arange(4096).float(), torch.rand(HEAD_DIM // 2, generator=g))
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    return {
        "rms_norm": lambda ops: ops.rms_norm(x, w),
        "add_rms_norm": lambda ops: (ops.add_rms_norm_(x.clone(), r := res.clone(), w), r),
        "rope": lambda ops: (q := qkv.clone(), ops.rope_(q, pos, cos, sin, HEADS + KV_HEADS, HEAD_DIM))[0],
        "silu_mul": lambda ops: ops.silu_mul(gu),
    }


def _rel_diff(a, b) -> float:
    if isinstance(a, tuple):
        return max(_rel_diff(x, y) for x, y in zip(a, b))
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,160,512")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    kernel = LayerOps(torch.bfloat16, "cpu", 1e-5)
    if kernel.kernel is None:
        print("kernels/cpu/layer_ops.cpp is not available here (see the warning logged)", file=sys.stderr)
        return 1
    reference = LayerOps(torch.float32, "cpu", 1e-5)  # the torch expressions, whatever the dtype
    g = torch.Generator().manual_seed(0)
    out = []
    for m in [int(r) for r in a.rows.split(",")]:
        for step, call in _cases(m, g).items():
            k_us, t_us = _us(lambda: call(kernel), a.reps), _us(lambda: call(reference), a.reps)
            out.append({"step": step, "rows": m, "kernel_us": round(k_us, 1), "torch_us": round(t_us, 1),
                        "torch_over_kernel": round(t_us / k_us, 2), "max_rel_diff": round(_rel_diff(call(kernel), call(reference)), 5)})
    emit_json({"command": "python -m meshserve.bench.layer_ops_bench " + " ".join(argv or sys.argv[1:]),
               "threads": torch.get_num_threads(), "results": out}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
