"""The mesh benchmark: the same workload through `meshserve up` (HTTP, streaming) and through the
in-process engine, side by side in one run.

    meshserve bench-mesh [--model M] [--dtype bfloat16] [--prefill 0 --decode 1] [--json OUT]

Reports output tokens/s, TTFT and inter-token latency for both, the TTFT the mesh adds, and the
token stream's CPU per token: the gateway's (tokenizing, detokenizing, SSE) and the workers'
event-loop thread's (the token messages, NATS in and out, block leases: all a worker does besides
its engine steps), plus the whole mesh's CPU per token against the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from meshserve.bench.engine_bench import add_workload_arguments, engine_mixed, mixed_workload, summarize
from meshserve.bench.report import emit_json
from meshserve.cli.errors import ArgumentParser
from meshserve.shared.models_repo import load_tokenizer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> dict[int, str]:
    """The launcher's children by service name."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    kids = {}
    for line in out.splitlines():
        p, pp, args = line.split(None, 2)
        if int(pp) == pid:
            m = re.search(r"meshserve\.cli\.main serve (\S+)", args)
            kids[int(p)] = m.group(1) if m else "nats-server"
    return kids


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int) -> dict:
    t0 = time.monotonic()
    times, tokens = [], 0
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=None) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.monotonic())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"start": t0, "times": times, "tokens": tokens}


async def _worker_io(nats_port: int, credentials: Path) -> dict[str, tuple[float, int, dict]]:
    """Each worker's event-loop CPU seconds, tokens streamed so far and thread tuner stats (their
    heartbeats, via the scheduler): the worker's side of the token stream, apart from its engine steps."""
    import nats
    import orjson

    from meshserve.shared.nats_auth import connect_options, read_credentials

    nc = await nats.connect(f"nats://127.0.0.1:{nats_port}",
                            **connect_options(read_credentials(credentials / "admin.env")))
    try:
        r = orjson.loads((await nc.request("meshserve.scheduler.status", b"", timeout=10)).data)
    finally:
        await nc.close()
    return {w["id"]: (w["io_cpu_s"], w["tokens_streamed"], w.get("threads") or {}) for w in r["workers"]}


NOT_SEEN = (0.0, 0, {})  # a worker's _worker_io entry before it first reported


def _step_counts(after: dict, before: dict) -> dict[str, int]:
    b = before.get("steps_by_threads", {})
    return {n: k - b.get(n, 0) for n, k in after.get("steps_by_threads", {}).items()}


