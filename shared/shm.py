"""Tensors in shared memory: one file under /dev/shm that several processes map.

The kv-pool and the model-loader create the files; workers map them with MAP_SHARED, so N workers
see one copy and a write by one (a KV block) is visible to all without a byte crossing NATS.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "uint8": torch.uint8}  # uint8: a whole buffer (shared/cuda_ipc.py exports one as such)


def shm_dir() -> Path:
    d = Path(os.environ.get("MESHSERVE_SHM_DIR", "/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def create(name: str, nbytes: int) -> Path:
    """A new zero-filled shared file (replacing a stale one of the same name)."""
    path = shm_dir() / name
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.truncate(nbytes)
    os.replace(tmp, path)
    return path


def map_bytes(path: str | Path) -> torch.Tensor:
    """The whole file as a uint8 tensor backed by a shared mapping."""
    size = os.path.getsize(path)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def view(buf: torch.Tensor, offset: int, dtype: str | torch.dtype, shape: list[int]) -> torch.Tensor:
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.finfo(dt).bits // 8 if dt.is_floating_point else n * dt.itemsize
    return buf[offset:offset + nbytes].view(dt).view(shape)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def unlink(path: str | Path) -> None:
    """Removes the name; processes that map the file keep their mapping until they unmap it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
