"""GPU memory that one process allocates and other processes on the node map without copying.

The CUDA backend's counterpart of shared/shm.py: the model-loader keeps the weights, the kv-pool
the KV arena, in GPU memory and hands out a descriptor; a worker opens it as a torch tensor over
the same device memory, so a KV block one worker writes is the block another reads. A descriptor
is a plain dict of ints, strings and lists (JSON as it is): only it crosses the bus.

Two kinds of handle:
- "cudaipc": memory from `empty()` (one cudaMalloc through CuPy), exported with
  cudaIpcGetMemHandle and opened with cudaIpcOpenMemHandle, CuPy's documented API. For a
  node-wide buffer (the arena, the weights): one allocation, one handle, tensors at offsets.
- "torch": any other CUDA tensor (torch's caching allocator), exported and opened the way
  torch.multiprocessing does it, with torch's reference counting of shared blocks.

The exporting process must keep the memory alive while others use it (as the owner of an shm
file must not truncate it), and the processes must see the GPUs under the same indices
(CUDA_VISIBLE_DEVICES). Writes are visible across processes once the writer's stream has
synchronized. Opening a descriptor in the process that exported it returns the original memory
(CUDA does not open a process's own handles).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from .shm import dtype_name, torch_dtype

_lock = threading.RLock()  # reentrant: a mapping closed by the garbage collector inside a locked region takes it again
_owned: dict[int, tuple[int, str, "weakref.ref[torch.Tensor]"]] = {}  # base ptr -> (bytes, handle hex, buffer)
_opened: dict[str, "weakref.ref[torch.Tensor]"] = {}  # handle hex -> the mapping opened here
_exported: dict[tuple[str, int], "weakref.ref[torch.Tensor]"] = {}  # "torch" kind, for opening in this process
_open_count: dict[str, int] = {}  # handle hex -> mappings of it this process has open (closed when it drops to 0)


class _DeviceMemory:
    """Raw device memory as torch sees it (__cuda_array_interface__). torch.as_tensor keeps this
    object alive while any tensor over it lives; `close` runs when the last one is gone."""

    def __init__(self, ptr: int, nbytes: int, owner=None, close=None):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}
        self.owner, self.close = owner, close

    def __del__(self):
        if self.close is not None:
            try:
                self.close()
            except Exception:  # interpreter shutdown, context already gone
                pass


def _index(device) -> int:
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return d.index if d.index is not None else torch.cuda.current_device()


def empty(nbytes: int, device: int | str | torch.device = "cuda") -> torch.Tensor:
    """A zero-filled uint8 tensor over its own cudaMalloc allocation, which export() shares with one
    CUDA IPC handle; carve typed tensors out of it with view()."""
    import cupy

    if nbytes <= 0:
        raise ValueError("nbytes must be positive")
    dev = device if isinstance(device, int) else _index(device)
    with cupy.cuda.Device(dev):
        mem = cupy.cuda.Memory(nbytes)  # cudaMalloc (not CuPy's pool), freed with its last reference
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)).hex()
    buf = torch.as_tensor(_DeviceMemory(mem.ptr, nbytes, owner=mem), device=f"cuda:{dev}")
    buf.zero_()
    ptr = mem.ptr
    with _lock:  # forgotten with the buffer (the address may then be reused by another allocation)
        _owned[ptr] = (nbytes, handle, weakref.ref(buf, lambda _: _owned.pop(ptr, None)))
    return buf


def view(buf: torch.Tensor, offset: int, dtype: str | torch.dtype, shape: list[int]) -> torch.Tensor:
    """A contiguous tensor at byte `offset` of a uint8 buffer (as shm.view)."""
    dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    n = 1
    for s in shape:
        n *= s
    return buf[offset:offset + n * dt.itemsize].view(dt).view(shape)


def _owner(ptr: int) -> tuple[int, int, str] | None:
    with _lock:
        for base, (nbytes, handle, ref) in list(_owned.items()):
            if base <= ptr < base + nbytes and ref() is not None:
                return base, nbytes, handle
    return None


def export(t: torch.Tensor) -> dict:
    """A descriptor that open() turns back into a tensor over the same GPU memory, in any process."""
    if t.device.type != "cuda":
        raise ValueError("export() shares CUDA tensors; CPU tensors go through shared/shm.py")
    desc = {"pid": os.getpid(), "device": t.device.index, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
            "strides": list(t.stride())}
    found = _owner(t.data_ptr())
    if found is not None:
        base, nbytes, handle = found
        return desc | {"kind": "cudaipc", "handle": handle, "alloc_bytes": nbytes, "offset": t.data_ptr() - base}
    from torch.multiprocessing.reductions import reduce_tensor

    # torch.multiprocessing's own reduction; its arguments, by position (torch/multiprocessing/reductions.py):
    # cls, size, stride, storage offset, storage cls, dtype, device, handle, storage bytes, storage
    # offset bytes, requires_grad, ref counter handle, ref counter offset, event handle, event sync.
    _, args = reduce_tensor(t.detach())
    handle = _hex(args[7])
    with _lock:
        _exported[(handle, args[9])] = weakref.ref(t)
    return desc | {"kind": "torch", "storage_offset": args[3], "handle": handle, "storage_bytes": args[8],
                   "storage_offset_bytes": args[9], "ref_counter_handle": _hex(args[11]),
                   "ref_counter_offset": args[12], "event_handle": None if args[13] is None else _hex(args[13]),
                   "event_sync_required": bool(args[14])}


def _hex(x: bytes | str) -> str:
    return (x if isinstance(x, bytes) else str(x).encode()).hex()


def _strided(base: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int], strides: list[int]) -> torch.Tensor:
    """The tensor (shape, strides) at byte `offset` of a uint8 buffer."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(n > 0 for n in shape) else 0
    flat = base[offset:offset + span * dtype.itemsize].view(dtype)
    return flat.as_strided(shape, strides)


