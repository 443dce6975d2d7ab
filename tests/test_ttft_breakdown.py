"""`meshserve analyze-traces` (bench/ttft_breakdown.py) on spans written as shared/telemetry.py's
file exporter writes them: the phases add up to the TTFT, runs split at gaps, partial traces counted."""

import json
import subprocess
import sys

from meshserve.bench.ttft_breakdown import breakdown, report

S = 1_000_000_000  # nanoseconds


def request(trace: str, t0: float, priority: str, phases=(0.1, 0.2, 0.05, 0.4), complete=True) -> list[dict]:
    sched, to_worker, wq, prefill = phases
    at = t0 * S
    route = at + sched * S
    queue = route + 0.001 * S + to_worker * S
    spans = [{"name": "gateway.request", "trace_id": trace, "start": at, "end": queue + 9 * S,
              "attributes": {"priority": priority, "prompt_tokens": 50}},
             {"name": "scheduler.route", "trace_id": trace, "start": route, "end": route + 0.001 * S, "attributes": {}},
             {"name": "queue", "trace_id": trace, "start": queue, "end": queue + wq * S, "attributes": {}}]
    if complete:
        spans.append({"name": "prefill", "trace_id": trace, "start": queue + wq * S,
                      "end": queue + (wq + prefill) * S, "attributes": {"worker": "w-prefill"}})
    return spans


def test_phases_add_up_and_runs_split_at_gaps(tmp_path):
    spans = (request("a", 0, "interactive") + request("b", 1, "background", (5.0, 0.5, 1.0, 2.0))
             + request("c", 100, "interactive", (0.0, 0.01, 0.0, 0.3)) + request("d", 101, "interactive", complete=False))
    rows, partial = breakdown(spans)
    assert partial == 1 and [r["priority"] for r in rows] == ["interactive", "background", "interactive"]
    for r in rows:
        parts = r["scheduler_queue"] + r["to_worker"] + r["worker_queue"] + r["prefill"]
        assert abs(parts + 0.001 - r["ttft"]) < 1e-6  # the route span's own millisecond
    out = report(rows, gap=20)
    assert [sorted(run["classes"]) for run in out["runs"]] == [["background", "interactive"], ["interactive"]]
    assert abs(out["runs"][0]["classes"]["background"]["scheduler_queue"]["mean"] - 5.0) < 1e-9
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    cli = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "analyze-traces", str(path), "--json", "-"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["partial"] == 1
