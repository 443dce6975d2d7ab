"""One load of a model into the node's mapped tier, from whichever tier holds it, in two steps:
`open_*` makes the shared buffer at its full size (the layout, so the descriptor, is known then),
`Load.run` writes it part by part in the order a forward pass reads it (shared/model/layer_gate.py),
setting the readiness word after each part when the load is layered. The loader answers a layered
load between the two steps, so workers build their engine and start computing meanwhile.

- host: the bytes kept in the loader's memory, written with pwrite;
- disk: the prepared file (prepared.py), copied range by range in the kernel (sendfile), no torch
  (on CUDA: read range by range and copied into the GPU allocation);
- source: the model's files read (a directory's safetensors tensor by tensor, as each part needs
  them; a GGUF whole), dequantized and fused one part at a time (`fused_parts`): the layout comes
  from the first two parts (every layer has layer 0's shapes), the lm_head, fused first, is
  written last.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from meshserve.shared import node_memory, shm
from meshserve.shared.model.layer_gate import FAILED, num_parts, part_of
from meshserve.shared.schemas import TensorSpec

# Test and bench only: seconds the loader waits after writing each part, so that a test can see a
# worker compute while the later layers are still coming (tests/test_layered.py, bench-models).
PART_DELAY_ENV = "MESHSERVE_LOADER_PART_DELAY_S"


class LoadStopped(RuntimeError):
    """`Load.run` stopped early: the load failed or was given up while it wrote."""


@dataclass
class Load:
    path: str
    specs: list[TensorSpec]
    config: dict
    tier: str  # where it came from: host | disk (the prepared form) | source (the model's files)
    how: str
    write_parts: Callable[[Callable[[int], None]], None]  # writes every part, calling done(parts written) after each
    ipc: dict | None = None
    buffer: object | None = None  # cuda: the allocation, kept alive for the workers
    keep_to: Path | None = None  # source loads of a GGUF: where the prepared form is kept afterwards
    ready_path: str | None = None  # layered: the readiness word's file
    name: str = ""  # the load's own name on the node (its file's on cpu; a cuda path names only the device)
    nbytes: int = 0
    _word: np.memmap | None = field(default=None, repr=False)
    _failed: bool = field(default=False, repr=False)

    def layered(self) -> None:
        """Makes the readiness word (0 parts written): workers may map the buffer before `run` ends.
        It is host memory on either backend: on cuda a part's copies are synchronized before the word
        says it is in, and a worker launches a layer's kernels only after reading the word."""
        self.ready_path = str(shm.create(self.name + "-ready", 8))
        self._word = np.memmap(self.ready_path, dtype=np.int64, mode="r+", shape=(1,))

    def run(self) -> None:
        delay = float(os.environ.get(PART_DELAY_ENV, "0") or 0)

        def done(k: int) -> None:
            if delay:
                time.sleep(delay)
            if self._failed:  # given up meanwhile (the loader stops): no more parts
                raise LoadStopped(f"the load into {self.path} was given up after {k} parts")
            if self._word is not None:
                self._word[0] = k

        self.write_parts(done)
        self.write_parts = None  # what it held (a source load's state dict) can go
        if self.tier == "source":
            return_freed_memory()

    def failed(self) -> None:
        """Tells the workers already on it (layered), frees the buffer's name, and stops `run` (in
        another thread) at its next part."""
        self._failed = True
        if self._word is not None:
            self._word[0] = FAILED
        self.release()

    def release(self) -> None:
        node_memory.release("cuda" if self.ipc else "cpu", self.path)
        if self.ready_path:
            shm.unlink(self.ready_path)


def return_freed_memory() -> None:
    """Hands the heap memory freed so far back to the system. glibc keeps freed pages for reuse, and
    a source load frees hundreds of MB (the model read, dequantized and fused, in the loader's
    threads' arenas) that would otherwise stay in the loader's RSS for the rest of its life."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return
    trim(0)


def part_ranges(specs: list[TensorSpec], config: dict) -> list[list[tuple[int, int]]]:
    """Each part's byte ranges in the file, merged where adjacent."""
    num_layers = _layers(config)
    parts: list[list[tuple[int, int]]] = [[] for _ in range(num_parts(num_layers))]
    for s in sorted(specs, key=lambda s: s.offset):
        r = parts[part_of(s.name, num_layers)]
        a, b = s.offset, s.offset + shm.nbytes(s.dtype, s.shape)
        if r and 0 <= a - r[-1][1] < shm.ALIGN:  # only alignment padding between them
            r[-1] = (r[-1][0], b)
        else:
            r.append((a, b))
    return parts


def _layers(config: dict) -> int:
    return int(config["num_hidden_layers"])


def copy_parts(buf, parts: list[list[tuple[int, int]]], read: Callable[[int, int], bytes]):
    """A `Load.write_parts` that copies each part's byte ranges, `read(a, b)`, into a torch uint8
    buffer (the CUDA backend's allocation), synchronizing a GPU after each part so that the part's
    readiness word follows its copies."""
    import torch

    def write(done):
        for k, ranges in enumerate(parts, 1):
            for a, b in ranges:
                data = read(a, b)
                if len(data) != b - a:
                    raise OSError(f"bytes {a}-{b} of the layout: only {len(data)} there")
                buf[a:b].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
            done(k)

    return write


