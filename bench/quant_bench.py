"""The quantization benchmark: decode speed and perplexity, bf16 against int8 weights and bf16 against
int8 KV cache, side by side in one run of the in-process engine on the same model.

    meshserve bench-quant [--model M] [--variants bfloat16,bfloat16+int8] [--kv-cache-dtypes auto,int8]
        [--prompt-tokens 128] [--tokens 128] [--concurrent 32] [--context-tokens 1024]
        [--concurrent-tokens 32] [--json OUT]
    (also: python -m meshserve.bench.quant_bench ...)

Per variant (--variants: dtype[+weight quantization]) and KV cache dtype (--kv-cache-dtypes):
- batch 1: milliseconds per token of one stream decoding --tokens tokens after a --prompt-tokens
  prompt (wall, and CPU time of the process), the weight bytes a decode step reads and the read
  bandwidth that implies;
- concurrent (--concurrent sequences, 0: skipped): decode tokens/s of that many sequences with
  --context-tokens prompts each, over --concurrent-tokens steps after every prompt is prefilled,
  with the KV bytes a step's attention reads (where an int8 KV cache pays);
- the perplexity of TEXT (a fixed text of a few hundred tokens).
Also the machine's roofline: its read bandwidth (a large tensor summed) and its matmul peak in
float32 and bfloat16 (torch's GEMM: AMX or AVX-512 where the CPU has them). Per variant and case,
`roofline` gives the bytes and FLOPs a step needs, the time each bound allows, which one binds, and
the measured time's share of the bound (1.0: at the roofline).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
import torch.nn.functional as F

from meshserve.bench.report import emit_json
from meshserve.kernels import int8_linear, linear
from meshserve.kernels.paged_attention import AttentionMetadata, PrefillChunk
from meshserve.shared.kv_layout import kv_arena_dtype, kv_arena_shape
from meshserve.shared.models_repo import DEFAULT_MODEL

TEXT = """\
The lighthouse keeper on the northern island kept a notebook of every ship that passed. In the spring of the \
year the harbour froze late, he wrote that three fishing boats had come back with empty nets, and that the baker \
in the village had started selling bread a day old at half the price. Nobody complained. The children walked to \
school along the cliff path, counting the gulls, and the teacher asked them to write down how many they saw and \
why they thought the number changed from one week to the next.

To make a simple vegetable soup, wash and chop two carrots, one onion, three potatoes and a stick of celery. Warm \
a spoon of olive oil in a large pot, add the onion and cook it slowly until it is soft. Add the other vegetables, \
cover them with water or stock, season with salt and pepper, and let the soup simmer for about twenty minutes, \
until the potatoes break when you press them with a fork.

A function that returns the largest element of a list can be written in a few lines of Python:

def largest(values):
    best = values[0]
    for v in values[1:]:
        if v > best:
            best = v
    return best

The program reads the list once, so its running time grows linearly with the length of the input. An empty list \
raises an error, which the caller should handle.

Water covers about seventy percent of the surface of the Earth. Most of it is salt water in the oceans; only a \
small part is fresh water, and much of that is frozen in glaciers and ice caps. Rivers carry rain from the \
mountains to the sea, and along the way they shape valleys, feed farms and supply the cities that grew up on \
their banks.
"""


@torch.inference_mode()
def perplexity(model, ids: list[int], kv_cache_dtype: str = "auto") -> float:
    """exp(mean negative log-likelihood) of each token after its prefix, in one forward pass. With
    an int8 KV cache every token attends over the quantized keys and values, as decode does."""
    cfg, n = model.cfg, len(ids)
    dtype = getattr(torch, kv_arena_dtype(kv_cache_dtype, model.dtype))
    kv = torch.zeros(kv_arena_shape(cfg, n, 1, dtype), dtype=dtype, device=model.device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=model.device), prefills=[PrefillChunk(0, n, n, None)])
    tokens = torch.tensor(ids, device=model.device)
    logits = model.logits(model(tokens, torch.arange(n, device=model.device), meta, kv))
    return float(torch.exp(F.cross_entropy(logits[:-1].float(), tokens[1:])))


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every projection and the lm_head (the embedding
    lookup and the norms are a few rows)."""
    total = 0
    for lin in [p for layer in model.proj for p in layer.values()] + [model.head]:
        for a in lin.__slots__:
            t = getattr(lin, a, None)
            kept_copy = a == "dequantized" or (a == "weight" and getattr(lin, "blocked", None) is not None)
            if isinstance(t, torch.Tensor) and not kept_copy:
                total += t.numel() * t.element_size()  # a plain copy kept beside the blocked one is not read
    return total


