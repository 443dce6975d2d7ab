"""Start-up and memory of `meshserve up`: the time from starting it to the first served token, cold
and warm, and the resident memory (RSS and PSS) of every process of the mesh.

    meshserve bench-startup [--model M] [--dtype bfloat16] [--prefill 1 --decode 1] [--warm-runs 2]
                            [--cache-dir DIR] [--up-args '...'] [--json OUT]

Cold and warm share one fresh cache directory (MESHSERVE_CACHE; a temporary one unless --cache-dir):
the first run is cold, the next ones warm. The model file is linked into it from the usual cache
(pulled there first when missing), so "cold" means every cache meshserve keeps starts empty (the
compiled CPU kernels are built again: TORCH_EXTENSIONS_DIR is unset for the mesh) but the model
is not downloaded again, and the operating system's page cache is left as it is (dropping it
would need root and disturb everything else on the machine). The request log goes to the fresh
directory too.

A run: start `meshserve up`; poll the gateway's /health every 20 ms; then one streaming completion
(max_tokens 1); its first content chunk is the first served token. Then the memory of the launcher
and of each process under it (gateway, scheduler, kv-pool, model-loader, workers, nats-server),
from /proc/<pid>/smaps_rollup, in MB, and the CPU seconds each has used (on few cores, start-up is
their sum as much as the longest chain); then Ctrl-C (SIGINT), as a user stops it. Each run has a
namespace of its own, so other meshes on the machine do not disturb it.
Targets (issue 8): gateway, scheduler and launcher under 120 MB RSS each; warm start-up under 8 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from meshserve.bench.report import emit_json
from meshserve.shared import models_repo

TARGET_RSS_MB = 120.0  # gateway, scheduler, launcher
TARGET_WARM_S = 8.0
POLL_S = 0.02


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# smaps_rollup's lines -> our keys. PSS shares each shared page among the processes mapping it, and
# splits into anonymous memory (the process's own heap: what a leak grows), files (libraries, mapped
# models) and shared memory (the node's weights and KV arena: a worker's RSS grows as it touches more
# of the arena, which is no leak). `anon_mb` is the anonymous memory resident, unshared.
MEMORY_FIELDS = {"Rss": "rss_mb", "Pss": "pss_mb", "Anonymous": "anon_mb", "Pss_Anon": "pss_anon_mb",
                 "Pss_File": "pss_file_mb", "Pss_Shmem": "pss_shmem_mb"}


def memory_mb(pid: int) -> dict[str, float]:
    """RSS and PSS of one process, in MB, with PSS split by kind (MEMORY_FIELDS; smaps_rollup)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in MEMORY_FIELDS:
                out[MEMORY_FIELDS[key]] = round(int(rest.split()[0]) / 1024, 1)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far: what its start-up cost, where cores are few."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def mesh_processes(launcher: int) -> dict[str, int]:
    """The launcher and every process under it, by name: its role for `serve ROLE` (workers
    numbered in start order: decode-0, ...), else the program's name (nats-server)."""
    names, count = {"launcher": launcher}, {}
    todo = _children(launcher)
    while todo:
        pid = todo.pop(0)
        try:
            args = _cmdline(pid)
            todo += _children(pid)
        except OSError:
            continue  # gone meanwhile
        role = args[args.index("serve") + 1] if "serve" in args[:-1] else Path(args[0]).name if args else "?"
        if role in ("prefill", "decode"):
            count[role] = count.get(role, -1) + 1
            role = f"{role}-{count[role]}"
        names[role] = pid
    return names


def link_model(model: str, cache: Path) -> str:
    """Puts the model in the fresh cache without downloading it again; returns what to pass as --model."""
    if Path(model).expanduser().exists():
        return model  # a path: used where it is
    src = models_repo.resolve(model)  # in the usual cache (pulled now if it is not there yet)
    dst = cache / "models" / model.lower() / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():
        dst.symlink_to(src)
    return model


def first_token(url: str, model: str, deadline: float) -> tuple[float, float]:
    """Waits for /health, then streams one completion; returns (when healthy, when its first
    token came), monotonic."""
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the mesh did not become healthy in time")
        time.sleep(POLL_S)
    healthy = time.monotonic()
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and orjson.loads(line[6:]).get("choices"):
                return healthy, time.monotonic()
    raise RuntimeError("the completion streamed no token")


def one_run(a, cache: Path, model: str, log_path: Path) -> dict:
    port, nats_port = _port(), _port()
    # A namespace of its own: shared-memory files are named by it, so another mesh on this machine
    # (a test, someone's `meshserve up`) can never replace or remove this one's.
    namespace = f"startup{os.getpid()}x{port}"
    cmd = [sys.executable, "-m", "meshserve.cli.main", "up", "--namespace", namespace, "--model", model,
           "--dtype", a.dtype,
           "--port", str(port), "--nats-port", str(nats_port), "--prefill", str(a.prefill),
           "--decode", str(a.decode), "--request-log", str(cache / "logs" / "requests.jsonl"), *a.up_args.split()]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | {"MESHSERVE_CACHE": str(cache)}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            healthy, token = first_token(url, model, t0 + a.timeout)
            procs = mesh_processes(up.pid)
            memory = {}
            for name, pid in procs.items():
                try:
                    memory[name] = memory_mb(pid) | {"cpu_s": cpu_seconds(pid)}
                except OSError:
                    pass
        finally:
            t_stop = time.monotonic()
            up.send_signal(signal.SIGINT)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    return {"healthy_s": round(healthy - t0, 3), "first_token_s": round(token - t0, 3),
            "stop_s": round(time.monotonic() - t_stop, 3), "memory": memory}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=models_repo.DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--warm-runs", type=int, default=2, help="runs after the cold one (default: %(default)s)")
    ap.add_argument("--cache-dir", default=None, help="the fresh cache directory (default: a temporary one, "
                    "removed afterwards); it must not exist yet or be empty")
    ap.add_argument("--up-args", default="", help="more options for `meshserve up`, e.g. '--kv-cache-gb 1'")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    a = ap.parse_args(argv)

    own = a.cache_dir is None
    cache = Path(tempfile.mkdtemp(prefix="meshserve-startup-") if own else a.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if any(cache.iterdir()):
        ap.error(f"--cache-dir {cache} is not empty: a cold start needs an empty cache")
    log_path = Path(tempfile.mkstemp(prefix="meshserve-startup-", suffix=".log")[1])
    try:
        model = link_model(a.model, cache)
        runs = [one_run(a, cache, model, log_path) for _ in range(1 + a.warm_runs)]
    except Exception:
        print(f"meshserve up's output: {log_path}", file=sys.stderr)
        raise
    finally:
        if own:
            shutil.rmtree(cache, ignore_errors=True)
    cold, warm = runs[0], runs[1:]
    res = {"command": "meshserve bench-startup " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": a.model, "dtype": a.dtype, "mesh": {"prefill": a.prefill, "decode": a.decode},
           "cpus": len(os.sched_getaffinity(0)), "cold": cold, "warm": warm}
    if warm:
        best = min(warm, key=lambda r: r["first_token_s"])
        res["targets"] = {
            "warm_first_token_s": best["first_token_s"], "warm_under_8s": best["first_token_s"] < TARGET_WARM_S,
            **{f"{name}_rss_under_120mb": best["memory"][name]["rss_mb"] < TARGET_RSS_MB
               for name in ("launcher", "gateway", "scheduler") if name in best["memory"]}}
    emit_json(res, a.json)
    os.unlink(log_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
