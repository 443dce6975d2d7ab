"""`meshserve bench-roles`: elastic prefill/decode roles against fixed splits, side by side.

    meshserve bench-roles --workload traffic-shift --workers 2 [--num-requests N] [--model M]
                          [--mesh-args "..."] [--out FILE]

On the same requests (same seed), one `meshserve up` per configuration, each alone: `elastic`
(starting at 1 prefill + N-1 decode workers, roles following the traffic) and every fixed split
`fixed-P:D` with P + D = N workers (P = 0: the decode workers prefill too). Prints one JSON
object: per configuration its throughputs and the role switches the scheduler made, and elastic
against the best and the worst fixed split (output throughput ratios).
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

from meshserve.bench.compare import add_mesh_arguments, http_run, start_mesh, stop_mesh
from meshserve.bench.loadgen import add_workload_arguments, build_body, prepare_workload, quiet_http_logs, slo_of, \
    special_ids, write_json
from meshserve.bench.report import summarize
from meshserve.bench.workload import summary
from meshserve.shared.models_repo import context_length


def configurations(n: int) -> list[tuple[str, int, int, bool]]:
    """(name, prefill, decode, elastic) for n workers."""
    fixed = [(f"fixed-{p}:{n - p}", p, n - p, False) for p in range(n)]
    return [("elastic", 1, n - 1, True)] + fixed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-roles", description=__doc__.split("\n\n")[0])
    add_workload_arguments(ap, default_workload="traffic-shift")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--workers", type=int, default=2, help="workers on the node (at least 2)")
    ap.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    add_mesh_arguments(ap, prefill=None, decode=None)  # the workers are the benchmark's to set
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.workers < 2:
        ap.error("--workers: at least 2 (one worker has no role to switch)")
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer

    tokenizer = load_tokenizer(a.model)
    a.max_model_len = min(a.max_model_len, context_length(a.model))
    spec, reqs = prepare_workload(a, tokenizer.vocab_size, special_ids(tokenizer))
    bodies = [build_body(q, a.model) | {"model": a.model} for q in reqs]
    res: dict = {"command": "meshserve bench-roles " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": a.model, "workers": a.workers,
                 "workload": summary(spec, reqs, a.seed) | {"max_model_len": a.max_model_len}, "configurations": {}}
    only = set(a.only.split(",")) if a.only else None
    extra = a.mesh_args or ""
    for name, p, d, elastic in configurations(a.workers):
        if only and name not in only:
            continue
        print(f"{name}: meshserve up --prefill {p} --decode {d}{'' if elastic else ' --fixed-roles'} ...",
              file=sys.stderr, flush=True)
        run = argparse.Namespace(model=a.model, dtype=a.dtype, prefill=p, decode=d,
                                 mesh_startup_timeout=a.mesh_startup_timeout,
                                 mesh_args=f"{extra} {'' if elastic else '--fixed-roles'}".strip())
        up, url = start_mesh(run)
        try:
            results = http_run(url, reqs, bodies, spec.arrival.max_concurrency, a.quiet, name)
            status = httpx.get(url + "/health", timeout=10).json()["scheduler"]
        finally:
            stop_mesh(up)
        s = summarize(results, slo_of(a))
        res["configurations"][name] = {
            "prefill": p, "decode": d, "elastic": elastic, "failed": s["failed"],
            "failure_reasons": s["failures"]["reasons"],
            "output_throughput": s["output_throughput"], "request_throughput": s["request_throughput"],
            "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"], "role_switches": status["role_switches"],
            "switches": status["recent_role_switches"], "final_roles": sorted(w["role"] for w in status["workers"])}
    cs = res["configurations"]
    fixed = {k: v["output_throughput"] for k, v in cs.items() if not v["elastic"] and v["output_throughput"]}
    if "elastic" in cs and fixed:
        best, worst = max(fixed, key=fixed.get), min(fixed, key=fixed.get)
        e = cs["elastic"]["output_throughput"]
        res["elastic_vs_best_fixed"] = {"best": best, "ratio": e / fixed[best]}
        res["elastic_vs_worst_fixed"] = {"worst": worst, "ratio": e / fixed[worst]}
    print(json.dumps(res, indent=1))
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
