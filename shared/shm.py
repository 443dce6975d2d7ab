"""Tensors in shared memory: one file under /dev/shm that several processes map.

The kv-pool and the model-loader create the files; workers map them with MAP_SHARED, so N workers
see one copy and a write by one (a KV block) is visible to all without a byte crossing NATS.
A file maps as a torch tensor (workers, the model-loader) or as a numpy array (`map_array`: the
kv-pool, which only copies bytes and so never loads torch); torch is imported only by the former.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

ALIGN = 64
DTYPE_NAMES = ("float32", "bfloat16", "float16", "uint8",  # uint8: a whole buffer (shared/cuda_ipc.py exports one)
               "int8")  # int8: quantized weights (kernels/int8_linear.py)


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_NAMES:
        raise KeyError(name)
    return getattr(torch, name)


def shm_dir() -> Path:
    d = Path(os.environ.get("MESHSERVE_SHM_DIR", "/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def mesh_prefix(ns: str, node: str, nats_url: str) -> str:
    """The start of the names of one mesh's shared files on a node. Two meshes on one host (other
    NATS servers, the same namespace and node id: two `meshserve up`) must never share a KV arena or
    a weights file: a restarted worker of one mapped the other's arena and read and wrote its KV
    (the soak beside a benchmark: 27 streams differed). The NATS URL tells them apart, and stays the
    same across restarts of the mesh's own services (the launcher restarts nats-server on its port)."""
    tag = hashlib.sha1(nats_url.encode()).hexdigest()[:8]
    return f"meshserve-{ns}-{node}-{tag}"


def dtype_name(dtype) -> str:
    """A torch dtype's name, as descriptors carry it ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def create(name: str, nbytes: int) -> Path:
    """A new zero-filled shared file (replacing a stale one of the same name), written under a
    temporary name of its own first (the whole name and the pid, so names that differ after a dot,
    and two processes creating one name, never share it) and renamed into place."""
    path = shm_dir() / name
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.truncate(nbytes)
    os.replace(tmp, path)
    return path


def nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of that dtype name and shape."""
    n = 1
    for s in shape:
        n *= s
    return n * {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1}[dtype]


def map_bytes(path: str | Path):
    """The whole file as a uint8 torch tensor backed by a shared mapping."""
    import torch

    size = os.path.getsize(path)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def map_array(path: str | Path) -> np.ndarray:
    """The whole file as a uint8 numpy array backed by a shared mapping (no torch)."""
    return np.memmap(path, dtype=np.uint8, mode="r+")


def view(buf, offset: int, dtype, shape: list[int]):
    """A typed torch tensor at byte `offset` of a uint8 torch buffer."""
    import torch

    dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.finfo(dt).bits // 8 if dt.is_floating_point else n * dt.itemsize
    return buf[offset:offset + nbytes].view(dt).view(shape)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch(path: str | Path, ranges: list[tuple[int, int]]) -> bool:
    """Gives back the memory of byte ranges (offset, length) of a shared file: the whole pages inside
    them leave the file (it keeps its size; they read as zeros, and cost memory again only when
    written), the bytes of a page only partly inside are zeroed. The kv-pool shrinks an arena in use
    this way (services/kv_pool/arenas.py). False where the file system cannot (nothing changed)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_RDWR)
    try:
        for off, n in ranges:
            if n > 0 and libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, n) != 0:
                return False
        return True
    finally:
        os.close(fd)


def resident_bytes(path: str | Path) -> int:
    """The memory (or disk) a shared file takes now: its allocated blocks, not its size (a sparse
    file costs only what was written)."""
    return os.stat(path).st_blocks * 512


def unlink(path: str | Path) -> None:
    """Removes the name; processes that map the file keep their mapping until they unmap it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
