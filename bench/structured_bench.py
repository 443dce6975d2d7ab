"""The cost of structured output: output tokens/s with and without a JSON-schema constraint, at
batch 1 and 32, side by side in one run of the in-process engine (the same path the workers run).

    python -m meshserve.bench.structured_bench [--model M] [--dtype bfloat16] [--steps 48] [--json OUT]

Each case puts B identical chat requests in at once (seeded sampling, no EOS stop for the free
ones) and times the decode steps while all B run; tokens/s = B x those steps / their time, so
a constrained reply that ends early does not shrink the batch being measured. The constraint is
an array of at least 64 objects (it cannot end within the run), compiled before timing (llguidance's
tokenizer is built on first use). `mask_cost` = 1 - constrained / free tokens/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from meshserve.bench.report import emit_json
from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.llm_engine import EngineConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.models_repo import DEFAULT_MODEL

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                                       "maxItems": 3}},
    "required": ["name", "age", "city"], "additionalProperties": False}, "minItems": 64}


def run_case(llm: LLM, prompt: list[int], batch: int, steps: int, constrained: bool) -> dict:
    eng = llm.engine
    constraint = ("json_schema", json.dumps(SCHEMA)) if constrained else None
    seqs = [eng.add_request(f"{'c' if constrained else 'f'}{batch}-{i}-{time.monotonic_ns()}", prompt,
                            SamplingParams(max_tokens=steps + 8, temperature=0.7, seed=i, ignore_eos=not constrained,
                                           constraint=constraint)) for i in range(batch)]
    full_steps, full_s, tokens = 0, 0.0, 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        decoding = sum(1 for s in seqs if not s.is_finished and s.num_output_tokens > 0)
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        tokens += sum(len(o.new_token_ids) for o in outs)
        if decoding == batch and len(outs) == batch and full_steps < steps:
            full_steps, full_s = full_steps + 1, full_s + dt
    wall = time.perf_counter() - t0
    return {"batch": batch, "constrained": constrained, "decode_steps_timed": full_steps,
            "output_tok_s": batch * full_steps / full_s if full_s else None,
            "step_ms": 1000 * full_s / full_steps if full_steps else None,
            "all_output_tokens": tokens, "wall_s": wall,
            "finished_early": sum(1 for s in seqs if s.num_output_tokens < steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshserve.bench.structured_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per case")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    llm = LLM(a.model, a.dtype, EngineConfig(), device=a.device)
    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "List some people as JSON: name, age, "
                                                  "city and tags."}]), add_special_tokens=False)
    warm = SamplingParams(max_tokens=4, constraint=("json_schema", json.dumps(SCHEMA)))
    llm.engine.generate([prompt], warm)  # builds llguidance's tokenizer and compiles the schema
    llm.engine.generate([prompt], SamplingParams(max_tokens=4))
    cases = []
    for b in (int(x) for x in a.batches.split(",")):
        free = run_case(llm, prompt, b, a.steps, False)
        cons = run_case(llm, prompt, b, a.steps, True)
        cost = (1 - cons["output_tok_s"] / free["output_tok_s"]) if free["output_tok_s"] and cons["output_tok_s"] else None
        cases.append({"batch": b, "free": free, "json_schema": cons, "mask_cost": cost})
    emit_json({"benchmark": "structured_output", "model": a.model, "dtype": a.dtype, "device": a.device,
               "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
               "schema": SCHEMA, "cases": cases}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
