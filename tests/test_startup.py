"""`meshserve up` as a user starts it: a request sent before any worker is up waits for one and
completes (no 503), and the one line saying the mesh is ready comes only once a request can be served."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from mesh_util import Mesh

READY = "meshserve is ready in "


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_request_before_the_workers_are_up_completes(tiny_llama, tmp_path):
    mesh = Mesh(tiny_llama, tmp_path, prefill=0, decode=0)  # no worker: the gateway waits for one
    worker = None
    try:
        def gateway_up():
            assert mesh.proc.poll() is None, mesh.log.read_text()
            try:
                return httpx.get(f"{mesh.url}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(gateway_up, 120, "the gateway")
        assert httpx.get(f"{mesh.url}/health", timeout=5).status_code == 503
        got = {}

        def ask():
            got["r"] = httpx.post(f"{mesh.url}/v1/completions", timeout=150,
                                  json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})

        t = threading.Thread(target=ask)
        t.start()
        assert READY not in mesh.log.read_text()  # nothing can be served yet, and nothing says so
        worker = subprocess.Popen(
            [sys.executable, "-m", "meshserve.cli.main", "serve", "decode", "--nats-url", mesh.nats_url,
             "--namespace", mesh.namespace, "--model", mesh.model, "--dtype", "float32", "--node-id", "node0"],
            stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "MESHSERVE_SHM_DIR": str(mesh.shm_dir)})
        t.join(150)
        assert not t.is_alive(), "the waiting request did not finish"
        r = got["r"]
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["text"]
        ready = wait_until(lambda: [x for x in mesh.log.read_text().splitlines() if READY in x], 30, "the ready line")
        assert len(ready) == 1 and f"at {mesh.url}/v1" in ready[0], ready
        assert not any("gateway serving" in x for x in mesh.log.read_text().splitlines())
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        mesh.stop()


def test_a_service_stopped_while_starting_exits_at_once(tiny_llama, tmp_path):
    """SIGTERM to a worker still starting (here: waiting for its node's model loader, which would make it
    wait up to 900 s) cancels the start: it exits at once, cleanly, saying so. A warm `meshserve up`
    stopped right after its first token has workers in that state."""
    import asyncio

    import nats

    from meshserve.cli.launcher import nats_server_binary
    from meshserve.shared.subjects import Subjects
    from mesh_util import free_port

    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, log = f"nats://127.0.0.1:{port}", tmp_path / "worker.log"
    worker = None
    try:
        async def worker_waiting_for_its_weights() -> None:
            for _ in range(200):  # the server may still be starting
                try:
                    nc = await nats.connect(url, allow_reconnect=False)
                    break
                except (OSError, nats.errors.NoServersError):
                    await asyncio.sleep(0.05)
            asked = asyncio.Event()

            async def on_ask(msg):  # heard, never answered: no model loader on node "nowhere"
                asked.set()
            await nc.subscribe(Subjects("stoptest").models("load", "nowhere"), cb=on_ask)
            await nc.flush()
            nonlocal worker
            worker = subprocess.Popen(
                [sys.executable, "-m", "meshserve.cli.main", "serve", "decode", "--nats-url", url,
                 "--namespace", "stoptest", "--model", str(tiny_llama), "--dtype", "float32", "--node-id", "nowhere"],
                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                env={**os.environ, "MESHSERVE_SHM_DIR": str(tmp_path / "shm")})
            await asyncio.wait_for(asked.wait(), 120)  # inside its start, waiting for its weights
            await nc.close()
        asyncio.run(worker_waiting_for_its_weights())
        t0 = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, log.read_text()  # not the 900 s it would have waited
        took = time.monotonic() - t0
        assert "decode stopped while starting" in log.read_text(), log.read_text()
        print(f"stopped while starting in {took:.2f}s")
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        server.terminate()
        server.wait(10)