async def mesh_mixed(url: str, model: str, work) -> dict:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(work) + 4)) as client:
        await _one(client, url, model, work[0][0][:8], 2)  # warm up
        t0 = time.monotonic()
        res = await asyncio.gather(*[_one(client, url, model, p, o) for p, o in work])
        total = time.monotonic() - t0
    failed = sum(1 for r in res if not r["times"])
    res = [r for r in res if r["times"]]
    ttfts = [r["times"][0] - r["start"] for r in res]
    itls = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    # ITL is measured between SSE events: the gateway holds back bytes of an incomplete UTF-8
    # character, so an event can carry two tokens (the token count comes from `usage`).
    return summarize(total, sum(r["tokens"] for r in res), ttfts, itls) | {"failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="meshserve bench-mesh", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(ap)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    ap.add_argument("--up-args", default="", help="more options for `meshserve up`, e.g. '--swap-space 0'")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from meshserve.shared.engine.llm import LLM

    res: dict = {"command": "meshserve bench-mesh " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": a.model, "dtype": a.dtype, "quantization": a.quantization,
                 "kv_cache_dtype": a.kv_cache_dtype, "mesh": {"prefill": a.prefill, "decode": a.decode}}
    port, nats_port = _port(), _port()
    cmd = [sys.executable, "-m", "meshserve.cli.main", "up", "--model", a.model, "--dtype", a.dtype,
           "--port", str(port), "--nats-port", str(nats_port), "--prefill", str(a.prefill), "--decode", str(a.decode),
           "--kv-cache-dtype", a.kv_cache_dtype] + a.up_args.split()  # the engine half: the same KV dtype
    credentials = Path(tempfile.mkdtemp(prefix="meshserve-bench-creds-"))  # the admin user asks for worker stats
    cmd += ["--nats-credentials", str(credentials)]
    if a.quantization:
        cmd += ["--quantization", a.quantization]
    env = dict(os.environ)
    if a.threads:
        env["MESHSERVE_WORKER_THREADS"] = str(a.threads)
    up = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if up.poll() is not None:
                raise RuntimeError(f"`meshserve up` exited with {up.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("the mesh did not become healthy")
        tok = load_tokenizer(a.model)  # the workload needs only the vocabulary
        work = mixed_workload(a.num_requests, a.seed, tok.vocab_size, set(tok.eos_token_ids) | {0})
        kids = _children(up.pid)
        cpu0 = {p: _cpu_seconds(p) for p in kids}
        io0 = asyncio.run(_worker_io(nats_port, credentials))
        client0 = time.process_time()
        res["meshserve_mesh"] = asyncio.run(mesh_mixed(url, a.model, work))
        client_cpu = time.process_time() - client0
        time.sleep(1.2)  # two heartbeats: the workers' counters as of the end of the run
        io1 = asyncio.run(_worker_io(nats_port, credentials))
        metrics = httpx.get(url + "/metrics", timeout=10).text
        res["meshserve_mesh"]["preemptions"] = sum(
            float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("meshserve:num_preemptions"))
        cpu = {}
        for p, name in kids.items():
            cpu[name] = cpu.get(name, 0.0) + _cpu_seconds(p) - cpu0[p]
        tokens = res["meshserve_mesh"]["output_tokens"]
        res["meshserve_mesh"]["cpu_s"] = cpu
        # The benchmark's own HTTP client shares the cores with the mesh (not with the engine half).
        res["meshserve_mesh"]["client_cpu_ms_per_token"] = 1000 * client_cpu / tokens
        res["meshserve_mesh"]["gateway_cpu_ms_per_token"] = 1000 * cpu.get("gateway", 0.0) / tokens
        res["meshserve_mesh"]["mesh_cpu_ms_per_token"] = 1000 * sum(cpu.values()) / tokens
        streamed = sum(io1[w][1] - io0.get(w, NOT_SEEN)[1] for w in io1)
        io_ms = 1000 * sum(io1[w][0] - io0.get(w, NOT_SEEN)[0] for w in io1) / max(streamed, 1)
        # The thread tuner's choices over the run (steps per thread count): a run whose worker used
        # fewer cores than it had shows here whether one-thread steps were the cause.
        res["meshserve_mesh"]["worker_threads"] = {
            w: {"steps_by_threads": _step_counts(io1[w][2], io0.get(w, NOT_SEEN)[2]),
                "ms_per_token": io1[w][2].get("ms_per_token", {})} for w in io1 if io1[w][2]}
        res["meshserve_mesh"]["worker_io_cpu_ms_per_token"] = io_ms
        res["meshserve_mesh"]["stream_cpu_ms_per_token"] = io_ms + res["meshserve_mesh"]["gateway_cpu_ms_per_token"]
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:  # never hide the error that brought us here
            up.kill()
    if not a.skip_engine:
        llm = LLM(a.model, a.dtype, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
        t_cpu = time.process_time()
        res["meshserve_engine"] = engine_mixed(llm, work)
        res["meshserve_engine"]["cpu_ms_per_token"] = (1000 * (time.process_time() - t_cpu)
                                                       / res["meshserve_engine"]["output_tokens"])
        m, e = res["meshserve_mesh"], res["meshserve_engine"]
        res["ratios"] = {"mesh_vs_engine_output_tok_s": m["output_tok_s"] / e["output_tok_s"],
                         "ttft_p50_added_s": m["ttft_p50_s"] - e["ttft_p50_s"],
                         "cpu_ms_per_token_added": m["mesh_cpu_ms_per_token"] - e["cpu_ms_per_token"]}
    emit_json(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
