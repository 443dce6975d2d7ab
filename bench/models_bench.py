"""`meshserve bench-models`: many models on one mesh, a budget against every model resident and against
restarting a one-model server per switch (issue 12).

    meshserve bench-models [--model M] [--num-models 4] [--budget-models 2] [--decode 2]
                           [--workload multi-model] [--num-requests N] [--mesh-args "..."] [--out FILE]

Makes `--num-models` distinct models from `--model` (hard-linked copies of its file or directory
under a temporary directory: distinct paths are distinct models to the loader, each prepared and
kept on its own), writes a manifest, and runs the shipped `multi-model` workload (Zipf popularity;
its model names are replaced by these models, in order) twice through `meshserve up --models`:

- `resident`: no weights budget (the ceiling: every model stays mapped once loaded);
- `budget`: `--weights-memory-gb` holding `--budget-models` models (measured in the first run) and a
  host tier holding one.

- `restart`: what llama.cpp's router or Ollama (one model loaded at a time) do: a one-model
  `meshserve up --model M` serves the requests, in arrival order; a request for another model
  waits until the running ones finish, the server stops and one for that model starts (its start
  is in the TTFT of every request that waited for it: TTFT counts from the request's arrival).
  The first model's server starts before the clock does, as the meshes do. `--no-restart` skips it.

Reported per run: the loader's hot-tier hit rate (loads that found the model mapped / all loads;
for `restart`: requests that found their model's server running / all requests), loads by tier and
evictions (`restart`: restarts and their seconds), the scheduler's model switches (by reason: "no
worker", "traffic") and each model's workers at the end, and TTFT p50/p99
per model; then the budget run and the restart run over the resident one.
Prints the JSON on stdout (and writes it to --out).

Instead of the workload (bench/model_loads_bench.py):

    meshserve bench-models --tier-load-times [--tier-models smollm2-135m-instruct,random-1b] [--repeat 3]
    meshserve bench-models --cold-ttft [--cold-model random-1b] [--cold-prompt-tokens 256] [--cold-repeat 2]

the load time of each model from each tier (source, disk, host), and a cold model's TTFT with and
without layered loading; `random-1b` is a random ~1B-parameter model the benchmark writes itself.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshserve.bench import model_loads_bench
from meshserve.bench.compare import add_mesh_arguments, http_run, start_mesh, stop_mesh
from meshserve.bench.loadgen import (HTTPTarget, build_body, measure, new_result, prepare_workload, quiet_http_logs,
                                     special_ids, workload_arg, write_json)
from meshserve.bench.report import RequestResult, summarize
from meshserve.bench.workload import summary
from meshserve.shared.models_repo import DEFAULT_MODEL, resolve

GB = 1 << 30


def copies(model: str, n: int, into: Path) -> list[Path]:
    """n distinct paths holding the model (hard links where the filesystem allows, else copies)."""
    src = resolve(model)
    out = []
    for i in range(n):
        dst = into / f"m{i}-{src.name}"
        if src.is_dir():
            shutil.copytree(src, dst, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)
        out.append(dst)
    return out


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def loader_numbers(status: dict) -> dict:
    """Hit rate, loads by tier and evictions from the model-loaders' status (scheduler's `loaders`)."""
    hits = loads = evictions = 0
    by_tier: dict[str, int] = {}
    per_model: dict[str, dict] = {}
    for node in (status.get("loaders") or {}).values():
        for m in node.get("models", []):
            hits += m.get("hits", 0)
            evictions += m.get("evictions", 0)
            for tier, k in m.get("loads", {}).items():
                by_tier[tier] = by_tier.get(tier, 0) + k
                loads += k
            per_model[m["name"]] = {"tier": m["tier"], "bytes": m["bytes"], "loads": m.get("loads", {}),
                                    "load_s": m.get("load_s", {}), "hits": m.get("hits", 0),
                                    "evictions": m.get("evictions", 0)}
    return {"hot_tier_hit_rate": hits / (hits + loads) if hits + loads else None, "hits": hits, "loads": loads,
            "loads_by_tier": by_tier, "evictions": evictions, "models": per_model}


def errors(results: list[RequestResult]) -> list[str]:
    """The distinct errors of the failed requests (a few)."""
    return list(dict.fromkeys(r.error for r in results if r.error))[:3]


def per_model_ttft(results: list[RequestResult]) -> dict[str, dict]:
    out = {}
    for name in sorted({r.model for r in results if r.model}):
        s = summarize([r for r in results if r.model == name], by_class=False)
        out[name] = {"requests": s.get("completed", 0) + s.get("failed", 0), "failed": s.get("failed", 0),
                     "ttft_p50_s": s["ttft"]["p50"], "ttft_p99_s": s["ttft"]["p99"]}
    return out


def _status(url: str) -> dict:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5).json().get("scheduler", {})
    except Exception:  # noqa: BLE001 - a report without it
        return {}


def run(a: argparse.Namespace, label: str, manifest: Path, budget: list[str], reqs, bodies) -> dict:
    m = copy.copy(a)
    m.mesh_args = f"{a.mesh_args or ''} --models {manifest} --fixed-roles " + " ".join(budget)
    up, url = start_mesh(m)
    try:
        results = http_run(url, reqs, bodies, None, a.quiet, label)
        status = _status(url)
    finally:
        stop_mesh(up)
    s = summarize(results)
    return {"mesh_args": m.mesh_args.strip(), "completed": s.get("completed"), "failed": s.get("failed"),
            "ttft": s["ttft"], "output_throughput": s.get("output_throughput"),
            "model_switches": status.get("model_switches"),
            "model_switches_by_reason": status.get("model_switches_by_reason"),
            "workers_at_end": {n: m.get("workers") for n, m in (status.get("models") or {}).items()},
            "loader": loader_numbers(status),
            "per_model": per_model_ttft(results), "errors": errors(results)}


def _one_model(a: argparse.Namespace, path: Path, name: str) -> argparse.Namespace:
    """`meshserve up` serving that one model under its name (a manifest of one)."""
    manifest = path.parent / f"one-{name}.yaml"
    manifest.write_text(f"- {{name: {name}, path: '{path}'}}\n")
    m = copy.copy(a)
    m.model = str(path)
    m.mesh_args = f"{a.mesh_args or ''} --models {manifest} --fixed-roles"
    return m


async def _restarting(a: argparse.Namespace, paths: dict[str, Path], reqs, bodies) -> tuple[list[RequestResult], dict]:
    """The requests through a one-model server restarted whenever the requested model changes."""
    model = reqs[0].model
    up, url = start_mesh(_one_model(a, paths[model], model))  # before the clock, as the meshes start
    target = HTTPTarget(url, max_connections=len(reqs) + 4)
    await target.__aenter__()
    inflight: set[asyncio.Task] = set()
    results, restarts, hits = [], [], 0
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    try:
        for req, body in zip(reqs, bodies):
            delay = req.arrival - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if req.model != model:  # the running requests finish, then the server for this model starts
                if inflight:
                    await asyncio.wait(inflight)
                await target.__aexit__(None, None, None)
                s = time.perf_counter()
                await asyncio.to_thread(stop_mesh, up)
                model = req.model
                up, url = await asyncio.to_thread(start_mesh, _one_model(a, paths[model], model))
                restarts.append(time.perf_counter() - s)
                target = HTTPTarget(url, max_connections=len(reqs) + 4)
                await target.__aenter__()
            else:
                hits += 1
            res = new_result(req)
            results.append(res)
            task = asyncio.ensure_future(measure(target, body, res, clock))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight)
    finally:
        await target.__aexit__(None, None, None)
        stop_mesh(up)
    for r in results:  # from its arrival: a request that waited for a restart waited for its server
        if r.start is not None:
            r.start = min(r.start, r.arrival)
    return results, {"restarts": len(restarts), "restart_s": {"total": round(sum(restarts), 2),
                                                              "mean": round(sum(restarts) / len(restarts), 2)
                                                              if restarts else None},
                     "hit_rate": hits / len(reqs) if reqs else None}


def run_restarting(a: argparse.Namespace, paths: dict[str, Path], reqs, bodies) -> dict:
    results, numbers = asyncio.run(_restarting(a, paths, reqs, bodies))
    s = summarize(results)
    return {"mesh_args": f"one-model meshserve up {a.mesh_args or ''}".strip(), "completed": s.get("completed"),
            "failed": s.get("failed"), "ttft": s["ttft"], "output_throughput": s.get("output_throughput"),
            "restarts": numbers["restarts"], "restart_s": numbers["restart_s"],
            "hot_tier_hit_rate": numbers["hit_rate"], "per_model": per_model_ttft(results), "errors": errors(results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the model the copies are made of")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-models", type=int, default=4)
    ap.add_argument("--budget-models", type=float, default=2, help="models the weights budget holds")
    ap.add_argument("--workload", default="multi-model")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=2048, help="prompts are clamped to this context")
    ap.add_argument("--max-output-tokens", type=int, default=None, help="cap every request's output length")
    add_mesh_arguments(ap, prefill=0, decode=2)
    ap.add_argument("--no-restart", action="store_true", help="skip the restart-a-one-model-server-per-switch run")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--quiet", action="store_true")
    model_loads_bench.add_arguments(ap)
    a = ap.parse_args(argv)
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer

    log = (lambda *x: None) if a.quiet else (lambda *x: print(*x, file=sys.stderr, flush=True))
    if a.tier_load_times or a.cold_ttft:  # loads alone, no workload (model_loads_bench.py)
        a.tmp = tempfile.mkdtemp(prefix="meshserve-bench-loads-")
        try:
            res = model_loads_bench.main(a, log, argv if argv is not None else sys.argv[1:])
        finally:
            shutil.rmtree(a.tmp, ignore_errors=True)
        if a.out:
            write_json(a.out, res)
        print(json.dumps(res, indent=2))
        return 0
    tokenizer = load_tokenizer(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-models-"))
    try:
        paths = copies(a.model, a.num_models, tmp)
        names = [f"model-{i}" for i in range(a.num_models)]
        manifest = tmp / "models.yaml"
        manifest.write_text("".join(f"- {{name: {n}, path: '{p}'}}\n" for n, p in zip(names, paths)))
        w = copy.copy(a)
        w.request_rate, w.max_concurrency = None, None
        spec = workload_arg(a.workload)
        if spec.models is None:
            raise SystemExit(f"the workload {a.workload!r} names no models")
        rename = {"names": list(spec.models.names), "now": names}
        # the workload's popularity over these models: Zipf (or equal shares) over as many as there are
        spec.models = spec.models.model_copy(update={"names": names, "shares": None,
                                                     "zipf": spec.models.zipf if spec.models.zipf is not None
                                                     else 1.0})
        spec, reqs = prepare_workload(w, tokenizer.vocab_size, special_ids(tokenizer), spec)
        if a.max_output_tokens:
            for q in reqs:
                q.output_len = min(q.output_len, a.max_output_tokens)
        bodies = [build_body(q, names[0]) for q in reqs]
        res: dict = {"command": "meshserve bench-models " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "model": a.model, "models": dict(zip(names, map(str, paths))),
                     "workload": summary(spec, reqs, a.seed), "workload_models": rename, "runs": {}}
        log("resident: every model mapped once loaded ...")
        res["runs"]["resident"] = run(a, "resident", manifest, [], reqs, bodies)
        sizes = [m["bytes"] for m in res["runs"]["resident"]["loader"]["models"].values() if m["bytes"]]
        size = max(sizes) if sizes else 0
        budget = ["--weights-memory-gb", f"{(a.budget_models + 0.5) * size / GB:.6f}",
                  "--host-cache-gb", f"{1.5 * size / GB:.6f}"] if size else []
        log(f"budget: {a.budget_models:g} models mapped ({' '.join(budget)}) ...")
        res["runs"]["budget"] = run(a, "budget", manifest, budget, reqs, bodies)
        if not a.no_restart:
            log("restart: a one-model server, restarted whenever the requested model changes ...")
            res["runs"]["restart"] = run_restarting(a, dict(zip(names, paths)), reqs, bodies)
        r = res["runs"]["resident"]
        meshes = {k: x for k, x in res["runs"].items() if "loader" in x}

        def over(x):
            return x["ttft"]["p99"] / r["ttft"]["p99"] if x["ttft"]["p99"] and r["ttft"]["p99"] else None

        res["summary"] = {
            "hot_tier_hit_rate": {k: x["loader"]["hot_tier_hit_rate"] if "loader" in x else x["hot_tier_hit_rate"]
                                  for k, x in res["runs"].items()},
            "loads": {k: x["loader"]["loads_by_tier"] for k, x in meshes.items()},
            "evictions": {k: x["loader"]["evictions"] for k, x in meshes.items()},
            "ttft_p50_s": {k: x["ttft"]["p50"] for k, x in res["runs"].items()},
            "ttft_p99_s": {k: x["ttft"]["p99"] for k, x in res["runs"].items()},
            "ttft_p99_budget_over_resident": over(res["runs"]["budget"]),
            **({"restarts": res["runs"]["restart"]["restarts"],
                "ttft_p99_restart_over_resident": over(res["runs"]["restart"])} if "restart" in res["runs"] else {})}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.out:
        write_json(a.out, res)
    print(json.dumps(res, indent=2))
    return 0 if all(x["failed"] == 0 for x in res["runs"].values()) else 1
