"""The projection benchmark: kernels/cpu/linear.cpp on the blocked layout against F.linear on the
plain weight and oneDNN's packed GEMM (a private re-laid-out copy), on SmolLM2-135M's shapes; and
what a bf16 model on this machine picks by row count (kernels/cpu_build.amx_gemm): the kernel, or
the GEMM with the weight copied back to plain (`gemm_relayout_ms`) on a CPU with AMX. The same for
int8 weights: kernels/cpu/int8_linear.cpp against the GEMM on the weight dequantized per call
(and, on a CPU with AVX-512 VNNI, against its own AVX2 tiles).

    python -m meshserve.bench.linear_bench [--rows 1,4,16,64,192,512] [--json OUT]

Prints, per shape and row count, milliseconds per product (median of repeats) and the largest
difference from the fp32 product rounded to bf16.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from meshserve.kernels import cpu_build, int8_linear
from meshserve.kernels.linear import Linear, block_weights, from_blocked, kernel
from meshserve.bench.report import emit_json, median_seconds

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _ms(f, reps: int) -> float:
    return 1000 * median_seconds(f, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,192,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if kernel() is None:
        print("kernels/cpu/linear.cpp is not available here (no AVX-512 BF16, or not buildable)", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        lin = Linear.of(block_weights({name: w}, [name]), name)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        q, scale = int8_linear.quantize(w.float())
        q8 = int8_linear.Int8Linear(scale, blocked=int8_linear.to_blocked(q))
        for m in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(m, k, generator=g).bfloat16()
            out = torch.empty(m, n, dtype=torch.bfloat16)
            reps = max(3, a.reps // 4) if n * m > 5_000_000 else a.reps
            row = {"shape": name, "n": n, "k": k, "rows": m,
                   "blocked_ms": _ms(lambda: lin.kernel.linear_bf16(out, x, lin.blocked, None), reps),
                   "gemm_relayout_ms": _ms(lambda: F.linear(x, from_blocked(lin.blocked)), reps),
                   "f_linear_ms": _ms(lambda: F.linear(x, w), reps),
                   "onednn_packed_ms": _ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                           reps),
                   "path": "amx-gemm" if cpu_build.amx_gemm(m) else "kernel"}
            if q8.kernel is not None:
                row["int8_kernel_ms"] = _ms(lambda: q8.kernel.linear_int8(out, x, q8.blocked, q8.scale, None), reps)
                if q8.kernel.uses_vnni():  # the AVX2 tiles it would run without VNNI, beside
                    q8.kernel.set_vnni(False)
                    row["int8_avx2_ms"] = _ms(lambda: q8.kernel.linear_int8(out, x, q8.blocked, q8.scale, None), reps)
                    q8.kernel.set_vnni(True)
                row["int8_gemm_ms"] = _ms(lambda: F.linear(x, q8.weight(torch.bfloat16)), reps)
            row["blocked_vs_packed"] = row["blocked_ms"] / row["onednn_packed_ms"]
            lin.kernel.linear_bf16(out, x, lin.blocked, None)
            row["max_abs_diff"] = (out.float() - F.linear(x.float(), w.float()).bfloat16().float()).abs().max().item()
            rows.append(row)
            print(f"{name:8s} {m:4d} rows: blocked {row['blocked_ms']:8.3f} ms  GEMM+relayout {row['gemm_relayout_ms']:8.3f}"
                  f"  F.linear {row['f_linear_ms']:8.3f}  oneDNN packed {row['onednn_packed_ms']:8.3f}"
                  + (f"  int8 kernel {row['int8_kernel_ms']:8.3f}  int8 GEMM {row['int8_gemm_ms']:8.3f}"
                     if "int8_kernel_ms" in row else "")
                  + (f"  int8 AVX2 {row['int8_avx2_ms']:8.3f}" if "int8_avx2_ms" in row else "")
                  + f"  [{row['path']}]", file=sys.stderr)
    res = {"command": "python -m meshserve.bench.linear_bench " + " ".join(argv or sys.argv[1:]),
           "threads": torch.get_num_threads(), "amx_gemm_min_rows": cpu_build.amx_gemm_min_rows(), "results": rows}
    emit_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
