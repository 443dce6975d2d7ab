"""`meshserve bench-sched`: the scheduling policies side by side in one run (issue 9's benchmarks).

    meshserve bench-sched [--model M] [--prefill 1 --decode 1] [--mesh-args "..."]
                          [--workloads interactive-under-batch,short-long,mixed-chat] [--num-requests N]
                          [--contexts 128,2048] [--out FILE]

For each workload, `meshserve up --scheduling priority` and then `--scheduling fcfs` run the same
requests (same seed) over HTTP, as `meshserve compare` drives the mesh; a workload with both
interactive and background classes also runs its non-background requests alone (priority), the
baseline of "interactive TTFT with the batch running". Reported per workload:
- short requests' TTFT p99 under fcfs / under priority (target >= 3) and output throughput
  priority / fcfs (target >= 0.9). Short requests: the class named `short`, else the `interactive`
  class, else prompts of at most --short-prompt-tokens;
- interactive TTFT p99 with the batch / alone (target <= 1.5; "alone": the run without the
  background class), and whether the batch completed;
- with interactive and normal classes, the normal class's TTFT p99 and longest wait under each
  policy (what its guaranteed share bounds under sustained interactive load);
- the workers' preemptions by mode and their compute yields (scheduler status, at the end of each
  run).
Then preemption costs in the in-process engine, per context length: swap (the sequence's blocks
copied to host memory and back) against recompute (its tokens prefilled again), each per
preempted token, and which one `--preemption-mode auto` picks from the measured rates.
Prints the JSON on stdout (and writes it to --out).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

from meshserve.bench.compare import add_mesh_arguments, http_run, start_mesh, stop_mesh
from meshserve.bench.loadgen import build_body, prepare_workload, quiet_http_logs, special_ids, write_json
from meshserve.bench.report import RequestResult, summarize
from meshserve.bench.workload import summary
from meshserve.shared.models_repo import DEFAULT_MODEL, context_length


def _p99_ttft(results: list[RequestResult]) -> float | None:
    return summarize(results, by_class=False)["ttft"]["p99"] if results else None


def short_of(results: list[RequestResult], short_prompt_tokens: int) -> tuple[str, list[RequestResult]]:
    classes = {r.cls for r in results}
    if "short" in classes:
        return "class short", [r for r in results if r.cls == "short"]
    if "interactive" in classes:
        return "class interactive", [r for r in results if r.cls == "interactive"]
    return f"prompts <= {short_prompt_tokens} tokens", [r for r in results if r.prompt_tokens <= short_prompt_tokens]


def _status(url: str) -> dict:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5).json().get("scheduler", {})
    except Exception:  # noqa: BLE001 - a report without it
        return {}


def mesh_run(a: argparse.Namespace, policy: str, reqs, bodies, label: str) -> tuple[list[RequestResult], dict]:
    m = copy.copy(a)
    m.mesh_args = f"{a.mesh_args or ''} --scheduling {policy}"
    up, url = start_mesh(m)
    try:
        results = http_run(url, reqs, bodies, None, a.quiet, label)
        status = _status(url)
    finally:
        stop_mesh(up)
    out = {k: status.get(k) for k in ("preemptions_by_mode", "num_priority_preemptions", "queue_wait")}
    # compute priority between the node's workers: each one's steps held back (runs, seconds)
    out["compute_yields"] = {w.get("id"): {"yields": w.get("compute_yields"), "seconds": w.get("compute_yield_s")}
                             for w in status.get("workers") or [] if isinstance(w, dict)}
    return results, out


def bench_workload(a: argparse.Namespace, name: str, tokenizer, log) -> dict:
    w = copy.copy(a)
    w.workload, w.request_rate, w.max_concurrency = name, None, None
    spec, reqs = prepare_workload(w, tokenizer.vocab_size, special_ids(tokenizer))
    bodies = [build_body(q, a.model) for q in reqs]
    out: dict = {"workload": summary(spec, reqs, a.seed), "runs": {}}
    raw: dict[str, list[RequestResult]] = {}
    for policy in a.policies:
        log(f"{name}: meshserve up --scheduling {policy} ...")
        raw[policy], status = mesh_run(a, policy, reqs, bodies, f"{name} {policy}")
        out["runs"][policy] = summarize(raw[policy]) | {"sent": len(raw[policy]), "scheduler": status}
    classes = {q.priority for q in reqs}
    if {"interactive", "background"} <= classes:
        keep = [i for i, q in enumerate(reqs) if q.priority != "background"]
        log(f"{name}: the interactive requests alone ...")
        raw["alone"], status = mesh_run(a, "priority", [reqs[i] for i in keep], [bodies[i] for i in keep],
                                        f"{name} alone")
        out["runs"]["priority_alone"] = summarize(raw["alone"]) | {"sent": len(raw["alone"]), "scheduler": status}
    which, _ = short_of(raw["priority"], a.short_prompt_tokens)
    p_short, f_short = (_p99_ttft(short_of(raw[p], a.short_prompt_tokens)[1]) if p in raw else None
                        for p in ("priority", "fcfs"))
    thr = {p: out["runs"][p]["output_throughput"] if p in raw else None for p in ("priority", "fcfs")}
    cmp = {"short_requests": which, "short_ttft_p99_s": {"priority": p_short, "fcfs": f_short},
           "short_ttft_p99_fcfs_over_priority": f_short / p_short if p_short and f_short else None,
           "output_throughput_priority_over_fcfs": thr["priority"] / thr["fcfs"] if thr["fcfs"] and thr["priority"]
           else None}
    normal = {p: [r.ttft for r in raw[p] if r.priority == "normal" and r.ok] for p in ("priority", "fcfs") if p in raw}
    if any(normal.values()) and "interactive" in classes:  # the normal class's wait beside interactive load
        cmp["normal_ttft_max_s"] = {p: max(x) if x else None for p, x in normal.items()}
        cmp["normal_ttft_p99_s"] = {p: _p99_ttft([r for r in raw[p] if r.priority == "normal" and r.ok])
                                    for p in normal}
    if "alone" in raw:
        inter = [r for r in raw["priority"] if r.priority == "interactive"]
        with_batch = _p99_ttft(inter)
        alone = _p99_ttft([r for r in raw["alone"] if r.priority == "interactive"])
        bg = [r for r in raw["priority"] if r.priority == "background"]
        cmp |= {"interactive_ttft_p99_s": {"with_batch": with_batch, "alone": alone},
                "interactive_ttft_p99_with_batch_over_alone": with_batch / alone if with_batch and alone else None,
                "batch_completed": bool(bg) and all(r.ok for r in bg)}
    out["comparison"] = cmp
    return out


def preemption_costs(a: argparse.Namespace, contexts: list[int], log) -> dict:
    """Swap against recompute in the in-process engine, per preempted token."""
    import torch

    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    log("preemption costs in the in-process engine ...")
    llm = LLM(a.model, a.dtype)
    eng = llm.engine
    sw, costs = eng.scheduler.swapper, eng.scheduler.costs
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in contexts:
        rows = {"swap_s": [], "recompute_s": []}
        for rep in range(3):  # a new prompt each time: no prefix-cache hits
            prompt = torch.randint(100, llm.tokenizer.vocab_size - 100, (n + 1,), generator=g).tolist()
            seq = eng.add_request(f"cost-{n}-{rep}", prompt, SamplingParams(max_tokens=2, temperature=0))
            t0 = time.perf_counter()
            while seq.num_computed_tokens < seq.num_prompt_tokens:  # what recomputing costs: the prefill
                eng.step()
            rows["recompute_s"].append(time.perf_counter() - t0)
            blocks, keys = list(seq.block_table), list(range(10**6 * (rep + 1), 10**6 * (rep + 1) + len(seq.block_table)))
            t0 = time.perf_counter()
            assert sw.swap_out(blocks, keys) and sw.swap_in(blocks, keys) == len(blocks)
            rows["swap_s"].append(time.perf_counter() - t0)
            costs.observe_copy(2 * len(blocks) * sw.block_bytes, rows["swap_s"][-1])  # as the engine measures it
            eng.abort(seq.request_id)
        swap_s, rec_s = min(rows["swap_s"]), min(rows["recompute_s"])
        nbytes = eng.kv_cache_manager.blocks_needed(n + 1) * sw.block_bytes
        out[str(n)] = {"tokens": n + 1, "kv_bytes": nbytes,
                       "swap_ms_per_token": 1000 * swap_s / (n + 1), "recompute_ms_per_token": 1000 * rec_s / (n + 1),
                       "recompute_over_swap": rec_s / swap_s if swap_s else None,
                       "auto_picks": costs.choose("auto", nbytes, n + 1, True)}
    out["measured_rates"] = costs.as_dict()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-sched", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--workloads", default="interactive-under-batch,short-long,mixed-chat",
                    help="comma-separated workload files or shipped names")
    ap.add_argument("--num-requests", type=int, default=None, help="shrink every workload to this many requests")
    ap.add_argument("--policies", default="priority,fcfs", type=lambda v: [p for p in v.split(",") if p],
                    help="the --scheduling runs, comma-separated (priority first; priority alone skips the fcfs "
                         "baseline, for a quicker look at interactive TTFT with the batch against alone)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--short-prompt-tokens", type=int, default=200,
                    help="short requests of a workload with no `short` or `interactive` class: prompts up to this")
    add_mesh_arguments(ap, prefill=1, decode=1)
    ap.add_argument("--contexts", default="128,2048", help="context lengths for the swap/recompute costs ('' skips)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if "priority" not in a.policies or not set(a.policies) <= {"priority", "fcfs"}:
        ap.error(f"--policies: priority, optionally with fcfs (got {','.join(a.policies)})")
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer

    log = (lambda *x: None) if a.quiet else (lambda *x: print(*x, file=sys.stderr, flush=True))
    tokenizer = load_tokenizer(a.model)
    a.max_model_len = min(a.max_model_len, context_length(a.model))
    res: dict = {"command": "meshserve bench-sched " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": a.model, "dtype": a.dtype,
                 "mesh": {"prefill": a.prefill, "decode": a.decode, "args": a.mesh_args}, "workloads": {}}
    for name in [w for w in a.workloads.split(",") if w]:
        res["workloads"][name] = bench_workload(a, name, tokenizer, log)
    if a.contexts:
        res["preemption_costs"] = preemption_costs(a, [int(x) for x in a.contexts.split(",")], log)
    res["summary"] = {name: w["comparison"] for name, w in res["workloads"].items()}
    if a.out:
        write_json(a.out, res)
    print(json.dumps(res, indent=2))
    return 0 if all(r["failed"] == 0 for w in res["workloads"].values() for r in w["runs"].values()) else 1
