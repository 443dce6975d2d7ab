"""`meshserve bench-soak`: a long run of load with a fault every few minutes, and what it cost.

    meshserve bench-soak [--minutes 30] [--fault-every 120] [--workload mixed-chat] [--rate R]
                         [--faults kill9:decode,kill9:scheduler,...] [--model M] [--json OUT]

One `meshserve up` (1 prefill + 1 decode worker unless --prefill/--decode say otherwise) serves
greedy requests drawn from the workload (a pool of --pool distinct requests, each run once first,
undisturbed, for its reference text), arriving as a Poisson stream at --rate for --minutes. Every
--fault-every seconds the next fault of the rotation hits: `kill9:<service>` (SIGKILL) or
`sigterm:<service>` (a drain, the rolling-restart way) on prefill, decode, kv-pool, model-loader,
scheduler, nats-server or gateway; the launcher restarts what died.

Each request ends as one of: `identical` (the reference text), `different` (a wrong text: must be
0), `failed` (an HTTP error or an SSE error event: a clear failure), `connection_lost` (its
connection dropped: allowed only for a killed gateway's clients), `cut` (the stream ended with no
finish and no error: must be 0) or `hung` (no end within --request-timeout: must be 0); one that
could not connect (a gateway restarting) is `refused`, not accepted; a mesh that stops during the run
(the launcher gave up on a service that kept dying: faults closer than 30 s apart to one service)
ends it and fails it (`mesh_stopped_at_s`). A killed gateway's clients are
those whose request ran at any time from the kill until the process was gone (a request sent in
that moment reaches the dying process's socket: `exited_after_s` says how long that was). Prints
one JSON object: the counts, TTFT and end-to-end p50/p99 before the first fault, within --window
seconds after a fault, and otherwise after; per fault, the time until a request that started
after it completed; the memory of every process at the start and at the end, and per process
(`memory_by_process`: each pid from its first to its last sample, every --memory-every seconds),
since every service is restarted by the rotation and start and end are then other processes.
Memory is RSS and PSS, PSS split into anonymous memory (a process's own heap: what a leak grows),
files and shared memory (the node's weights and KV arena, which a worker's RSS counts as it
touches them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from meshserve.bench.compare import add_mesh_arguments, start_mesh, stop_mesh
from meshserve.bench.loadgen import add_workload_arguments, build_body, prepare_workload, quiet_http_logs, \
    special_ids, write_json
from meshserve.bench.startup_bench import memory_mb, mesh_processes

SERVICES = ("prefill", "decode", "kv-pool", "model-loader", "scheduler", "nats-server", "gateway")
DEFAULT_FAULTS = ",".join([f"kill9:{s}" for s in SERVICES] + ["sigterm:decode", "sigterm:prefill"])
MUST_BE_ZERO = ("different", "cut", "hung")


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


async def one(client, url: str, body: dict, timeout: float) -> dict:
    """One streaming completion: its outcome, text, TTFT and end-to-end time."""
    import httpx

    t0 = time.monotonic()
    out = {"start": t0, "text": "", "ttft": None, "outcome": None, "answered": False}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as r:
                out["answered"] = True  # the gateway took it (a loss from here on cut a response)
                if r.status_code != 200:
                    await r.aread()
                    out["outcome"] = "failed"
                    out["error"] = f"HTTP {r.status_code}"
                    return out
                finished = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        out["outcome"], out["error"] = "failed", str(chunk["error"])[:200]
                        return out
                    for c in chunk.get("choices") or []:
                        if c.get("text"):
                            out["ttft"] = out["ttft"] or time.monotonic() - t0
                            out["text"] += c["text"]
                        finished = finished or c.get("finish_reason") is not None
                out["outcome"] = "ok" if finished else "cut"
    except TimeoutError:
        out["outcome"] = "hung"
    except httpx.ConnectError as e:  # nobody listening (a gateway restarting): never accepted
        out["outcome"], out["error"] = "refused", type(e).__name__
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        out["outcome"], out["error"] = "connection_lost", f"{type(e).__name__}: {e}"[:200]
    finally:
        out["e2e"] = time.monotonic() - t0
    return out


def fault(spec: str, up_pid: int) -> dict:
    import signal

    kind, service = spec.split(":", 1)
    names = mesh_processes(up_pid)
    name = service if service in names else f"{service}-0"
    pid = names.get(name)
    if pid is None:
        return {"fault": spec, "at": time.monotonic(), "error": f"no process {name} (restarting?)"}
    os.kill(pid, signal.SIGKILL if kind == "kill9" else signal.SIGTERM)
    return {"fault": spec, "at": time.monotonic(), "pid": pid}


def _exited(pid: int) -> bool:
    """Gone, or a zombie with no thread left (its sockets are closed then): no request reaches it any
    more. The main thread of a killed process may be a zombie while its other threads still exit,
    holding its sockets open."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X") and len(threads) <= 1


