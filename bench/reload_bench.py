"""`meshserve bench-reload`: a model added by a manifest reload beside a busy model of another KV
shape, with the KV arenas resized in place and without (issue 12), side by side in one run.

    meshserve bench-reload [--model M] [--dtype bfloat16] [--kv-cache-gb 0.25] [--streams 4]
                           [--prompt-tokens 256] [--output-tokens 64] [--fill-s 20]
                           [--added-layers N] [--added-requests 5] [--wait-s 30] [--mesh-args "..."]
                           [--out FILE]

Two decode workers serve `busy` (`--model`) alone: it has the node's whole `--kv-cache-gb`, and
`--streams` streams of distinct prompts keep both workers busy for `--fill-s` seconds, filling its
arena with blocks in use and cached prefixes. Then the manifest gains `added`, a random-weight model
the benchmark writes with `--added-layers` layers (half of the busy model's by default: another KV
shape, so another arena with its own part of the KV memory), and is reloaded
(`POST /admin/models/reload`) while the streams go on. `added` is asked for once a second until it
answers (or `--wait-s` passes), then `--added-requests` times more. Two runs:

- `resize`: the default: the busy model's arena shrinks to its new half while its workers use it;
- `no-resize`: `--no-arena-resize`, arenas sized when made and only retired once idle (what the
  CUDA backend does, and what the CPU one did before): the added model finds no room while the busy
  model's workers stay on it.

Reported per run: the seconds from the reload to `added`'s first token and the failures before it,
its TTFT afterwards, the busy model's output tokens/s and inter-token latency before and after the
reload, and the memory the arena files take (their allocated bytes: `resident`) before and after.
Prints the JSON on stdout (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshserve.bench.compare import add_mesh_arguments, start_mesh, stop_mesh
from meshserve.bench.isolation_bench import _pct, _prompt, _stream, write_random_model
from meshserve.bench.loadgen import quiet_http_logs, write_json
from meshserve.shared.models_repo import DEFAULT_MODEL

MIB = 1 << 20


def arena_files(shm_dir: Path) -> dict[str, dict]:
    """Per KV arena file of the mesh: its size and the bytes it takes (allocated, not its size)."""
    from meshserve.shared import shm

    out = {}
    for f in sorted(shm_dir.glob("*-kv-*")):
        if f.name.endswith(".tmp"):
            continue
        out[f.name.rsplit("-kv-", 1)[1]] = {"size_mib": round(f.stat().st_size / MIB, 1),
                                             "resident_mib": round(shm.resident_bytes(f) / MIB, 1)}
    return out


async def _refused(c, url: str, body: dict) -> str | None:
    """None when the streamed completion gives a token, else the error (the server's words)."""
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"{r.status_code}: {(await r.aread()).decode(errors='replace')}"
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"text"' in line and line[5:].strip() != "[DONE]":
                return None
    return "a stream with no tokens"


async def _run(url: str, a, vocab: int, manifest: Path, both: str, shm_dir: Path) -> dict:
    import httpx

    rng = random.Random(a.seed)
    busy = {"model": "busy", "max_tokens": a.output_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    added = {"model": "added", "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as c:
        stop, tokens, finished, failed = asyncio.Event(), [0], [0], [0]
        gaps: dict[str, list[float]] = {"before": [], "after": []}
        phase = ["before"]

        async def keep_busy():
            while not stop.is_set():
                try:
                    _, g, _ = await _stream(c, url, dict(busy, prompt=_prompt(rng, a.prompt_tokens, vocab)), tokens)
                    gaps[phase[0]] += g
                except Exception:  # noqa: BLE001 - counted; this stream stops
                    failed[0] += 1
                    return
                finished[0] += 1

        streams = [asyncio.ensure_future(keep_busy()) for _ in range(a.streams)]
        await asyncio.sleep(a.fill_s)
        t_fill, tokens_fill = time.monotonic(), tokens[0]
        await asyncio.sleep(min(10.0, a.fill_s))  # the busy model's speed before the reload
        before_tps = (tokens[0] - tokens_fill) / (time.monotonic() - t_fill)
        files_before = arena_files(shm_dir)

        manifest.write_text(both)
        t0 = time.monotonic()
        r = await c.post(url + "/admin/models/reload")
        r.raise_for_status()
        phase[0] = "after"
        tokens_reload = tokens[0]
        first, tries, errors = None, 0, []
        while first is None and time.monotonic() - t0 < a.wait_s:
            tries += 1
            error = await _refused(c, url, dict(added, prompt=_prompt(rng, 64, vocab)))
            if error is None:
                first = time.monotonic() - t0
            else:
                errors.append(error[:300])
                await asyncio.sleep(1.0)
        ttft = []
        if first is not None:
            for _ in range(a.added_requests):
                t, _, _ = await _stream(c, url, dict(added, prompt=_prompt(rng, 64, vocab)))
                ttft.append(t)
        after_tps = (tokens[0] - tokens_reload) / (time.monotonic() - t0)
        stop.set()
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        health = (await c.get(url + "/health")).json().get("scheduler", {})
    return {"added": {"first_token_after_reload_s": round(first, 3) if first is not None else None,
                      "asked": tries, "failed": len(errors), "errors": list(dict.fromkeys(errors))[:2],
                      "ttft_s": _pct(ttft)},
            "busy": {"streams": a.streams, "finished": finished[0], "failed": failed[0],
                     "output_tokens_per_s": {"before": round(before_tps, 1), "after": round(after_tps, 1)},
                     "itl_s": {k: _pct(v) for k, v in gaps.items()}},
            "arena_files": {"before": files_before, "after": arena_files(shm_dir)},
            "kv_by_model": health.get("kv_by_model"),
            "model_switches": [{k: s.get(k) for k in ("from", "to", "ok", "seconds", "reason")}
                               for s in health.get("recent_model_switches", [])]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-reload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the busy model")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-gb", type=float, default=0.25, help="the node's KV memory")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams on the busy model")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--fill-s", type=float, default=20.0, help="seconds of busy-model load before the reload")
    ap.add_argument("--added-layers", type=int, default=None, help="the added model's layers (default: half of "
                                                                   "the busy model's)")
    ap.add_argument("--added-requests", type=int, default=5)
    ap.add_argument("--wait-s", type=float, default=30.0, help="how long the added model is asked for")
    ap.add_argument("--seed", type=int, default=0)
    add_mesh_arguments(ap, prefill=None, decode=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    quiet_http_logs()
    from meshserve.shared.models_repo import load_model_files, load_tokenizer, resolve

    busy = str(resolve(a.model))
    cfg = load_model_files(a.model)[0]
    layers = a.added_layers or max(1, cfg.num_hidden_layers // 2)
    vocab = load_tokenizer(a.model).vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-reload-"))
    res: dict = {"command": "meshserve bench-reload " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "busy": busy, "added": f"random, {layers} layers (the busy model has {cfg.num_hidden_layers})",
                 "kv_cache_gb": a.kv_cache_gb, "runs": {}}
    try:
        added = write_random_model(a.model, tmp / "added", 1.0, a.seed, layers=layers)
        one, both = (f"- {{name: busy, path: '{busy}'}}\n",
                     f"- {{name: busy, path: '{busy}'}}\n- {{name: added, path: '{added}'}}\n")
        for label, flag in (("resize", ""), ("no-resize", "--no-arena-resize")):
            manifest, shm_dir = tmp / f"{label}.yaml", tmp / f"shm-{label}"
            manifest.write_text(one)
            m = copy.copy(a)
            m.prefill, m.decode = 0, 2
            m.mesh_args = (f"{a.mesh_args or ''} --models {manifest} --kv-cache-gb {a.kv_cache_gb} --fixed-roles "
                           f"--fixed-model-workers {flag}")
            print(f"{label}: meshserve up {m.mesh_args.strip()} ...", file=sys.stderr, flush=True)
            os.environ["MESHSERVE_SHM_DIR"] = str(shm_dir)  # the mesh's shared files, to measure
            up, url = start_mesh(m)
            try:
                res["runs"][label] = asyncio.run(_run(url, a, vocab, manifest, both, shm_dir))
            finally:
                stop_mesh(up)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["summary"] = {label: {"added_first_token_after_reload_s": r["added"]["first_token_after_reload_s"],
                              "added_failed": r["added"]["failed"],
                              "busy_tokens_per_s": r["busy"]["output_tokens_per_s"],
                              "busy_itl_p99_s": {k: v["p99"] for k, v in r["busy"]["itl_s"].items()}}
                      for label, r in res["runs"].items()}
    if a.out:
        write_json(a.out, res)
    print(json.dumps(res, indent=2))
    return 0 if res["runs"]["resize"]["added"]["first_token_after_reload_s"] is not None else 1
