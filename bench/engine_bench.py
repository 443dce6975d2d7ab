"""The engine benchmark: meshserve's in-process engine vs Hugging Face Transformers, one run.

    meshserve bench-engine [--model M] [--dtype bfloat16] [--json OUT]

Two measurements, each on both systems with the same weights:
- batch-1 decode: one request, tokens/s after the first token;
- mixed-64: 64 requests, prompts of 39..1021 tokens and outputs of 17..256 (seeded), all submitted
  at once. meshserve uses continuous batching; Transformers uses static batches of 32 in arrival
  order (each batch runs until its longest request ends). Reports output tokens/s, TTFT and
  inter-token latency percentiles.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import torch

from meshserve.bench.report import emit_json
from meshserve.cli.errors import ArgumentParser
from meshserve.shared.engine.llm import DTYPES, LLM
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.kv_layout import KV_CACHE_DTYPES
from meshserve.shared.model.config import QUANTIZATIONS
from meshserve.shared.models_repo import DEFAULT_MODEL, resolve


def mixed_workload(n: int, seed: int, vocab: int, special: set[int]) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: prompts 39..1021 tokens, outputs 17..256, seeded."""
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(vocab) if t not in special])
    plens = rng.integers(39, 1022, n)
    olens = rng.integers(17, 257, n)
    return [(rng.choice(allowed, int(p)).tolist(), int(o)) for p, o in zip(plens, olens)]


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(total_s: float, out_tokens: int, ttfts: list[float], itls: list[float]) -> dict:
    return {"wall_s": total_s, "output_tokens": out_tokens, "output_tok_s": out_tokens / total_s,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "itl_p50_s": pct(itls, 50), "itl_p99_s": pct(itls, 99)}


# --- meshserve engine

def engine_batch1(llm: LLM, prompt: list[int], n: int) -> dict:
    llm.generate([prompt[:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
    c = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    t = c.token_times
    return {"decode_tok_s": (len(t) - 1) / (t[-1] - t[0]), "ttft_s": t[0] - c.arrival_time}


def engine_mixed(llm: LLM, work: list[tuple[list[int], int]]) -> dict:
    t0 = time.monotonic()
    cs = [llm.add(p, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)) for p, o in work]
    llm.run()
    total = time.monotonic() - t0
    ttfts = [c.token_times[0] - c.arrival_time for c in cs]
    itls = [b - a for c in cs for a, b in zip(c.token_times, c.token_times[1:])]
    return summarize(total, sum(len(c.token_ids) for c in cs), ttfts, itls) | {
        "preemptions": llm.engine.scheduler.num_preemptions}


# --- Hugging Face Transformers

class _StepClock:
    """A logits processor that only records when each generation step's logits are ready."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.monotonic())
        return scores


def load_hf(model: str, dtype: str):
    from transformers import AutoModelForCausalLM

    path = resolve(model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if path.suffix == ".gguf" else path
    m = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32, **kw).to(DTYPES[dtype]).eval()
    return m


def hf_generate(m, prompts: list[list[int]], max_new: int) -> list[float]:
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=m.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=m.device)
    clock = _StepClock()
    with torch.inference_mode():
        m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                   do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    return clock.times


def hf_batch1(m, prompt: list[int], n: int) -> dict:
    hf_generate(m, [prompt[:8]], 4)
    t0 = time.monotonic()
    t = hf_generate(m, [prompt], n)
    return {"decode_tok_s": (len(t) - 1) / (t[-1] - t[0]), "ttft_s": t[0] - t0, "tokens": len(t)}


def hf_static(m, work: list[tuple[list[int], int]], batch: int) -> dict:
    hf_generate(m, [work[0][0][:8]], 2)  # warm-up
    t0 = time.monotonic()
    ttfts, itls, out = [], [], 0
    for i in range(0, len(work), batch):
        group = work[i:i + batch]
        times = hf_generate(m, [p for p, _ in group], max(o for _, o in group))
        for _, o in group:  # each request is done after its own o tokens, but waits for the batch
            ttfts.append(times[0] - t0)
            itls += [b - a for a, b in zip(times[:o], times[1:o])]
            out += o
    return summarize(time.monotonic() - t0, out, ttfts, itls) | {"batch_size": batch}


def add_workload_arguments(ap: argparse.ArgumentParser) -> None:
    """Model and mixed workload, the same for every benchmark that compares against this one."""
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="meshserve's weights (Transformers always runs the source weights)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="meshserve's KV cache (auto: the model's dtype)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=64)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="meshserve bench-engine", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(ap)
    ap.add_argument("--batch1-tokens", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true", help="measure meshserve only")
    ap.add_argument("--only", choices=["batch1", "mixed"], default=None, help="run one measurement")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)

    from meshserve.shared.engine.llm_engine import EngineConfig
    from meshserve.shared.engine.scheduler import SchedulerConfig

    sched = SchedulerConfig()
    if a.max_num_batched_tokens:
        sched.max_num_batched_tokens = sched.prefill_chunk_size = a.max_num_batched_tokens
    if a.max_prefill_tokens_with_decodes:
        sched.max_prefill_tokens_with_decodes = a.max_prefill_tokens_with_decodes
    llm = LLM(a.model, a.dtype, EngineConfig(scheduler=sched), quantization=a.quantization,
              kv_cache_dtype=a.kv_cache_dtype)
    special = set(llm.tokenizer.eos_token_ids) | {llm.tokenizer.bos_token_id or 0}
    work = mixed_workload(a.num_requests, a.seed, llm.engine.model.cfg.vocab_size, special)
    prompt1 = work[0][0][:100]
    res: dict = {"command": "meshserve bench-engine " + " ".join(argv or sys.argv[1:]),
                 "model": a.model, "dtype": a.dtype, "quantization": a.quantization,
                 "kv_cache_dtype": a.kv_cache_dtype, "machine": {"cpus": torch.get_num_threads(),
                                                                 "processor": platform.processor()},
                 "workload": {"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                              "output_tokens": sum(o for _, o in work), "seed": a.seed}}
    do_b1, do_mixed = a.only in (None, "batch1"), a.only in (None, "mixed")
    res["meshserve"] = {"config": {"max_num_batched_tokens": sched.max_num_batched_tokens,
                                   "max_prefill_tokens_with_decodes": sched.max_prefill_tokens_with_decodes,
                                   "max_num_seqs": sched.max_num_seqs}}
    if do_b1:
        res["meshserve"]["batch1"] = engine_batch1(llm, prompt1, a.batch1_tokens)
    if do_mixed:
        res["meshserve"]["mixed"] = engine_mixed(llm, work)
    print(json.dumps(res["meshserve"]), file=sys.stderr)
    if not a.skip_hf:
        del llm
        m = load_hf(a.model, a.dtype)
        ours, theirs, res["ratios"] = res["meshserve"], {}, {}
        if do_b1:
            theirs["batch1"] = hf_batch1(m, prompt1, a.batch1_tokens)
            res["ratios"]["batch1_decode"] = ours["batch1"]["decode_tok_s"] / theirs["batch1"]["decode_tok_s"]
        if do_mixed:
            theirs["static"] = hf_static(m, work, a.hf_batch) | {"batch_size": a.hf_batch}
            res["ratios"]["mixed_output_tok_s"] = ours["mixed"]["output_tok_s"] / theirs["static"]["output_tok_s"]
        res["transformers"] = theirs
    emit_json(res, a.json)
    return 0