def open(desc: dict) -> torch.Tensor:  # noqa: A001 (as shm's functions, named for what they do)
    """The tensor a descriptor from export() stands for, over the exporter's GPU memory (no copy)."""
    dtype, shape, strides = torch_dtype(desc["dtype"]), list(desc["shape"]), list(desc["strides"])
    kind = desc.get("kind")
    if kind == "cudaipc":
        return _strided(_open_allocation(desc), desc["offset"], dtype, shape, strides)
    if kind == "torch":
        return _open_torch(desc, dtype, shape, strides)
    raise ValueError(f"unknown CUDA IPC descriptor kind {kind!r}")


def _open_allocation(desc: dict) -> torch.Tensor:
    """The whole allocation behind a "cudaipc" descriptor, as a uint8 tensor (opened once per process)."""
    handle, dev = desc["handle"], desc["device"]
    with _lock:
        if desc["pid"] == os.getpid():  # our own allocation
            for nbytes, h, ref in list(_owned.values()):
                if h == handle and ref() is not None:
                    return ref()
            raise ValueError("this process exported that memory and has since freed it")
        ref = _opened.get(handle)
        buf = ref() if ref is not None else None
        if buf is not None:
            return buf
        import cupy

        with cupy.cuda.Device(dev):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(handle))

        def close(ptr=ptr, dev=dev, handle=handle):
            with cupy.cuda.Device(dev):
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            with _lock:
                if _open_count.get(handle, 0) <= 1:
                    _open_count.pop(handle, None)
                else:
                    _open_count[handle] -= 1

        _open_count[handle] = _open_count.get(handle, 0) + 1
        buf = torch.as_tensor(_DeviceMemory(ptr, desc["alloc_bytes"], close=close), device=f"cuda:{dev}")
        _opened[handle] = weakref.ref(buf)
        return buf


def open_handles() -> list[str]:
    """The "cudaipc" handles of other processes' allocations this process still has open: a worker
    reports them in its heartbeats, and their creator frees a retired allocation only once no
    worker lists it (node_memory.RetiredBuffers). A mapping closes when the last tensor over it is
    collected: run gc.collect() first where the tensors may sit in reference cycles."""
    with _lock:
        return sorted(_open_count)


def _open_torch(desc: dict, dtype: torch.dtype, shape: list[int], strides: list[int]) -> torch.Tensor:
    if desc["pid"] == os.getpid():
        with _lock:
            ref = _exported.get((desc["handle"], desc["storage_offset_bytes"]))
        t = ref() if ref is not None else None
        if t is None:
            raise ValueError("this process exported that tensor and has since freed it")
        return t.as_strided(shape, strides, desc["storage_offset"])
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    event = desc["event_handle"]
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), tuple(strides), desc["storage_offset"], torch.storage.TypedStorage, dtype,
        desc["device"], bytes.fromhex(desc["handle"]), desc["storage_bytes"], desc["storage_offset_bytes"], False,
        bytes.fromhex(desc["ref_counter_handle"]), desc["ref_counter_offset"],
        None if event is None else bytes.fromhex(event), desc["event_sync_required"])
