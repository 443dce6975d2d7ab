"""`meshserve bench-tenants`: one tenant's latency while another floods the same class, with the
scheduler's fair share between tenants and without it (docs/tenants.md), side by side in one run.

    meshserve bench-tenants [--model M] [--flood-requests 48] [--light-requests 12]
                            [--prompt-tokens 64] [--output-tokens 64] [--light-gap-s 0.5]
                            [--max-num-seqs 8] [--mesh-args "..."] [--out FILE]

Two tenants in one class (normal): `flood` sends `--flood-requests` requests at once, more than
the workers' seats (`--max-num-seqs` each), and while they wait, `light` sends `--light-requests`,
one every `--light-gap-s` (open loop). Two runs of `meshserve up --tenants`: `fair` (the
default) and `arrival` (`--no-fair-share`: the class's own order, whoever sent it). Reported per
run: light's TTFT and end-to-end latency (p50, p99) and how many of its requests ended before the
flood's last, the flood's output tokens/s and when its last request ended, and both tenants'
output tokens/s over the run; then fair over arrival. Prints the JSON on
stdout (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshserve.bench.compare import add_mesh_arguments, start_mesh, stop_mesh
from meshserve.bench.loadgen import quiet_http_logs, write_json
from meshserve.bench.report import stats
from meshserve.shared.models_repo import DEFAULT_MODEL

TENANTS = """\
tenants:
  - {name: flood, api_keys: ["sk-flood"]}
  - {name: light, api_keys: ["sk-light"]}
"""


async def _stream(client, url: str, key: str, body: dict, delay: float = 0.0) -> tuple[float, float, int, float]:
    """(TTFT, end-to-end seconds, output tokens, when it ended) of one streamed completion sent after
    `delay` seconds."""
    await asyncio.sleep(delay)
    t0, first, n = time.monotonic(), None, 0
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    first = first or time.monotonic()
                    n += 1
    end = time.monotonic()
    return (first or end) - t0, end - t0, n, end


async def _run(url: str, a, vocab: int) -> dict:
    import httpx

    rng = random.Random(a.seed)

    def body() -> dict:
        return {"prompt": [rng.randrange(100, vocab) for _ in range(a.prompt_tokens)], "max_tokens": a.output_tokens,
                "temperature": 0, "ignore_eos": True}

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=a.flood_requests + 8)) as c:
        await _stream(c, url, "sk-light", dict(body(), max_tokens=2))  # warm-up, untimed
        t0 = time.monotonic()
        flood = [asyncio.ensure_future(_stream(c, url, "sk-flood", body())) for _ in range(a.flood_requests)]
        # open loop: light's requests arrive on their schedule, while the flood is queued
        light = [asyncio.ensure_future(_stream(c, url, "sk-light", body(), a.light_gap_s * (i + 1)))
                 for i in range(a.light_requests)]
        flood_done = await asyncio.gather(*flood, return_exceptions=True)
        light_done = await asyncio.gather(*light, return_exceptions=True)
    flood_ok = [d for d in flood_done if not isinstance(d, BaseException)]
    light_ok = [d for d in light_done if not isinstance(d, BaseException)]
    span = max((d[3] for d in flood_ok), default=t0) - t0
    whole = max((d[3] for d in flood_ok + light_ok), default=t0) - t0
    return {"light": {"requests": a.light_requests, "failed": len(light_done) - len(light_ok),
                      "ttft_s": _pct([x[0] for x in light_ok]), "e2e_s": _pct([x[1] for x in light_ok]),
                      "ended_before_the_flood": sum(d[3] - t0 < span for d in light_ok)},
            "flood": {"requests": a.flood_requests, "failed": len(flood_done) - len(flood_ok),
                      "output_tokens_per_s": round(sum(x[2] for x in flood_ok) / span, 2) if span else None,
                      "last_ended_s": round(span, 3)},
            # both tenants' tokens over the run: what the mesh served, whoever it served first
            "all_output_tokens_per_s": round(sum(x[2] for x in flood_ok + light_ok) / whole, 2) if whole else None}


def _pct(xs: list[float]) -> dict:
    s = stats(xs)
    return {"p50": s["p50"], "p99": s["p99"], "mean": s["mean"], "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-tenants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--flood-requests", type=int, default=48)
    ap.add_argument("--light-requests", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--light-gap-s", type=float, default=0.5, help="seconds between light's requests")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="each worker's seats: fewer than the flood")
    ap.add_argument("--seed", type=int, default=0)
    add_mesh_arguments(ap)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer

    vocab = load_tokenizer(a.model).vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-tenants-"))
    res: dict = {"command": "meshserve bench-tenants " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": a.model, "runs": {}}
    try:
        (tmp / "tenants.yaml").write_text(TENANTS)
        for run, flag in (("fair", ""), ("arrival", "--no-fair-share")):
            m = copy.copy(a)
            m.mesh_args = f"{a.mesh_args or ''} --max-num-seqs {a.max_num_seqs} --tenants {tmp / 'tenants.yaml'} {flag}"
            print(f"{run}: meshserve up {m.mesh_args.strip()} ...", file=sys.stderr, flush=True)
            up, url = start_mesh(m)
            try:
                res["runs"][run] = asyncio.run(_run(url, a, vocab))
            finally:
                stop_mesh(up)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fair, arrival = res["runs"]["fair"], res["runs"]["arrival"]

    def ratio(x, y):
        return round(x / y, 3) if x and y else None

    res["summary"] = {
        "light_ttft_p50_s": {k: r["light"]["ttft_s"]["p50"] for k, r in res["runs"].items()},
        "light_ttft_p99_s": {k: r["light"]["ttft_s"]["p99"] for k, r in res["runs"].items()},
        "flood_output_tokens_per_s": {k: r["flood"]["output_tokens_per_s"] for k, r in res["runs"].items()},
        "all_output_tokens_per_s": {k: r["all_output_tokens_per_s"] for k, r in res["runs"].items()},
        "light_ttft_p99_fair_over_arrival": ratio(fair["light"]["ttft_s"]["p99"], arrival["light"]["ttft_s"]["p99"]),
        "all_throughput_fair_over_arrival": ratio(fair["all_output_tokens_per_s"], arrival["all_output_tokens_per_s"])}
    if a.out:
        write_json(a.out, res)
    print(json.dumps(res, indent=2))
    return 0 if all(r["light"]["failed"] == 0 and r["flood"]["failed"] == 0 for r in res["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
