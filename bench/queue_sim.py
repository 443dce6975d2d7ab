"""The scheduler's queue policy on a workload, simulated: which request leaves the queue when, for
priority against fcfs, in a second and without a mesh.

    python -m meshserve.bench.queue_sim [--workloads mixed-chat,...] [--rates 500,1000,2000] [--json OUT]

One server drains prompt tokens at `rate` per second (plus `--overhead-s` per request), one request
at a time, and takes the next one from the mesh scheduler's own queues (services/scheduler/queues.py,
the code the scheduler runs: classes, shorter prompts first, the overtaking bound). A request's
simulated TTFT is when its prompt is done. That is the part of a request's wait that the queue's
order decides when prefill is the bottleneck (a prefill worker with a backlog); decode seats and
steps shared with decodes are not modelled. Use it to see a policy change on many workloads and
loads before measuring one of them through the mesh (`meshserve bench-sched`).

Prints JSON: per workload and rate, the short requests' TTFT p99 under each policy (short: the
`short` class, else `interactive`, else prompts of at most --short-prompt-tokens, as bench-sched),
all requests' TTFT p50 / p99 / max, and the offered load (prompt tokens offered per second of
arrivals over the rate: above 1, the queue grows while requests arrive).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from meshserve.bench.workload import generate, load_workload
from meshserve.services.scheduler.queues import ClassQueues
from meshserve.shared.schemas import GenerateRequest, Sampling


def simulate(requests, rate: float, fcfs: bool, overhead_s: float = 0.05) -> list[float]:
    """Each request's simulated TTFT (seconds), in the workload's order."""
    q, t, i, ttft = ClassQueues(fcfs), 0.0, 0, [0.0] * len(requests)
    while i < len(requests) or q:
        while i < len(requests) and requests[i].arrival <= t:
            r = requests[i]
            q.push(GenerateRequest(request_id=str(i), model="m", prompt_token_ids=r.prompt,
                                   sampling=Sampling(max_tokens=r.output_len), priority=r.priority or "normal",
                                   stream_subject="-", arrival_time=r.arrival))
            i += 1
        if not q:
            t = requests[i].arrival
            continue
        head = q.heads()[0]
        q.pop(head)
        k = int(head.req.request_id)
        t += len(requests[k].prompt) / rate + overhead_s
        ttft[k] = t - requests[k].arrival
    return ttft


def short_mask(requests, short_prompt_tokens: int) -> np.ndarray:
    classes = {r.cls for r in requests}
    if "short" in classes:
        return np.array([r.cls == "short" for r in requests])
    if any(r.priority == "interactive" for r in requests):
        return np.array([r.priority == "interactive" for r in requests])
    return np.array([r.prompt_len <= short_prompt_tokens for r in requests])


def run(workload: str, rate: float, seed: int | None, short_prompt_tokens: int, overhead_s: float) -> dict:
    requests = generate(load_workload(workload), seed, vocab_size=49152)
    short = short_mask(requests, short_prompt_tokens)
    arrivals = max(r.arrival for r in requests) or 1.0
    out = {"rate": rate, "offered_load": round(sum(r.prompt_len for r in requests) / arrivals / rate, 2)}
    for policy in ("priority", "fcfs"):
        ttft = np.array(simulate(requests, rate, policy == "fcfs", overhead_s))
        out[policy] = {"short_ttft_p99_s": round(float(np.percentile(ttft[short], 99)), 2) if short.any() else None,
                       "ttft_p50_s": round(float(np.percentile(ttft, 50)), 2),
                       "ttft_p99_s": round(float(np.percentile(ttft, 99)), 2),
                       "ttft_max_s": round(float(ttft.max()), 2)}
    p, f = out["priority"]["short_ttft_p99_s"], out["fcfs"]["short_ttft_p99_s"]
    out["short_ttft_p99_fcfs_over_priority"] = round(f / p, 2) if p and f else None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m meshserve.bench.queue_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="mixed-chat,interactive-under-batch,priority-mix,short-long")
    ap.add_argument("--rates", default="500,1000,2000", help="prompt tokens per second the server drains")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--short-prompt-tokens", type=int, default=200)
    ap.add_argument("--overhead-s", type=float, default=0.05, help="seconds per request besides its tokens")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    result = {w: [run(w, float(r), a.seed, a.short_prompt_tokens, a.overhead_s) for r in a.rates.split(",")]
              for w in a.workloads.split(",")}
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
