"""`meshserve analyze-traces`: where each request's time to first token went, from the spans a mesh
wrote with `MESHSERVE_TRACE_FILE` (shared/telemetry.py: one JSON line per span, every process).

    MESHSERVE_TRACE_FILE=/tmp/spans.jsonl meshserve up ...   # then run the load
    meshserve analyze-traces /tmp/spans.jsonl [--json OUT] [--split-gap SECONDS]

A request's spans share its trace id. TTFT, from the gateway's `gateway.request` start to the end of
the worker's `prefill` span (its first token), is cut into:

- `scheduler_queue`: gateway start -> `scheduler.route` start (the class queue, admission);
- `to_worker`: route end -> the worker's `queue` span start (the message, and the step in progress
  there: the worker takes its inbox between steps);
- `worker_queue`: the `queue` span (in the worker's engine until a step admits it);
- `prefill`: the `prefill` span (the steps that compute its prompt, to the first token).

Reported per class (the gateway span's `priority`) and per run: arrivals more than --split-gap seconds
apart start a new run (a benchmark that runs a load, then the same requests alone). Requests whose
spans are incomplete (not traced end to end, or failed) are counted and left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np

PHASES = ("scheduler_queue", "to_worker", "worker_queue", "prefill", "ttft")


def breakdown(spans: list[dict]) -> tuple[list[dict], int]:
    """One row per request traced from the gateway to its first token; and how many were not."""
    traces: dict[str, dict[str, dict]] = defaultdict(dict)
    for s in spans:
        traces[s["trace_id"]].setdefault(s["name"], s)  # a re-dispatched request: its first attempt's
    rows, partial = [], 0
    for by in traces.values():
        g = by.get("gateway.request")
        if g is None:
            continue
        route, queue, prefill = by.get("scheduler.route"), by.get("queue"), by.get("prefill")
        if route is None or queue is None or prefill is None:
            partial += 1
            continue
        t0 = g["start"]
        rows.append({"start": t0 / 1e9, "priority": g["attributes"].get("priority", "normal"),
                     "prompt_tokens": g["attributes"].get("prompt_tokens"),
                     "worker": prefill["attributes"].get("worker", ""),
                     "scheduler_queue": (route["start"] - t0) / 1e9,
                     "to_worker": (queue["start"] - route["end"]) / 1e9,
                     "worker_queue": (queue["end"] - queue["start"]) / 1e9,
                     "prefill": (prefill["end"] - prefill["start"]) / 1e9,
                     "ttft": (prefill["end"] - t0) / 1e9})
    rows.sort(key=lambda r: r["start"])
    return rows, partial


def runs(rows: list[dict], gap: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    for r in rows:
        if not out or r["start"] - out[-1][-1]["start"] > gap:
            out.append([])
        out[-1].append(r)
    return out


def summary(rows: list[dict]) -> dict:
    out: dict = {"requests": len(rows)}
    for k in PHASES:
        v = np.array([r[k] for r in rows])
        out[k] = {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
                  "p99": float(np.percentile(v, 99)), "max": float(v.max())}
    workers: dict[str, int] = defaultdict(int)
    for r in rows:
        workers[r["worker"]] += 1
    out["prefilled_by"] = dict(workers)
    return out


def report(rows: list[dict], gap: float) -> dict:
    res = []
    for i, run in enumerate(runs(rows, gap)):
        classes = sorted({r["priority"] for r in run})
        res.append({"run": i, "from": run[0]["start"], "to": run[-1]["start"],
                    "classes": {c: summary([r for r in run if r["priority"] == c]) for c in classes}})
    return {"runs": res}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="meshserve analyze-traces", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", help="the MESHSERVE_TRACE_FILE a mesh wrote")
    p.add_argument("--json", metavar="OUT", help="also write the report here ('-': stdout only, no table)")
    p.add_argument("--split-gap", type=float, default=20.0, metavar="SECONDS",
                   help="arrivals further apart than this start a new run (default 20)")
    a = p.parse_args(argv)
    with open(a.traces) as f:
        spans = [json.loads(line) for line in f if line.strip()]
    rows, partial = breakdown(spans)
    if not rows:
        sys.exit(f"{a.traces}: no request traced from the gateway to its first token ({partial} partial)")
    out = report(rows, a.split_gap) | {"partial": partial}
    if a.json == "-":
        print(json.dumps(out, indent=1))
        return
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    for run in out["runs"]:
        print(f"run {run['run']}")
        for cls, s in run["classes"].items():
            print(f"  {cls}: {s['requests']} requests, prefilled by {s['prefilled_by']}")
            for k in PHASES:
                v = s[k]
                print(f"    {k:16s} mean {v['mean']:.3f}  p50 {v['p50']:.3f}  p90 {v['p90']:.3f}  p99 {v['p99']:.3f} s")
    if partial:
        print(f"{partial} requests not traced end to end (left out)")


if __name__ == "__main__":
    main()
