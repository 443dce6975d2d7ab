"""Starting and stopping a real `meshserve up` for tests: real nats-server, real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mesh:
    def __init__(self, model: Path, tmp: Path, prefill: int = 1, decode: int = 1, namespace: str = "meshserve",
                 env: dict | None = None, extra: list[str] | None = None):
        self.port, self.nats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.namespace, self.model = namespace, str(model)
        self.log = tmp / f"mesh-{self.port}.log"
        cmd = [sys.executable, "-m", "meshserve.services.cli", "up", "--model", str(model), "--dtype", "float32",
               "--port", str(self.port), "--nats-port", str(self.nats_port), "--namespace", namespace,
               "--prefill", str(prefill), "--decode", str(decode), "--kv-cache-gb", "0.02",
               "--startup-timeout", "240", *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "MESHSERVE_SHM_DIR": str(tmp / "shm"), **(env or {})})
        self.shm_dir = tmp / "shm"

    def wait_ready(self, timeout: float = 240) -> "Mesh":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshserve up exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"mesh not healthy in {timeout}s:\n{self.log.read_text()[-4000:]}")

    def children(self) -> list[int]:
        """Every process started under the launcher (they run in their own sessions)."""
        out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
        return [int(p) for p, pp in (line.split() for line in out if line.strip()) if int(pp) == self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
