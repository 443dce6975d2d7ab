"""Memory that every process of a node opens without copying: the model weights (the model-loader
creates them) and the KV arena (the kv-pool), on either backend, behind one pair of calls.

- "cpu": a shared-memory file (shared/shm.py); the descriptor's `path` names it.
- "cuda": one cudaMalloc allocation exported with a CUDA IPC handle (shared/cuda_ipc.py); the
  descriptor carries that handle as `ipc`, and `path` only says where it lives ("cuda:0"). The
  process that created it must keep the buffer alive while others have it open: CUDA leaves freeing
  an exported allocation before every importer closed it undefined. So the model-loader and the
  kv-pool hand a buffer they are done with to `RetiredBuffers`, which frees it once every worker of
  the node has said, in a heartbeat sent after, that it no longer has the handle open. Every
  process must see the GPU under the same index (the same CUDA_VISIBLE_DEVICES).

Either way the buffer is a uint8 tensor; typed tensors are views at byte offsets (shm.view). A
process that only copies bytes (the kv-pool) asks for a cpu buffer as a numpy array instead
(`numpy=True`) and then never imports torch; torch is imported here only when a tensor is made.
`meshserve up --device cuda` and `meshserve serve ... --device cuda` pick the CUDA backend.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from . import shm

BACKENDS = ("cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    """--device names a backend this machine cannot run."""


def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can (a GPU torch sees, and CuPy)."""
    import torch

    if not torch.cuda.is_available():
        build = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}" if torch.version.cuda
                 else f"torch {torch.__version__} is a CPU-only build")
        return f"no CUDA device is visible here (torch.cuda.is_available() is False; {build})"
    try:
        import cupy  # noqa: F401 - CUDA IPC handles and the kernels go through CuPy
    except ImportError as e:
        return f"CuPy is not installed ({e}): pip install 'meshserve[cuda]' (CUDA 12) or 'meshserve[cuda13]' (CUDA 13)"
    return None


def require(device: str) -> None:
    """Raises DeviceUnavailable, with the reason, when `device` cannot run here."""
    if device not in BACKENDS:
        raise DeviceUnavailable(f"unknown device {device!r} (one of {', '.join(BACKENDS)})")
    if device == "cuda":
        problem = cuda_problem()
        if problem:
            raise DeviceUnavailable(f"--device cuda: {problem}")


def check_backend(what: str, backend: str, device: str) -> None:
    """A worker runs on the backend its node's weights and arena live on; a mismatch is an error."""
    if backend != device:
        raise DeviceUnavailable(f"the node's {what} is on {backend} memory but this process runs with --device "
                                f"{device}: start the node's model-loader, kv-pool and workers with the same --device")


def create(name: str, nbytes: int, device: str = "cpu", numpy: bool = False) -> tuple[object, str, dict | None]:
    """A zero-filled uint8 buffer other processes of the node can open: (buffer, path, ipc).
    cpu: the shared file `name` (a numpy array with `numpy`, else a torch tensor); cuda: a new
    allocation on the current GPU (a torch tensor) and its IPC descriptor."""
    if device == "cpu":
        path = shm.create(name, nbytes)
        return (shm.map_array(path) if numpy else shm.map_bytes(path)), str(path), None
    require(device)
    import torch

    from . import cuda_ipc

    buf = cuda_ipc.empty(nbytes, torch.cuda.current_device())
    return buf, f"cuda:{buf.device.index}", cuda_ipc.export(buf)


def open_buffer(backend: str, path: str, ipc: dict | None = None, numpy: bool = False):
    """The buffer a descriptor names, as a uint8 tensor over the same memory (no copy); a cpu
    buffer as a numpy array with `numpy`."""
    if backend == "cpu":
        return shm.map_array(path) if numpy else shm.map_bytes(path)
    if backend == "cuda":
        if not ipc:
            raise ValueError(f"a cuda descriptor ({path}) without its CUDA IPC handle")
        require("cuda")
        from . import cuda_ipc

        return cuda_ipc.open(ipc)
    raise ValueError(f"unknown backend {backend!r}")


def release(backend: str, path: str) -> None:
    """The creator is done with a buffer: a shared file loses its name (mappings stay valid); GPU
    memory goes with the creator's last reference to it."""
    if backend == "cpu":
        shm.unlink(path)


def weights_nbytes(desc) -> int:
    """The bytes a model's weights take on the node, as the loader counts them against the model's
    `memory_quota_gb` (and the kv-pool subtracts them from it): the shared file's size, or the GPU
    tensors' bytes."""
    import os

    if desc.backend == "cpu":
        return os.path.getsize(desc.path)
    return sum(shm.nbytes(t.dtype, t.shape) for t in desc.tensors)


@dataclass
class _Retired:
    buffer: object
    nbytes: int
    what: str
    at: float  # monotonic time of the retirement


@dataclass
class RetiredBuffers:
    """GPU allocations their creator is done with, kept until no worker of the node has them open.

    A worker opens an allocation by its CUDA IPC handle and lists the handles it still has open in
    each heartbeat (`Heartbeat.ipc_open`, shared/cuda_ipc.py `open_handles`). A retired buffer is
    freed (the last reference dropped: cudaFree) once every worker heard from has sent a heartbeat
    after the retirement that does not list its handle; a worker silent for `timeout_s` is gone, and
    its process's handles closed with it. The creator calls `heard` for each heartbeat of its node,
    `asked` when it hands a descriptor to a worker (which may not have sent a heartbeat yet), and
    `collect` now and then."""
    timeout_s: float
    pending: dict[str, _Retired] = field(default_factory=dict)  # handle -> the buffer waiting to be freed
    # worker -> (when heard, the handles it has open; None: handed a descriptor, not heard from since)
    reports: dict[str, tuple[float, frozenset[str] | None]] = field(default_factory=dict)
    freed: int = 0
    freed_bytes: int = 0

    def retire(self, handle: str, buffer: object, nbytes: int, what: str, now: float | None = None) -> None:
        self.pending[handle] = _Retired(buffer, nbytes, what, time.monotonic() if now is None else now)

    def asked(self, worker: str, now: float | None = None) -> None:
        """`worker` was handed a descriptor: one never heard from counts as having every handle open."""
        if worker not in self.reports:
            self.reports[worker] = (time.monotonic() if now is None else now, None)

    def heard(self, worker: str, handles: list[str], now: float | None = None) -> None:
        self.reports[worker] = (time.monotonic() if now is None else now, frozenset(handles))

    def collect(self, now: float | None = None, heard_since: float = -math.inf) -> list[str]:
        """Frees the buffers no live worker has open any more; returns what they were. heard_since:
        since when the creator has been on the bus (Bus.heard_since); a silence before is not a
        worker's."""
        now = time.monotonic() if now is None else now
        for w in [w for w, (at, _) in self.reports.items() if now - max(at, heard_since) > self.timeout_s]:
            del self.reports[w]  # silent: its process is gone, and its handles closed with it
        done = [h for h, r in self.pending.items()
                if all(open_ is not None and at > r.at and h not in open_ for at, open_ in self.reports.values())]
        freed = []
        for h in done:
            r = self.pending.pop(h)
            self.freed, self.freed_bytes = self.freed + 1, self.freed_bytes + r.nbytes
            freed.append(r.what)
        return freed

    @property
    def pending_bytes(self) -> int:
        return sum(r.nbytes for r in self.pending.values())

    def status(self) -> dict:
        return {"pending": sorted(r.what for r in self.pending.values()), "pending_bytes": self.pending_bytes,
                "freed": self.freed, "freed_bytes": self.freed_bytes}