def weight_params(model) -> int:
    """Weights one token multiplies through (projections and lm_head): 2 FLOPs each."""
    return sum(lin.out_features * lin_in_features(lin) for layer in model.proj for lin in layer.values()) + \
        model.head.out_features * lin_in_features(model.head)


def lin_in_features(lin) -> int:
    for a in ("blocked", "weight", "q"):
        t = getattr(lin, a, None)
        if isinstance(t, torch.Tensor):
            return t.shape[1] if t.dim() == 2 else t.shape[1] * t.shape[3]  # blocked: [N/b, K/2, b, 2]
    raise ValueError(f"no weight in {lin!r}")


def peak_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """The best of `reps` square matmuls: what the cores can compute in `dtype` at best."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def roofline(measured_ms: float, nbytes: float, flops: float, bandwidth_gbs: float, peak: float) -> dict:
    memory_ms, compute_ms = 1000 * nbytes / 1e9 / bandwidth_gbs, 1000 * flops / 1e9 / peak
    bound = max(memory_ms, compute_ms)
    return {"mb": nbytes / 1e6, "gflop": flops / 1e9, "memory_bound_ms": memory_ms, "compute_bound_ms": compute_ms,
            "bound_by": "memory" if memory_ms >= compute_ms else "compute", "measured_ms": measured_ms,
            "of_roofline": bound / measured_ms}


def attention_flops(model, context: float) -> float:
    """One token's attention over `context` tokens: QK and PV, 2 FLOPs a multiply-add each."""
    cfg = model.cfg
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * context


