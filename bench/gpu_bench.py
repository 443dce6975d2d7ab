"""The GPU benchmark: meshserve's engine on CUDA vs Hugging Face Transformers on the same GPU, one run.

    python -m meshserve.bench.gpu_bench [--json OUT] [--quick]

The model has SmolLM2-135M-Instruct's exact shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49152, tied embeddings, RoPE theta 100000) with random weights,
built in code (no hub access needed), in bf16; both systems run the same weights. Prints JSON:
- batch-1 decode: tokens/s after the first token, one request (100-token prompt, 256 tokens);
- mixed-64: engine_bench's workload (64 requests, prompts 39..1021, outputs 17..256, seeded), our
  continuous batching vs Transformers' static batches of 32: output tokens/s, TTFT, ITL;
- kernels: decode attention over the paged cache (CUDA kernel vs the torch gather + SDPA
  reference) at batch 64 x ~1024 tokens and batch 1 x 4096, with the KV bytes read per second, on a
  bf16 arena and on an int8 one (`--kv-cache-dtype int8`: rows of int8 and their scale);
- projections: int8 weights through linear_int8 (up to INT8_GEMV_ROWS rows) against bf16's
  torch GEMM, for SmolLM2's shapes, with the weight bytes read per second;
- the engine again with int8 weights and an int8 KV cache (`--quantization int8 --kv-cache-dtype
  int8`): batch-1 and mixed-64 beside bf16, and how many of the first tokens agree with bf16's.
Sized to finish in well under 4 minutes on an H200; --quick shrinks everything for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from meshserve.kernels import cuda_ops
from meshserve.kernels.paged_attention import AttentionMetadata, decode_slots_and_mask, paged_attention, quantize_kv
from meshserve.bench.attention_bench import attention_case
from meshserve.bench.engine_bench import hf_batch1, hf_static, mixed_workload, summarize
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.config import ModelConfig
from meshserve.shared.model.llama import LlamaModel

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SPECIAL = {0, 1, 2}


def build_models(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Transformers' LlamaForCausalLM with random weights, and our model over the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = LlamaForCausalLM(hf_cfg).to(dtype).eval()
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    ours = LlamaModel.from_hf(cfg, sd, dtype, device=device)
    return hf, ours, cfg


def cuda_time_ms(fn, repeat: int) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events), after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# --- the engine


def engine(model, sched: SchedulerConfig, kv_bytes: int, kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(model, EngineConfig(kv_cache_bytes=kv_bytes, kv_cache_dtype=kv_cache_dtype, scheduler=sched),
                     eos_token_ids=[2], model_name="smollm2-135m-random")


def engine_batch1(eng: LLMEngine, prompt: list[int], n: int) -> dict:
    eng.generate([prompt[:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    eng.add_request("b1", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    times = []
    while eng.has_unfinished():
        if eng.step():
            times.append(time.perf_counter())
    return {"decode_tok_s": (len(times) - 1) / (times[-1] - times[0]), "ttft_s": times[0] - t0,
            "tokens": len(times)}


def engine_mixed(eng: LLMEngine, work: list[tuple[list[int], int]]) -> dict:
    t0 = time.perf_counter()
    arrival, stamps = {}, {}
    for i, (p, o) in enumerate(work):
        rid = f"m{i}"
        eng.add_request(rid, p, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
        arrival[rid], stamps[rid] = time.perf_counter(), []
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            stamps[out.request_id].append(now)
    total = time.perf_counter() - t0
    ttfts = [s[0] - arrival[r] for r, s in stamps.items()]
    itls = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    return summarize(total, sum(len(s) for s in stamps.values()), ttfts, itls) | {
        "preemptions": eng.scheduler.num_preemptions}


# --- decode attention kernels


def bench_attention(device, batch: int, context: int, repeat: int, kv_dtype: str = "bfloat16") -> dict:
    """kv_dtype "int8": the same arena quantized as --kv-cache-dtype int8 stores it."""
    q, kv, table, ctx, bs = attention_case(device, batch, context)
    d, hkv = q.shape[-1], kv.shape[2]
    if kv_dtype == "int8":
        kv = torch.stack([quantize_kv(kv[0]), quantize_kv(kv[1])])
    scale = d ** -0.5
    empty = torch.empty(0, dtype=torch.long, device=device)
    kernel_meta = AttentionMetadata(slot_mapping=empty, num_decodes=batch, decode_block_tables=table,
                                    decode_context_lens=ctx, block_size=bs)
    slots, mask = decode_slots_and_mask(table, ctx, bs)
    ref_meta = AttentionMetadata(slot_mapping=empty, num_decodes=batch, decode_slots=slots, decode_mask=mask)
    kv_bytes = int(ctx.sum()) * 2 * hkv * kv.shape[-1] * kv.element_size()
    with torch.inference_mode():
        ours = cuda_time_ms(lambda: paged_attention(q, None, None, kv, kernel_meta, scale), repeat)
        ref = cuda_time_ms(lambda: paged_attention(q, None, None, kv, ref_meta, scale), repeat)
        diff = (paged_attention(q, None, None, kv, kernel_meta, scale).float()
                - paged_attention(q, None, None, kv, ref_meta, scale).float()).abs().max().item()
    plan = cuda_ops.decode_plan(batch, q.shape[1], hkv, d, table.shape[1] * bs, kv.dtype,
                                torch.cuda.get_device_properties(device).multi_processor_count)
    return {"batch": batch, "context_mean": float(ctx.float().mean()), "dtype": "bfloat16", "kv_dtype": kv_dtype,
            "q_heads": q.shape[1],
            "kv_heads": hkv, "head_dim": d, "block_size": bs, "partitions": plan["partitions"],
            "kv_MB": round(kv_bytes / 1e6, 2), "kernel_ms": round(ours, 4), "kernel_GB_s": round(kv_bytes / ours / 1e6, 1),
            "reference_ms": round(ref, 4), "reference_GB_s": round(kv_bytes / ref / 1e6, 1),
            "speedup": round(ref / ours, 1), "max_abs_diff": diff}


LINEAR_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                 "lm_head": (49152, 576)}


def bench_linear(device, repeat: int) -> list[dict]:
    """Each projection of the model at 1, 4, 8 and 16 rows: int8 (cuda_ops.linear_int8: one pass over
    the int8 rows up to INT8_GEMV_ROWS, else a dequantization and the GEMM) against bf16 F.linear."""
    from meshserve.kernels import int8_linear as il

    out = []
    g = torch.Generator().manual_seed(3)
    for name, (n, k) in LINEAR_SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.05
        q, s = (t.to(device) for t in il.quantize(w))
        wb = w.to(device, torch.bfloat16)
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            t8 = cuda_time_ms(lambda: cuda_ops.linear_int8(x, q, s), repeat)
            tb = cuda_time_ms(lambda: torch.nn.functional.linear(x, wb), repeat)
            out.append({"projection": name, "rows": m, "n": n, "k": k, "int8_us": round(t8 * 1e3, 2),
                        "int8_GB_s": round(n * k / t8 / 1e6, 1), "bf16_us": round(tb * 1e3, 2),
                        "bf16_GB_s": round(2 * n * k / tb / 1e6, 1), "int8_vs_bf16": round(tb / t8, 2)})
    return out


def int8_runs(cfg: ModelConfig, sd: dict, device, dtype, sched: SchedulerConfig, prompt: list[int], n: int,
              work: list[tuple[list[int], int]]) -> dict:
    """The engine with int8 weights (linear_int8 for decode steps of up to INT8_GEMV_ROWS rows) and
    an int8 KV cache on the same random weights: batch-1, mixed-64, and the greedy tokens of the
    first 8 mixed prompts against bf16's (how many of the first 8 tokens agree)."""
    q8 = LlamaModel.from_hf(cfg, sd, dtype, device=device, quantization="int8")
    out = {"quantization": "int8", "kv_cache_dtype": "int8",
           "weight_bytes": sum(t.numel() * t.element_size() for t in q8.weights.values())}
    out["batch1"] = engine_batch1(engine(q8, sched, 1 << 30, "int8"), prompt, n)
    out["mixed"] = engine_mixed(engine(q8, sched, 8 << 30, "int8"), work)
    bf = LlamaModel.from_hf(cfg, sd, dtype, device=device)
    prompts, greedy = [p for p, _ in work[:8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = engine(bf, sched, 1 << 30).generate(prompts, greedy)
    b = engine(q8, sched, 1 << 30, "int8").generate(prompts, greedy)
    out["first_tokens_agree"] = f"{sum(x[0] == y[0] for x, y in zip(a, b))}/8"
    out["tokens_agree"] = f"{sum(u == v for x, y in zip(a, b) for u, v in zip(x, y))}/{8 * 8}"
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer requests and tokens")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return {}
    device, dtype = torch.device("cuda"), torch.bfloat16
    n_req, b1_tokens, repeat = (8, 32, 5) if a.quick else (64, 256, 50)
    res: dict = {"command": "python -m meshserve.bench.gpu_bench " + " ".join(argv or sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "python": platform.python_version(),
                 "model": "SmolLM2-135M-Instruct shape, random weights", "dtype": "bfloat16",
                 "cuda_kernels": cuda_ops.available()}
    try:
        import cupy

        res["cupy"] = cupy.__version__
    except ImportError:
        res["cupy"] = None
    t0 = time.perf_counter()

    res["attention"] = [bench_attention(device, b, c, repeat, kv) for kv in ("bfloat16", "int8")
                        for b, c in ((64, 1024), (1, 4096))]
    print(json.dumps(res["attention"]), file=sys.stderr, flush=True)

    res["linear"] = bench_linear(device, repeat)
    print(json.dumps(res["linear"]), file=sys.stderr, flush=True)

    hf, ours, cfg = build_models(device, dtype, a.seed)
    work = mixed_workload(n_req, a.seed, cfg.vocab_size, SPECIAL)
    prompt1 = work[0][0][:100]
    sched = SchedulerConfig(max_num_batched_tokens=4096, prefill_chunk_size=1024, max_num_seqs=64,
                            max_prefill_tokens_with_decodes=1024)
    res["workload"] = {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                       "output_tokens": sum(o for _, o in work), "seed": a.seed}
    res["meshserve"] = {"config": {"max_num_batched_tokens": sched.max_num_batched_tokens,
                                   "prefill_chunk_size": sched.prefill_chunk_size,
                                   "max_prefill_tokens_with_decodes": sched.max_prefill_tokens_with_decodes,
                                   "max_num_seqs": sched.max_num_seqs, "block_size": 16}}
    res["meshserve"]["batch1"] = engine_batch1(engine(ours, sched, 1 << 30), prompt1, b1_tokens)
    res["meshserve"]["mixed"] = engine_mixed(engine(ours, sched, 8 << 30), work)
    print(json.dumps(res["meshserve"]), file=sys.stderr, flush=True)
    res["meshserve_int8"] = int8_runs(cfg, hf.state_dict(), device, dtype, sched, prompt1,
                                      b1_tokens, work)
    print(json.dumps(res["meshserve_int8"]), file=sys.stderr, flush=True)
    if not a.skip_hf:
        theirs = res["transformers"] = {}
        theirs["batch1"] = hf_batch1(hf, prompt1, b1_tokens)
        theirs["static"] = hf_static(hf, work, 32)
        res["ratios"] = {
            "batch1_decode": res["meshserve"]["batch1"]["decode_tok_s"] / theirs["batch1"]["decode_tok_s"],
            "mixed_output_tok_s": res["meshserve"]["mixed"]["output_tok_s"] / theirs["static"]["output_tok_s"]}
    res["ratios"] = res.get("ratios", {}) | {
        "int8_batch1_decode_vs_bf16": res["meshserve_int8"]["batch1"]["decode_tok_s"]
        / res["meshserve"]["batch1"]["decode_tok_s"],
        "int8_mixed_output_tok_s_vs_bf16": res["meshserve_int8"]["mixed"]["output_tok_s"]
        / res["meshserve"]["mixed"]["output_tok_s"]}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return res


if __name__ == "__main__":
    main()
