"""A decode step's decoder layers, fused (kernels/fused_decode.py) against the per-operation path,
on the default model, by row count (decodes of --context tokens each).

    python -m meshserve.bench.fused_decode_bench [--quantization int8] [--rows 1,4,12,16,24,32,64]
        [--context 300] [--reps 15] [--json OUT]

Prints, per row count, milliseconds per step (median of --reps) of the layers (the model's forward
without the lm_head) both ways, and `fused_max_rows`: the most rows the fused step takes on this
CPU (where `fused_ms` is null, the step runs per operation). MESHSERVE_AMX_GEMM_MIN_ROWS=0 and
MESHSERVE_INT8_BF16_MIN_ROWS=0 show what a CPU without AMX, or with AVX2 only, runs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from meshserve.bench.report import emit_json, median_seconds
from meshserve.kernels.paged_attention import AttentionMetadata

BLOCK = 16


def step_inputs(cfg, n: int, context: int) -> tuple:
    """n decodes of `context` tokens each, in blocks of their own in a zeroed arena."""
    nb = -(-context // BLOCK)
    kv = torch.zeros(cfg.num_hidden_layers, 2, nb * n * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                     dtype=torch.bfloat16)
    table = torch.arange(nb * n).view(n, nb)
    pos = torch.full((n,), context - 1)
    slots = table[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=n, decode_block_tables=table,
                             decode_context_lens=torch.full((n,), context), block_size=BLOCK)
    ids = torch.randint(100, min(cfg.vocab_size, 10000), (n,), generator=torch.Generator().manual_seed(n))
    return ids, pos, meta, kv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshserve.bench.fused_decode_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", choices=["int8"], default=None)
    ap.add_argument("--rows", default="1,4,12,16,24,32,64")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from meshserve.shared.engine.llm import LLM

    model = LLM(a.model, "bfloat16", quantization=a.quantization).engine.model
    fused = model.fused
    res: dict = {"command": "python -m meshserve.bench.fused_decode_bench " + " ".join(argv or sys.argv[1:]),
                 "threads": torch.get_num_threads(), "fused_max_rows": fused.max_rows if fused else None,
                 "results": []}
    try:
        for n in (int(r) for r in a.rows.split(",")):
            ids, pos, meta, kv = step_inputs(model.cfg, n, a.context)
            row = {"rows": n}
            for name, f in (("fused_ms", fused), ("per_operation_ms", None)):
                model.fused = f
                runs = f is None or f.applies(n, meta, kv)
                row[name] = round(1e3 * median_seconds(lambda: model(ids, pos, meta, kv), a.reps), 3) if runs else None
            res["results"].append(row)
            print(row, file=sys.stderr)
    finally:
        model.fused = fused
    emit_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