def read_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """The machine's read bandwidth as torch sees it: the best of `reps` sums over a tensor far
    larger than the caches."""
    big = torch.ones((mib << 20) // 4)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.nbytes / best / 1e9


def batch1(llm, prompt: list[int], n: int) -> dict:
    """One stream: wall milliseconds per token after the first, and the process's CPU milliseconds
    per token over the same steps (on a busy machine the CPU time is closer to a quiet run's wall
    time; with more than one thread it also counts OpenMP's spin-waiting)."""
    from meshserve.shared.engine.sequence import SamplingParams

    llm.generate([prompt[:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
    c = llm.add(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    cpu = []
    while llm.engine.has_unfinished():
        llm.outputs.process(llm.engine.step())
        cpu.append(time.process_time())
    t = c.token_times
    return {"ms_per_token": 1000 * (t[-1] - t[0]) / (len(t) - 1),
            "cpu_ms_per_token": 1000 * (cpu[-1] - cpu[0]) / (len(cpu) - 1),
            "ttft_s": t[0] - c.arrival_time, "tokens": len(c.token_ids)}


def concurrent_decode(llm, prompts: list[list[int]], n: int) -> dict:
    """Decode tokens/s of len(prompts) sequences decoding together: `n` steps measured once every
    prompt is prefilled, each sequence long enough to decode through all of them (the ones
    prefilled first decode while the others prefill; then they are aborted)."""
    from meshserve.shared.engine.sequence import SamplingParams

    eng = llm.engine
    room = eng.max_model_len - max(len(p) for p in prompts) - 1
    cs = [llm.add(p, SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished() and not all(c.token_ids for c in cs):
        llm.outputs.process(eng.step())
    done0, t0, cpu0, steps = sum(len(c.token_ids) for c in cs), time.perf_counter(), time.process_time(), 0
    while steps < n and eng.has_unfinished():
        llm.outputs.process(eng.step())
        steps += 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(c.token_ids) for c in cs) - done0
    for c in cs:
        eng.abort(c.request_id)
    while eng.has_unfinished():
        llm.outputs.process(eng.step())
    context = sum(len(c.prompt_token_ids) + len(c.token_ids) for c in cs) - tokens / 2  # mean over the steps
    kv_token_bytes = eng.kv_cache[:, :, :1].numel() * eng.kv_cache.element_size()
    return {"sequences": len(prompts), "context_tokens": len(prompts[0]), "steps": steps,
            "decode_tokens_per_s": tokens / dt, "ms_per_step": 1000 * dt / max(1, steps),
            "tokens_per_step": tokens / max(1, steps),
            "cpu_ms_per_step": 1000 * cpu / max(1, steps), "kv_mb_per_step": context * kv_token_bytes / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshserve.bench.quant_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--variants", default="bfloat16,bfloat16+int8",
                    help="comma-separated dtype[+quantization] (float32, bfloat16, bfloat16+int8, float32+int8)")
    ap.add_argument("--kv-cache-dtypes", default="auto,int8", help="comma-separated KV cache dtypes (auto, int8)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded after the prompt")
    ap.add_argument("--concurrent", type=int, default=32, help="sequences decoding together (0: skip)")
    ap.add_argument("--context-tokens", type=int, default=1024, help="prompt tokens of each concurrent sequence")
    ap.add_argument("--concurrent-tokens", type=int, default=32, help="decode steps measured, concurrent")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from meshserve.shared.engine.llm import LLM

    bandwidth = read_bandwidth_gbs()
    peaks = {"float32": peak_gflops(torch.float32), "bfloat16": peak_gflops(torch.bfloat16)}
    res: dict = {"command": "python -m meshserve.bench.quant_bench " + " ".join(argv or sys.argv[1:]),
                 "model": a.model,
                 "machine": {"threads": torch.get_num_threads(), "processor": platform.processor(),
                             "read_bandwidth_gbs": bandwidth, "peak_gflops": peaks,
                             "bf16_projection_kernel": linear.kernel() is not None,
                             "int8_projection_kernel": int8_linear.kernel() is not None},
                 "variants": {}}
    for variant in a.variants.split(","):
        dtype, _, quantization = variant.partition("+")
        for kv_dtype in a.kv_cache_dtypes.split(","):
            name = variant if kv_dtype == "auto" else f"{variant}/kv-{kv_dtype}"
            llm = LLM(a.model, dtype, quantization=quantization or None, kv_cache_dtype=kv_dtype)
            text_ids = llm.tokenizer.encode(TEXT)
            prompt = (text_ids * (a.prompt_tokens // len(text_ids) + 1))[:a.prompt_tokens]
            r = batch1(llm, prompt, a.tokens)
            wbytes = weight_bytes_per_token(llm.engine.model)
            r |= {"kv_cache_dtype": kv_dtype, "weight_mb_per_token": wbytes / 1e6,
                  "implied_read_gbs": wbytes / 1e9 / (r["ms_per_token"] / 1000),
                  "memory_bound_ms_per_token": 1000 * wbytes / 1e9 / bandwidth,
                  "perplexity": perplexity(llm.engine.model, text_ids[:llm.engine.max_model_len], kv_dtype),
                  "perplexity_tokens": min(len(text_ids), llm.engine.max_model_len)}
            model, peak = llm.engine.model, peaks[dtype]  # int8 weights: the activations' dtype computes
            flops = 2 * weight_params(model)
            one = flops + attention_flops(model, a.prompt_tokens + a.tokens / 2)
            r["roofline"] = roofline(r["ms_per_token"], wbytes, one, bandwidth, peak)
            if a.concurrent:
                long = text_ids * (a.context_tokens // len(text_ids) + 2)
                prompts = [long[i:i + a.context_tokens] for i in range(a.concurrent)]  # no two share a prefix
                c = r["concurrent"] = concurrent_decode(llm, prompts, a.concurrent_tokens)
                context = a.context_tokens + a.concurrent_tokens / 2
                round_ms = 1000 * a.concurrent / c["decode_tokens_per_s"]  # every sequence one token
                c["roofline"] = roofline(round_ms, wbytes + c["kv_mb_per_step"] * 1e6,
                                         a.concurrent * (flops + attention_flops(model, context)), bandwidth, peak)
            res["variants"][name] = r
            c = r.get("concurrent")
            print(f"{name}: {r['ms_per_token']:.2f} ms/token (CPU {r['cpu_ms_per_token']:.2f}; "
                  f"{r['weight_mb_per_token']:.0f} MB of weights, "
                  f"bound {r['memory_bound_ms_per_token']:.2f} ms at {bandwidth:.1f} GB/s, "
                  f"{r['roofline']['of_roofline']:.0%} of the roofline), perplexity "
                  f"{r['perplexity']:.3f}" + (f"; {c['sequences']} x {c['context_tokens']} tokens: "
                                              f"{c['decode_tokens_per_s']:.1f} tokens/s, "
                                              f"{c['kv_mb_per_step']:.0f} MB of KV per step, "
                                              f"{c['roofline']['of_roofline']:.0%} of the roofline "
                                              f"({c['roofline']['bound_by']})" if c else ""),
                  file=sys.stderr)
            del llm
    base = res["variants"].get("bfloat16")
    if base:
        res["vs_bfloat16"] = {}
        for v, r in res["variants"].items():
            if v == "bfloat16":
                continue
            res["vs_bfloat16"][v] = {"speedup": base["ms_per_token"] / r["ms_per_token"],
                                     "perplexity_change": r["perplexity"] / base["perplexity"] - 1}
            if "concurrent" in r and "concurrent" in base:
                res["vs_bfloat16"][v]["concurrent_speedup"] = (r["concurrent"]["decode_tokens_per_s"]
                                                               / base["concurrent"]["decode_tokens_per_s"])
    emit_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