async def watch_exit(f: dict, timeout: float = 120.0) -> None:
    """Sets f["gone"] to when the process `f` hit had exited (a SIGTERM drains first: seconds)."""
    if "pid" not in f:
        return
    deadline = time.monotonic() + timeout
    while not _exited(f["pid"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    if _exited(f["pid"]):
        f["gone"] = time.monotonic()


def memory(up_pid: int) -> dict[str, dict]:
    """Every process's memory now, by name, with its pid."""
    out = {}
    for name, pid in mesh_processes(up_pid).items():
        try:
            out[name] = {"pid": pid} | memory_mb(pid)
        except OSError:
            pass
    return out


async def sample_memory(up_pid: int, every: float, samples: list[tuple[float, dict]]) -> None:
    """Appends (when, memory()) every `every` seconds, until cancelled."""
    while True:
        samples.append((time.monotonic(), await asyncio.to_thread(memory, up_pid)))
        await asyncio.sleep(every)


def memory_by_process(samples: list[tuple[float, dict]], start: float) -> list[dict]:
    """Each process (name and pid) from its first sample to its last: how its memory changed while
    it lived (a leak grows `anon_mb` within one pid; a restart starts a new entry)."""
    seen: dict[tuple[str, int], dict] = {}
    for at, mem in samples:
        for name, m in mem.items():
            e = seen.setdefault((name, m["pid"]), {"name": name, "pid": m["pid"], "from_s": round(at - start, 1),
                                                   "first": m})
            e["to_s"], e["last"] = round(at - start, 1), m
    return [{"name": e["name"], "pid": e["pid"], "from_s": e["from_s"], "to_s": e["to_s"],
             **{k: [e["first"][k], e["last"][k]] for k in e["first"] if k != "pid" and k in e["last"]}}
            for e in seen.values()]


async def soak(a, url: str, up_pid: int, bodies: list[dict]) -> dict:
    import httpx

    endpoint = url + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=1000)) as client:
        # References: each distinct request once, before any fault.
        refs = await asyncio.gather(*[one(client, endpoint, b, a.request_timeout) for b in bodies])
        bad = [r for r in refs if r["outcome"] != "ok"]
        if bad:
            raise RuntimeError(f"the undisturbed reference run failed: {bad[0]}")
        mem_start = memory(up_pid)
        samples: list[tuple[float, dict]] = []
        sampler = asyncio.ensure_future(sample_memory(up_pid, a.memory_every, samples))
        watchers = []
        rng = random.Random(a.seed or 0)
        faults = a.faults.split(",")
        start = time.monotonic()
        end = start + a.minutes * 60
        next_fault, k = start + a.fault_every, 0
        tasks, done_faults, stopped = [], [], None
        while time.monotonic() < end:
            now = time.monotonic()
            if _exited(up_pid):  # the launcher gave up on a service (or died): nothing serves any more
                stopped = now
                print(f"[{now - start:7.1f}s] meshserve up exited; the soak stops", file=sys.stderr)
                break
            if now >= next_fault:
                done_faults.append(fault(faults[k % len(faults)], up_pid))
                watchers.append(asyncio.ensure_future(watch_exit(done_faults[-1])))
                print(f"[{now - start:7.1f}s] {done_faults[-1]}", file=sys.stderr)
                k, next_fault = k + 1, next_fault + a.fault_every
            i = rng.randrange(len(bodies))
            tasks.append((i, asyncio.ensure_future(one(client, endpoint, bodies[i], a.request_timeout))))
            await asyncio.sleep(rng.expovariate(a.rate))
        results = []
        for i, t in tasks:
            r = await t
            r["ref"] = i
            results.append(r)
        await asyncio.gather(*watchers)
        sampler.cancel()
        mem_end = memory(up_pid)
        samples.append((time.monotonic(), mem_end))
    return report(a, refs, results, done_faults, start, mem_start, mem_end, samples, stopped)


