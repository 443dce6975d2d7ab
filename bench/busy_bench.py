"""`meshserve bench-busy`: one stream's speed with a CPU burner on one core, before and after the
worker's thread tuner, against a quiet machine, side by side in one run.

    meshserve bench-busy [--model M] [--dtype float32] [--tokens 128] [--prompt-tokens 128] [--json OUT]

One `meshserve up --prefill 0 --decode 1` (one worker, all the cores) per configuration, both up
at once: `fixed` (`--fixed-threads`: every step on all cores, as before) and `tuned` (the default:
each kind of step on 1 thread or all, whichever measures faster). A warm-up, then one greedy
stream of --tokens tokens after a --prompt-tokens prompt, quiet and then with a burner (a process
spinning on core 0) running; and mixed load (--concurrent streams at once) the same two ways. Each
case runs --repeat times, quiet and busy and the two configurations taking turns, each measured
first in every other turn (this machine's speed drifts up to 2x within minutes: turns share the
drift fairly, and each turn makes the tuner notice the burner come and go again); prints the
median decode tokens/s (after the first token) per case, every sample, and the ratios busy /
quiet, tuned / fixed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time

from meshserve.bench.compare import add_mesh_arguments, start_mesh, stop_mesh
from meshserve.bench.loadgen import quiet_http_logs, write_json
from meshserve.shared.models_repo import DEFAULT_MODEL


def _burn() -> None:
    os.sched_setaffinity(0, {0})
    while True:
        pass


async def _stream(client, url: str, body: dict) -> tuple[float, int]:
    """(seconds from the first token to the last, tokens after the first)."""
    first, n, last = None, 0, None
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                if any(c.get("text") for c in chunk.get("choices") or []):
                    now = time.monotonic()
                    first, last, n = first or now, now, n + 1
    return (last - first) if first else 0.0, max(0, n - 1)


async def _measure(url: str, model: str, prompt: list[int], tokens: int, concurrent: int) -> float:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as c:
        await _stream(c, url + "/v1/completions", dict(body, max_tokens=8))  # warm-up
        runs = await asyncio.gather(*[_stream(c, url + "/v1/completions", body) for _ in range(concurrent)])
    span = max(s for s, _ in runs)
    return round(sum(n for _, n in runs) / span, 2) if span else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-busy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=8, help="streams at once in the mixed case (0: skip it)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case per configuration (the median is reported)")
    add_mesh_arguments(ap, prefill=None, decode=None)  # the workers are the benchmark's to set
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.prefill, a.decode = 0, 1
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer

    tok = load_tokenizer(a.model)
    prompt = (tok.encode("The history of the city begins with a small market by the river. ") * 64)[:a.prompt_tokens]
    out: dict = {"command": "meshserve bench-busy " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "cores": os.cpu_count(), "repeat": a.repeat, "configurations": {}, "samples": {}}
    base = a.mesh_args or ""
    meshes: dict[str, tuple] = {}
    try:
        for name, extra in (("fixed", "--fixed-threads"), ("tuned", "")):
            a.mesh_args = f"{base} {extra}".strip()
            meshes[name] = start_mesh(a)
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in meshes}
        for case, n in (("batch1", 1), ("concurrent", a.concurrent)):
            if n == 0:
                continue
            for turn in range(a.repeat):
                order = list(meshes.items()) if turn % 2 == 0 else list(meshes.items())[::-1]
                for state in ("quiet", "busy"):
                    burner = multiprocessing.Process(target=_burn, daemon=True) if state == "busy" else None
                    if burner is not None:
                        burner.start()
                        time.sleep(1.0)
                    try:
                        for name, (_, url) in order:  # each configuration first in every other turn
                            got = asyncio.run(_measure(url, a.model, prompt, a.tokens, n))
                            samples[name].setdefault(f"{case}_{state}", []).append(got)
                    finally:
                        if burner is not None:
                            burner.kill()
                            burner.join()
    finally:
        for up, _ in meshes.values():
            stop_mesh(up)
    for name, by_case in samples.items():
        res = {k: round(statistics.median(v), 2) for k, v in by_case.items()}
        for case in ("batch1", "concurrent"):
            if f"{case}_quiet" in res and res[f"{case}_quiet"]:
                res[f"{case}_busy_over_quiet"] = round(res[f"{case}_busy"] / res[f"{case}_quiet"], 3)
        out["configurations"][name] = res
        out["samples"][name] = by_case
        print(name, res, file=sys.stderr)
    f, t = out["configurations"]["fixed"], out["configurations"]["tuned"]
    out["tuned_over_fixed"] = {k: round(t[k] / f[k], 3) for k in f if not k.endswith("over_quiet") and f[k]}
    print(json.dumps(out, indent=2))
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
