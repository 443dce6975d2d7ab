"""`meshserve compare`: one workload, in one run, against meshserve and the baselines.

    meshserve compare --workload mixed-64 [--num-requests 16] [--model M] [--dtype bfloat16]
                      [--skip-mesh] [--skip-engine] [--skip-hf] [--llama-cpp-url URL]
                      [--out docs/benchmarks/compare-<workload>.json]

Systems, in this order, each measured alone on the same requests (same seed, same weights):
- meshserve_mesh: `meshserve up` (its own nats-server and services; --prefill/--decode workers),
  driven over HTTP like `meshserve bench` (streaming, arrivals as scheduled);
- meshserve_engine: the in-process engine (meshserve.shared.engine.llm.LLM); a request is added at
  the first step boundary after its arrival time (at most --max-concurrency running); its TTFT
  counts from the scheduled arrival, so the wait for the step in progress is included;
- transformers: Hugging Face `generate` on the same weights, static batches of --hf-batch (32) in
  arrival order: when idle, it takes up to 32 requests that have arrived (waiting for the next
  arrival when none has), and each batch runs until its longest request ends (greedy decoding,
  every request padded on the left); with all-at-once arrivals that is batches of 32 in order;
- llama_cpp (with --llama-cpp-url): a running llama.cpp server, driven over HTTP like the mesh.

The engine applies the mesh's scheduling policy to the requests it holds (classes, shorter prompts
first: docs/scheduling.md); Transformers knows no priorities. Prints the ratios (a / b of the same metric:
above 1 is better for throughputs, below 1 for latencies) and writes them with every system's
numbers as JSON.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import deque
from dataclasses import fields
from pathlib import Path

from meshserve.bench.loadgen import (HTTPTarget, add_workload_arguments, build_body, new_result,
                                              prepare_workload, progress_run, quiet_http_logs, skipped, slo_of,
                                              special_ids, unfinished_by_class, write_json)
from meshserve.bench.report import RequestResult, plots, print_table, summarize
from meshserve.bench.workload import Request, summary
from meshserve.cli.errors import ArgumentParser
from meshserve.shared.models_repo import context_length

SYSTEMS = ("meshserve_mesh", "meshserve_engine", "transformers", "llama_cpp")
RATIO_METRICS = {"output_throughput": ("output_throughput",), "request_throughput": ("request_throughput",),
                 "goodput": ("goodput",), "ttft_p50": ("ttft", "p50"), "ttft_p99": ("ttft", "p99"),
                 "tpot_p50": ("tpot", "p50"), "itl_p50": ("itl", "p50"), "itl_p99": ("itl", "p99"),
                 "e2e_p50": ("e2e", "p50"), "e2e_p99": ("e2e", "p99")}
PAIRS = (("meshserve_mesh", "transformers"), ("meshserve_engine", "transformers"),
         ("meshserve_mesh", "llama_cpp"), ("meshserve_engine", "llama_cpp"), ("meshserve_mesh", "meshserve_engine"))


def _sampling_params(q: Request):
    from meshserve.shared.engine.sequence import SamplingParams

    names = {f.name for f in fields(SamplingParams)}
    return SamplingParams(max_tokens=q.output_len, **{k: v for k, v in q.sampling.items() if k in names})


# --- the in-process engine

def engine_run(llm, reqs: list[Request], max_concurrency: int | None = None) -> list[RequestResult]:
    """Adds each request at the first step boundary after its arrival; one token per request per step."""
    from meshserve.shared.engine.llm_engine import RequestError

    eng = llm.engine
    pending = deque(reqs)
    free = [0.0] * max_concurrency if max_concurrency else None  # when each slot was freed
    active: dict[str, tuple] = {}
    results: list[RequestResult] = []
    unfinished = unfinished_by_class(reqs)
    t0 = time.monotonic()  # the engine stamps tokens with time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    while pending or eng.has_unfinished():
        now = clock()
        while pending and pending[0].arrival <= now and (free is None or len(active) < max_concurrency):
            q = pending.popleft()
            if skipped(q, unfinished):
                unfinished[q.cls] -= 1
                continue
            res = new_result(q)
            res.start = max(q.arrival, heapq.heappop(free)) if free is not None else q.arrival
            try:
                c = llm.add(q.prompt, _sampling_params(q), request_id=f"compare-{q.index}")
            except RequestError as e:
                res.error, res.end = f"rejected: {e}", clock()
                results.append(res)
                unfinished[q.cls] -= 1
                if free is not None:
                    heapq.heappush(free, res.end)
                continue
            active[c.request_id] = (c, res)
        if eng.has_unfinished():
            for c in llm.outputs.process(eng.step()):
                _, res = active.pop(c.request_id)
                unfinished[res.cls] -= 1
                res.chunk_times = [t - t0 for t in c.token_times]
                res.output_tokens, res.end = len(c.token_ids), res.chunk_times[-1] if c.token_times else clock()
                res.cached_tokens = c.num_cached_tokens
                if not c.token_ids:
                    res.error = f"no output ({c.finish_reason})"
                results.append(res)
                if free is not None:
                    heapq.heappush(free, res.end)
        elif pending:
            time.sleep(max(0.0, pending[0].arrival - clock()))
    return sorted(results, key=lambda r: r.index)


def engine_warmup(llm, reqs: list[Request]) -> None:
    from meshserve.shared.engine.sequence import SamplingParams

    llm.generate([reqs[0].prompt[:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


# --- Hugging Face Transformers, static batching

def hf_run(m, reqs: list[Request], batch: int) -> list[RequestResult]:
    """Static batches: when idle, up to `batch` arrived requests in arrival order, run to the longest."""
    from meshserve.bench.engine_bench import hf_generate

    results, i, n = [], 0, len(reqs)
    t0 = time.monotonic()  # hf_generate stamps steps with time.monotonic()
    while i < n:
        wait = reqs[i].arrival - (time.monotonic() - t0)
        if wait > 0:
            time.sleep(wait)
        now = time.monotonic() - t0
        group = [q for q in reqs[i:i + batch] if q.arrival <= now]
        times = [t - t0 for t in hf_generate(m, [q.prompt for q in group], max(q.output_len for q in group))]
        for q in group:  # a request is done after its own tokens, but its batch runs on
            res = new_result(q)
            res.start, res.chunk_times = q.arrival, times[:q.output_len]
            res.output_tokens, res.end = len(res.chunk_times), res.chunk_times[-1]
            results.append(res)
        i += len(group)
    return results


# --- over HTTP: the mesh and llama.cpp

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_mesh_arguments(ap: argparse.ArgumentParser, prefill: int | None = 0, decode: int | None = 1) -> None:
    """The options of the `meshserve up` that start_mesh runs: its workers (None: the benchmark sets
    them itself), more options for it, and how long its start may take."""
    if prefill is not None:
        ap.add_argument("--prefill", type=int, default=prefill, help="mesh prefill workers (default: %(default)s)")
    if decode is not None:
        ap.add_argument("--decode", type=int, default=decode, help="mesh decode workers (default: %(default)s)")
    ap.add_argument("--mesh-args", default=None, help="more options for `meshserve up`, one string")
    ap.add_argument("--mesh-startup-timeout", type=float, default=600.0)


def start_mesh(a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`meshserve up` on free ports, as bench-mesh starts it; returns the process and its URL once healthy."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "meshserve.cli.main", "up", "--model", a.model, "--dtype", a.dtype,
           "--port", str(port), "--nats-port", str(_free_port()), "--prefill", str(a.prefill),
           "--decode", str(a.decode), *shlex.split(a.mesh_args or "")]
    log = getattr(a, "mesh_log", None)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + a.mesh_startup_timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"meshserve up exited with {up.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return up, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_mesh(up)
    raise RuntimeError("the mesh did not become healthy")


def stop_mesh(up: subprocess.Popen) -> None:
    if up.poll() is None:
        up.send_signal(2)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            up.kill()


def http_run(url: str, reqs: list[Request], bodies: list[dict], max_concurrency: int | None, quiet: bool,
             label: str, warmup: bool = True) -> list[RequestResult]:
    if warmup:
        w = dict(bodies[0], prompt=reqs[0].prompt[:8], max_tokens=2)
        w.pop("priority", None)
        progress_run(HTTPTarget(url), reqs[:1], [w], None, quiet=True)
    return progress_run(HTTPTarget(url, max_connections=len(reqs) + 4), reqs, bodies, max_concurrency, quiet, label)


# --- ratios

def _get(summary_: dict, path: tuple[str, ...]):
    x = summary_
    for k in path:
        x = x.get(k) if isinstance(x, dict) else None
    return x


def ratios(systems: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    out = {}
    for a, b in PAIRS:
        if a in systems and b in systems:
            r = {}
            for name, path in RATIO_METRICS.items():
                x, y = _get(systems[a], path), _get(systems[b], path)
                r[name] = x / y if x is not None and y else None
            out[f"{a.removeprefix('meshserve_')}_vs_{b.removeprefix('meshserve_')}"] = r
    return out


def ratio_table(systems: dict[str, dict], rat: dict):
    from rich.table import Table

    t = Table(title="meshserve compare")
    t.add_column("metric")
    for s in systems:
        t.add_column(s, justify="right")
    for pair in rat:
        t.add_column(pair, justify="right")
    for name, path in RATIO_METRICS.items():
        vals = [_get(systems[s], path) for s in systems]
        rs = [rat[p][name] for p in rat]
        t.add_row(name, *[("-" if v is None else f"{v:.3f}") for v in vals],
                  *[("-" if v is None else f"{v:.2f}x") for v in rs])
    t.add_row("failed", *[str(systems[s]["failed"]) for s in systems], *[""] * len(rat))
    return t


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="meshserve compare", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(ap, default_workload="mixed-64")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-mesh", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--llama-cpp-url", default=None, help="also measure this llama.cpp server (OpenAI API)")
    ap.add_argument("--hf-batch", type=int, default=32, help="Transformers' static batch size")
    add_mesh_arguments(ap, prefill=0, decode=1)  # as bench-mesh
    ap.add_argument("--out", default=None, help="JSON file (default: docs/benchmarks/compare-<workload>.json)")
    ap.add_argument("--plots", default=None, help="PNG plots per system into DIR/<system>/")
    ap.add_argument("--per-request", action="store_true", help="also write every request's numbers")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    quiet_http_logs()

    import torch

    from meshserve.shared.models_repo import load_tokenizer

    tokenizer = load_tokenizer(a.model)
    a.max_model_len = min(a.max_model_len, context_length(a.model))
    spec, reqs = prepare_workload(a, tokenizer.vocab_size, special_ids(tokenizer))
    bodies = [build_body(q, a.model) for q in reqs]
    for b in bodies:
        b["model"] = a.model  # one model here: a multi-model workload's names all go to it
    cap = spec.arrival.max_concurrency
    log = (lambda *x: None) if a.quiet else (lambda *x: print(*x, file=sys.stderr, flush=True))
    res: dict = {"command": "meshserve compare " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": a.model, "dtype": a.dtype,
                 "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                             "processor": platform.processor()},
                 "workload": summary(spec, reqs, a.seed) | {"max_model_len": a.max_model_len},
                 "slo": slo_of(a), "systems": {}}
    raw: dict[str, list[RequestResult]] = {}
    if not a.skip_mesh:
        log(f"meshserve up --prefill {a.prefill} --decode {a.decode} ...")
        up, url = start_mesh(a)
        try:
            raw["meshserve_mesh"] = http_run(url, reqs, bodies, cap, a.quiet, "mesh")
        finally:
            stop_mesh(up)
        res["mesh"] = {"prefill": a.prefill, "decode": a.decode, "args": a.mesh_args}
    if not a.skip_engine:
        from meshserve.shared.engine.llm import LLM

        log("in-process engine ...")
        llm = LLM(a.model, a.dtype)
        engine_warmup(llm, reqs)
        raw["meshserve_engine"] = engine_run(llm, reqs, cap)
        del llm
        gc.collect()
    if not a.skip_hf:
        from meshserve.bench.engine_bench import load_hf

        log(f"Transformers, static batches of {a.hf_batch} ...")
        m = load_hf(a.model, a.dtype)
        from meshserve.bench.engine_bench import hf_generate

        hf_generate(m, [reqs[0].prompt[:8]], 4)  # warm up
        raw["transformers"] = hf_run(m, reqs, a.hf_batch)
        res["transformers"] = {"batch_size": a.hf_batch}
        del m
        gc.collect()
    if a.llama_cpp_url:
        log(f"llama.cpp at {a.llama_cpp_url} ...")
        raw["llama_cpp"] = http_run(a.llama_cpp_url, reqs, bodies, cap, a.quiet, "llama.cpp")
    for name, results in raw.items():
        res["systems"][name] = summarize(results, slo_of(a))
        if a.plots:
            res["systems"][name]["plots"] = plots(results, Path(a.plots) / name, title=f"{spec.name} {name}")
        if a.per_request:
            res["systems"][name]["per_request"] = [r.record() for r in results]
    res["ratios"] = ratios(res["systems"])
    out = a.out or f"docs/benchmarks/compare-{spec.name}.json"
    write_json(out, res)
    if not a.quiet:
        print_table(ratio_table(res["systems"], res["ratios"]))
        log(f"written to {out}")
    print(json.dumps(res, indent=2))
    return 0 if raw and all(s["completed"] for s in res["systems"].values()) else 1