def report(a, refs: list[dict], results: list[dict], faults: list[dict], start: float,
           mem_start: dict, mem_end: dict, samples: list[tuple[float, dict]] = (),
           stopped: float | None = None) -> dict:
    first = faults[0]["at"] if faults else float("inf")
    # from the kill until the process was gone: a request sent then went to the dying gateway
    gateway_kills = [(f["at"], f.get("gone", f["at"])) for f in faults if f["fault"] == "kill9:gateway"]
    counts = dict.fromkeys(("identical", "different", "failed", "connection_lost", "cut", "hung", "refused"), 0)
    phases: dict[str, dict[str, list]] = {p: {"ttft": [], "e2e": []} for p in ("before", "during", "after")}
    unexplained_lost = 0
    unusual: list[dict] = []
    for r in results:
        kind = r["outcome"]
        if kind == "ok":
            kind = "identical" if r["text"] == refs[r["ref"]]["text"] else "different"
        counts[kind] += 1
        if kind == "connection_lost" and not any(r["start"] <= gone and at <= r["start"] + r["e2e"]
                                                 for at, gone in gateway_kills):
            unexplained_lost += 1
        if kind not in ("identical", "refused"):  # each one with the fault nearest to it, to look into
            near = min(faults, key=lambda f: abs(f["at"] - r["start"]), default=None)
            unusual.append({"outcome": kind, "error": r.get("error"), "start_s": round(r["start"] - start, 3),
                            "e2e_s": round(r["e2e"], 3), "answered": r.get("answered"), "chars": len(r["text"]),
                            "nearest_fault": near and {"fault": near["fault"],
                                                       "at_s": round(near["at"] - start, 1)}})
        if kind == "identical":
            during = any(f["at"] <= r["start"] + r["e2e"] and r["start"] <= f["at"] + a.window for f in faults)
            phase = "before" if r["start"] + r["e2e"] < first else "during" if during else "after"
            phases[phase]["ttft"].append(r["ttft"])
            phases[phase]["e2e"].append(r["e2e"])
    per_fault = []
    for f in faults:
        served = [r["start"] + r["e2e"] for r in results if r["start"] >= f["at"] and r["outcome"] == "ok"]
        per_fault.append({**{k: v for k, v in f.items() if k not in ("at", "gone")}, "at_s": round(f["at"] - start, 1),
                          "exited_after_s": round(f["gone"] - f["at"], 3) if "gone" in f else None,
                          "serving_again_after_s": round(min(served) - f["at"], 2) if served else None})
    return {
        "command": "meshserve bench-soak " + " ".join(a.argv),
        "minutes": a.minutes, "fault_every_s": a.fault_every, "rate": a.rate, "pool": len(refs),
        "sent": len(results), "accepted": len(results) - counts["refused"], "outcomes": counts,
        "connection_lost_not_at_a_gateway_kill": unexplained_lost, "not_identical": unusual,
        "mesh_stopped_at_s": None if stopped is None else round(stopped - start, 1),
        "ok": all(counts[k] == 0 for k in MUST_BE_ZERO) and unexplained_lost == 0 and stopped is None,
        "latency": {p: {"n": len(v["e2e"]), "ttft_p50": _percentile(v["ttft"], 0.5),
                        "ttft_p99": _percentile(v["ttft"], 0.99), "e2e_p50": _percentile(v["e2e"], 0.5),
                        "e2e_p99": _percentile(v["e2e"], 0.99)} for p, v in phases.items()},
        "faults": per_fault, "memory_start": mem_start, "memory_end": mem_end,
        "memory_by_process": memory_by_process(list(samples), start)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-soak", description=__doc__.split("\n\n")[0])
    add_workload_arguments(ap, default_workload="mixed-chat")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults")
    ap.add_argument("--faults", default=DEFAULT_FAULTS, help="the rotation, comma-separated kind:service")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--pool", type=int, default=24, help="distinct requests (each has a reference text)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request at most")
    ap.add_argument("--window", type=float, default=30.0, help="seconds after a fault that count as 'during'")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--memory-every", type=float, default=60.0, help="seconds between memory samples")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="float32 (default): a greedy text is the same however it was batched or recomputed, so "
                         "'different' means wrong; with bfloat16 it may differ by rounding")
    add_mesh_arguments(ap, prefill=1, decode=1)
    ap.add_argument("--mesh-log", default=None, help="the mesh's log goes here (default: nowhere)")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    a.argv = argv if argv is not None else sys.argv[1:]
    for f in a.faults.split(","):
        kind, _, service = f.partition(":")
        if kind not in ("kill9", "sigterm") or service not in SERVICES:
            ap.error(f"--faults: {f!r} is not kill9:<service> or sigterm:<service>, service one of {SERVICES}")
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer

    tokenizer = load_tokenizer(a.model)
    a.num_requests = a.pool
    _, reqs = prepare_workload(a, tokenizer.vocab_size, special_ids(tokenizer))
    bodies = [build_body(q, a.model) | {"model": a.model, "temperature": 0, "max_tokens": min(q.output_len, a.max_tokens)}
              for q in reqs]
    for b in bodies:
        for k in ("top_p", "top_k", "seed", "stream_options", "priority"):
            b.pop(k, None)
    up, url = start_mesh(a)
    try:
        res = asyncio.run(soak(a, url, up.pid, bodies))
    finally:
        stop_mesh(up)
    print(json.dumps(res, indent=2))
    if a.json:
        write_json(a.json, res)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
