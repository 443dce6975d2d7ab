"""One layer's decode attention over a paged KV cache: the gather + SDPA reference vs the compiled
CPU kernel, on the same arena and block tables; with --prefill L, one prompt chunk of L queries
over --context tokens (its own last) instead: prefill_reference vs the prefill kernel.

    python -m meshserve.bench.attention_bench [--batch 48] [--context 1000] [--kv-heads 3]
        [--q-heads 9] [--head-dim 64] [--block-size 16] [--dtype bfloat16] [--kv-cache-dtype int8]
        [--repeat 20] [--prefill L]

Defaults are SmolLM2-135M at 48 sequences of ~1000 tokens (lengths spread +-5%, blocks shuffled
through the arena). Prints JSON: median milliseconds per layer of each path, the per-step cost of
the reference's slot ids and mask (made once per step, for all layers), and the max difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshserve.kernels import cpu_build
from meshserve.kernels.paged_attention import (AttentionMetadata, PrefillChunk, decode_slots_and_mask,
                                               paged_attention, prefill_kernel, prefill_reference, quantize_kv)
from meshserve.shared.kv_layout import KV_CACHE_DTYPES


def median_ms(fn, repeat: int) -> float:
    """Median wall time in ms (the minimum is less sensitive to a busy machine: see min_ms)."""
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    median_ms.last_min = min(times)
    return round(statistics.median(times), 3)


def attention_case(device, batch: int, context: int, dtype=torch.bfloat16, hkv=3, hq=9, d=64, bs=16, seed=0):
    """A decode batch whose contexts are about `context` long, through shuffled block tables: q, the
    arena [2, slots, kv_heads, head_dim], block tables, context lengths, block size."""
    g = torch.Generator().manual_seed(seed)
    spread = max(1, context // 20)
    ctx = torch.randint(context - spread, context + spread + 1, (batch,), generator=g)
    need = (ctx + bs - 1) // bs
    num_blocks = int(need.sum()) + 64
    kv = torch.randn(2, num_blocks * bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(batch, int(need.max()), dtype=torch.long)
    used = 0
    for i, nb in enumerate(need.tolist()):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    return q.to(device), kv.to(device), table.to(device), ctx.to(device), bs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="int8: the arena quantized as --kv-cache-dtype int8 stores it")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--prefill", type=int, default=0, metavar="L",
                    help="time one prompt chunk of L queries over --context tokens instead of a decode batch")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    b, hkv, hq, d, bs = args.batch, args.kv_heads, args.q_heads, args.head_dim, args.block_size

    if args.prefill:
        return prefill_main(args, dtype)
    q, kv, table, ctx, bs = attention_case("cpu", b, args.context, dtype, hkv, hq, d, bs)
    if args.kv_cache_dtype == "int8":
        kv = quantize_kv(kv)
    scale = d ** -0.5
    empty = torch.empty(0, dtype=torch.long)

    slots, mask = decode_slots_and_mask(table, ctx, bs)
    ref_meta = AttentionMetadata(slot_mapping=empty, num_decodes=b, decode_slots=slots, decode_mask=mask)
    with torch.inference_mode():
        result = {
            "shape": {"batch": b, "context_mean": float(ctx.float().mean()), "kv_heads": hkv, "q_heads": hq,
                      "head_dim": d, "block_size": bs, "dtype": args.dtype,
                      "kv_cache_dtype": args.kv_cache_dtype},
            "threads": torch.get_num_threads(),
            "kv_bytes_read_MB": round(int(ctx.sum()) * 2 * hkv * kv.shape[-1] * kv.element_size() / 1e6, 1),
            "reference_ms": median_ms(lambda: paged_attention(q, None, None, kv, ref_meta, scale), args.repeat),
            "reference_min_ms": round(median_ms.last_min, 3),
            "reference_slots_mask_per_step_ms": median_ms(lambda: decode_slots_and_mask(table, ctx, bs),
                                                          args.repeat),
        }
        want = paged_attention(q, None, None, kv, ref_meta, scale)
        t = time.perf_counter()
        kernel = cpu_build.load("meshserve_paged_attention_cpu", "paged_attention.cpp")
        result["kernel_load_s"] = round(time.perf_counter() - t, 2)
        if kernel is None:
            result["kernel_ms"] = None
        else:
            meta = AttentionMetadata(slot_mapping=empty, num_decodes=b, decode_block_tables=table,
                                     decode_context_lens=ctx, block_size=bs)
            result["kernel_ms"] = median_ms(lambda: paged_attention(q, None, None, kv, meta, scale), args.repeat)
            result["kernel_min_ms"] = round(median_ms.last_min, 3)
            result["kernel_GB_per_s"] = round(result["kv_bytes_read_MB"] / result["kernel_ms"], 2)
            got = paged_attention(q, None, None, kv, meta, scale)
            result["max_abs_diff"] = float((got.float() - want.float()).abs().max())
            result["speedup_median"] = round(result["reference_ms"] / result["kernel_ms"], 1)
            result["speedup_min"] = round(result["reference_min_ms"] / result["kernel_min_ms"], 1)
    print(json.dumps(result, indent=2))
    return result


def prefill_main(args, dtype) -> dict:
    """One chunk of --prefill queries whose context (--context tokens, the chunk's own last) lies in
    shuffled blocks: prefill_reference (gather + SDPA) against the compiled prefill kernel."""
    length, hkv, hq, d = args.prefill, args.kv_heads, args.q_heads, args.head_dim
    t = max(args.context, length)
    q, kv, table, _, bs = attention_case("cpu", 1, t, dtype, hkv, hq, d, args.block_size)
    if args.kv_cache_dtype == "int8":
        kv = quantize_kv(kv)
    pos = torch.arange(t)
    slots = table[0, pos // bs] * bs + pos % bs
    qc = torch.randn(length, hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    chunk = PrefillChunk(start=0, length=length, context_len=t, slots=slots)
    meta = AttentionMetadata(slot_mapping=slots[t - length:], prefills=[chunk])
    scale = d ** -0.5
    flops = 4 * length * hq * d * (t - length) + 2 * length * (length + 1) * hq * d  # the causal scores and sums
    with torch.inference_mode():
        ref = lambda: prefill_reference(qc, None, None, kv, chunk, slots[t - length:], scale)  # noqa: E731
        result = {"shape": {"prefill": length, "context": t, "kv_heads": hkv, "q_heads": hq, "head_dim": d,
                            "block_size": bs, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype},
                  "threads": torch.get_num_threads(),
                  "reference_ms": median_ms(ref, args.repeat)}
        result["reference_GFLOP_per_s"] = round(flops / result["reference_ms"] / 1e6, 1)
        if prefill_kernel(kv, qc) is None:
            result["kernel_ms"] = None  # not built, or not this dtype / CPU: chunks take the reference
        else:
            result["kernel_ms"] = median_ms(lambda: paged_attention(qc, None, None, kv, meta, scale), args.repeat)
            result["kernel_GFLOP_per_s"] = round(flops / result["kernel_ms"] / 1e6, 1)
            got = paged_attention(qc, None, None, kv, meta, scale)
            result["max_abs_diff"] = float((got.float() - ref().float()).abs().max())
            result["speedup_median"] = round(result["reference_ms"] / result["kernel_ms"], 2)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
