"""Starting and stopping a real `meshserve up` for tests: real nats-server, real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ask(nats_url: str, subject: str, **options) -> dict:
    nc = await nats.connect(nats_url, **options)
    try:
        return orjson.loads((await nc.request(subject, b"", timeout=5)).data)
    finally:
        await nc.close()


def wait_streams_started(received: list[int], timeout: float = 60.0) -> None:
    """Until every stream has its first chunk (`received[i]`: chunks stream i got so far)."""
    deadline = time.monotonic() + timeout
    while not all(received) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(received), "the streams did not start"


class Mesh:
    def __init__(self, model: Path, tmp: Path, prefill: int = 1, decode: int = 1, namespace: str = "meshserve",
                 env: dict | None = None, extra: list[str] | None = None, elastic: bool = False):
        # Tests written for a topology pin it (`--fixed-roles`); elastic=True lets roles follow the traffic.
        self.port, self.nats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nats_address = f"127.0.0.1:{self.nats_port}"
        self.credentials = tmp / f"nats-credentials-{self.port}"  # the launcher writes one <user>.env per user
        # --nats-url: an external server, no credentials (a test that sets one up sets nats_url too)
        self.external_nats = "--nats-url" in (extra or [])
        # --nats-tls-cert: the embedded server speaks TLS only, its (self-signed) certificate is what to trust
        args = list(extra or [])
        self.tls_ca = Path(args[args.index("--nats-tls-cert") + 1]) if "--nats-tls-cert" in args else None
        self._nats_url: str | None = None
        self.namespace, self.model = namespace, str(model)
        self.num_workers = prefill + decode
        self.log = tmp / f"mesh-{self.port}.log"
        cmd = [sys.executable, "-m", "meshserve.cli.main", "up", "--model", str(model), "--dtype", "float32",
               "--port", str(self.port), "--nats-port", str(self.nats_port), "--namespace", namespace,
               "--prefill", str(prefill), "--decode", str(decode), "--kv-cache-gb", "0.02",
               "--startup-timeout", "240",
               *([] if self.external_nats else ["--nats-credentials", str(self.credentials)]),
               *([] if elastic else ["--fixed-roles"]), *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "MESHSERVE_SHM_DIR": str(tmp / "shm"), **(env or {})})
        self.shm_dir = tmp / "shm"

    def user_env(self, user: str, timeout: float = 60) -> dict[str, str]:
        """The environment that connects a process as `user` (the launcher's credentials, which it
        writes as it starts: waited for)."""
        from meshserve.shared.nats_auth import ENV_PASSWORD, read_credentials

        if self.external_nats:
            return {}
        path, deadline = self.credentials / f"{user}.env", time.monotonic() + timeout
        while True:
            env = read_credentials(path) if path.exists() else {}
            if env.get(ENV_PASSWORD):
                return env
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no NATS credentials for {user} from meshserve up:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.05)

    def user_url(self, user: str) -> str:
        env = self.user_env(user)
        scheme = "tls" if self.tls_ca else "nats"
        return f"{scheme}://{env['MESHSERVE_NATS_USER']}:{env['MESHSERVE_NATS_PASSWORD']}@{self.nats_address}"

    def nats_options(self) -> dict:
        """nats.connect() options besides the URL: the TLS context that trusts the mesh's server."""
        if self.tls_ca is None:
            return {}
        import ssl

        return {"tls": ssl.create_default_context(cafile=str(self.tls_ca))}

    @property
    def nats_url(self) -> str:
        """The mesh's NATS as its operator (`admin`: every subject), for tests that watch the bus."""
        return self._nats_url or self.user_url("admin")

    @nats_url.setter
    def nats_url(self, url: str) -> None:
        self._nats_url = url

    @property
    def service_nats_url(self) -> str:
        """The server's URL without credentials: services bring theirs in the environment."""
        return self._nats_url or f"nats://{self.nats_address}"

    def wait_log(self, text: str, timeout: float = 30) -> str:
        """The mesh's log once it has `text`: the launcher may still be writing a line (its ready
        line follows the health the tests wait for)."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return log

    def wait_ready(self, timeout: float = 240) -> "Mesh":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshserve up exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                # Healthy once one worker serves; a test written for a topology waits for all of it
                # (a decode worker heard late leaves the first handoffs on the prefill worker).
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and \
                        len(self.ask("scheduler.status")["workers"]) >= self.num_workers:
                    return self
            except (httpx.HTTPError, OSError, asyncio.TimeoutError, nats.errors.Error):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"mesh not healthy with {self.num_workers} workers in {timeout}s:\n"
                           f"{self.log.read_text()[-4000:]}")

    def __enter__(self) -> "Mesh":
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def ask(self, subject: str) -> dict:
        """The JSON reply of a request on `<namespace>.<subject>` (a status subject)."""
        return asyncio.run(_ask(self.nats_url, f"{self.namespace}.{subject}", **self.nats_options()))

    def children(self) -> list[int]:
        """Every process started under the launcher (they run in their own sessions)."""
        out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
        return [int(p) for p, pp in (line.split() for line in out if line.strip()) if int(pp) == self.proc.pid]

    def service_pid(self, service: str) -> int | None:
        """The pid of the launcher's child running `service` ("nats-server", "kv-pool", "scheduler"...)."""
        for pid in self.children():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv]
            if service == "nats-server" and words and Path(words[0]).name.startswith("nats-server"):
                return pid
            role = words[words.index("serve") + 1] if "serve" in words[:-1] else None
            if role == service:
                return pid
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Node:
    """Another node of a running Mesh: its own model-loader and kv-pool (so its own KV arena and weights)
    and workers, all under `--node-id`, on the mesh's NATS. To the mesh it is a second machine."""

    def __init__(self, mesh: Mesh, node_id: str, tmp: Path, prefill: int = 0, decode: int = 1,
                 kv_pool_args: list[str] | None = None, worker_args: list[str] | None = None,
                 prefix: list[str] | None = None):
        """prefix: what runs each process (`ip netns exec NS`: the node as another host)."""
        from meshserve.cli.launcher import _die_with_parent

        self.mesh, self.node_id, self.procs = mesh, node_id, []
        self.log = tmp / f"node-{node_id}-{mesh.port}.log"
        out = open(self.log, "w")
        env = {**os.environ, "MESHSERVE_SHM_DIR": str(mesh.shm_dir)}

        def spawn(role: str, *extra: str) -> None:
            from meshserve.shared.nats_auth import ROLE_USER

            cmd = [*(prefix or []), sys.executable, "-m", "meshserve.cli.main", "serve", role, "--nats-url",
                   mesh.service_nats_url,
                   "--namespace", mesh.namespace, "--model", mesh.model, "--dtype", "float32", "--node-id", node_id,
                   *extra]
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                               env={**env, **mesh.user_env(ROLE_USER[role])},
                                               preexec_fn=_die_with_parent))

        spawn("model-loader", "--preload")
        spawn("kv-pool", "--kv-cache-gb", "0.02", *(kv_pool_args or []))
        for role, n in (("prefill", prefill), ("decode", decode)):
            for _ in range(n):
                spawn(role, *(worker_args or []))
        self.num_workers = prefill + decode

    def wait_ready(self, timeout: float = 240) -> "Node":
        """Until the scheduler has heard every worker of this node."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a process of {self.node_id} exited ({p.returncode}):\n"
                                       f"{self.log.read_text()[-4000:]}")
            try:
                workers = self.mesh.ask("scheduler.status")["workers"]
                if sum(w.get("node_id") == self.node_id for w in workers) >= self.num_workers:
                    return self
            except Exception:  # noqa: BLE001 - the scheduler may not answer yet
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.node_id} not ready in {timeout}s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        """Workers first, then kv-pool and model-loader (which remove their shared-memory files)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def bus_bytes_of_completion(nats_url: str, namespace: str, body: dict) -> tuple[dict, dict[str, int]]:
    """Sends one completion over the NATS API and counts every byte on the bus meanwhile, by
    subject (second and last part: 'scheduler.handoff', 'worker.adopt', 'kv.chunk', ...)."""
    import asyncio

    import nats
    import orjson

    async def go():
        nc = await nats.connect(nats_url)
        seen: dict[str, int] = {}

        async def count(msg):
            key = msg.subject.split(".")[1] + "." + msg.subject.split(".")[-1]
            seen[key] = seen.get(key, 0) + len(msg.data)

        await nc.subscribe(">", cb=count)
        await nc.flush()
        r = orjson.loads((await nc.request(f"{namespace}.v1.completions", orjson.dumps(body), timeout=60)).data)
        await asyncio.sleep(0.3)
        await nc.close()
        return r, seen

    return asyncio.run(go())