def open_host(name: str, data: bytes, specs: list[TensorSpec], config: dict, device: str = "cpu") -> Load:
    """The host tier's bytes back into the mapped tier: pwrite into a new shared file, or on cuda
    copied into a new GPU allocation part by part."""
    parts, view = part_ranges(specs, config), memoryview(data)
    if device == "cuda":
        buf, path, ipc = node_memory.create(name, len(data), device)
        return Load(path, specs, config, "host", "from host memory", copy_parts(buf, parts, lambda a, b: view[a:b]),
                    ipc=ipc, buffer=buf, nbytes=len(data), name=name)
    path = shm.create(name, len(data))

    def write(done):
        fd = os.open(path, os.O_WRONLY)
        try:
            for k, ranges in enumerate(parts, 1):
                for a, b in ranges:
                    while a < b:
                        a += os.pwrite(fd, view[a:b], a)
                done(k)
        finally:
            os.close(fd)

    return Load(str(path), specs, config, "host", "from host memory", write, nbytes=len(data), name=name)


def read_back(path: str, buffer=None) -> bytes:
    """A mapped load's bytes, for the host tier: its shared file's, or its GPU allocation's."""
    if buffer is not None:
        return buffer.cpu().numpy().tobytes()
    return Path(path).read_bytes()


def read_file(src: Path) -> Callable[[int, int], bytes]:
    """read(a, b): bytes a to b of the file."""
    def read(a: int, b: int) -> bytes:
        with open(src, "rb") as f:
            return os.pread(f.fileno(), b - a, a)

    return read


def open_prepared(name: str, src: Path, specs: list[TensorSpec], config: dict, how: str, device: str = "cpu") -> Load:
    size = os.path.getsize(src)
    parts = part_ranges(specs, config)
    if device == "cuda":  # read part by part into a new GPU allocation
        buf, path, ipc = node_memory.create(name, size, device)
        return Load(path, specs, config, "disk", how, copy_parts(buf, parts, read_file(src)), ipc=ipc, buffer=buf,
                    nbytes=size, name=name)
    path = shm.create(name, size)

    def write(done):
        with open(src, "rb") as fin, open(path, "r+b") as fout:
            for k, ranges in enumerate(parts, 1):
                for a, b in ranges:
                    os.lseek(fout.fileno(), a, os.SEEK_SET)
                    while a < b:
                        n = os.sendfile(fout.fileno(), fin.fileno(), a, b - a)
                        if n == 0:
                            raise OSError(f"{src} ended at byte {a}, its layout says {b}")
                        a += n
                done(k)

    return Load(str(path), specs, config, "disk", how, write, nbytes=size, name=name)


def open_source(model: str, dtype: str, quantization: str | None, name: str, device: str) -> Load:
    """Reads the model's files; the first part and layer 0 are fused now (the layout), the rest in `run`."""
    from meshserve.shared.engine.llm import DTYPES
    from meshserve.shared.model.llama import fused_parts
    from meshserve.shared.model.weights import load_hf_dir
    from meshserve.shared.models_repo import load_model_files, resolve

    path = resolve(model)
    if path.is_dir() and (path / "config.json").is_file():  # its tensors read layer by layer; no tokenizer
        cfg, sd = load_hf_dir(path, lazy=True)
    else:
        cfg, sd, _ = load_model_files(model)
    n = cfg.num_hidden_layers
    parts = fused_parts(cfg, sd, DTYPES[dtype], device, quantization)
    first = next(parts)
    layer0 = next(parts) if n else {}
    head = {k: v for k, v in first.items() if part_of(k, n) == n + 1}
    shapes = [{k: v for k, v in first.items() if k not in head}, layer0]
    specs, offset = [], 0

    def place(key: str, t) -> None:
        nonlocal offset
        specs.append(TensorSpec(name=key, dtype=shm.dtype_name(t.dtype), shape=list(t.shape), offset=offset))
        offset = shm.aligned(offset + t.numel() * t.element_size())

    for part in shapes:
        for key, t in part.items():
            place(key, t)
    for i in range(1, n):  # every layer has layer 0's tensors and shapes
        for key, t in layer0.items():
            place(key.replace("layers.0.", f"layers.{i}.", 1), t)
    for key, t in head.items():
        place(key, t)
    buf, path, ipc = node_memory.create(name, max(offset, 1), device)
    by_name = {s.name: s for s in specs}

    def put(w: dict) -> None:
        for key, t in w.items():
            s = by_name.get(key)
            if s is None or list(t.shape) != s.shape or shm.dtype_name(t.dtype) != s.dtype:
                raise ValueError(f"{model}: the tensor {key} ({list(t.shape)}, {t.dtype}) does not have layer 0's "
                                 "shape: layered loading needs every layer alike")
            shm.view(buf, s.offset, s.dtype, s.shape).copy_(t)
        if buf.is_cuda:  # written before any worker hears of it
            import torch

            torch.cuda.synchronize(buf.device)

    def write(done):
        put(shapes[0])
        done(1)
        if n:
            put(layer0)
            done(2)
        for i, w in enumerate(parts, 2):
            put(w)
            done(i + 1)
        put(head)
        done(n + 2)

    config = dataclasses.asdict(cfg)
    return Load(path, specs, config, "source", "prepared", write, ipc=ipc, buffer=buf if buf.is_cuda else None,
                nbytes=offset, name=name)
