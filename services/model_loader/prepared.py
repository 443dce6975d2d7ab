"""The model-loader's disk tier: a model's weights exactly as the loader puts them in shared memory
(dequantized, q|k|v and gate|up fused, projections in the CPU kernel's blocked layout, or int8 in
the int8 kernel's), kept on
disk once prepared, so a later start copies one file into shared memory instead of dequantizing
the GGUF again (seconds of Python on every start, against a file copy).

Kept for GGUF files and Hugging Face directories, per backend (the CUDA backend keeps its own
layout: the bytes of its GPU allocation, copied back part by part). A directory's safetensors need
no dequantization, but their fusing and re-layout cost more than the copy: random-1b (2.2 GB, bf16)
took 2.4-4.5 s and 10 s of the loader's CPU from its files, 0.9 s from its prepared form in the page
cache, on a quiet 2-core machine (docs/benchmarks/README.md, eighteenth session). An entry
is named by the model's identity (models_repo.prepared_dir), the device, the dtype and
quantization, and the recipe: the source of the modules that prepare
weights and the gguf and torch versions, so changing any of them makes a new entry, never a stale hit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
from pathlib import Path

from meshserve.shared.models_repo import prepared_dir, publish_dir
from meshserve.shared.schemas import TensorSpec

log = logging.getLogger("meshserve.model_loader")

# the modules that make the prepared bytes, and the config kept beside them (config.py, gguf_meta.py)
RECIPE_MODULES = ("meshserve.shared.model.weights", "meshserve.shared.model.llama", "meshserve.kernels.linear",
                  "meshserve.kernels.int8_linear", "meshserve.shared.model.config", "meshserve.shared.model.gguf_meta")
RECIPE_DISTRIBUTIONS = ("gguf", "torch")


@functools.cache
def recipe() -> str:
    """What the prepared bytes depend on besides the file: the code and the versions that make them."""
    h = hashlib.sha256()
    for name in RECIPE_MODULES:
        h.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    for dist in RECIPE_DISTRIBUTIONS:
        h.update(importlib.metadata.version(dist).encode())
    from meshserve.kernels.int8_linear import dequantized_form
    from meshserve.kernels.linear import keeps_plain

    h.update(b"plain+blocked" if keeps_plain() else b"blocked")  # what this CPU's layout keeps
    h.update({None: b"", "plain": b"+int8bf16", "blocked": b"+int8bf16n32k2"}[dequantized_form()])
    return h.hexdigest()[:16]


def entry(model: Path, variant: str, device: str) -> Path | None:
    """Where this model's prepared weights are kept (a GGUF file or a Hugging Face directory), or None
    where none are kept. variant: the dtype, and "-int8" after it for int8 weights."""
    gguf = model.is_file() and model.suffix.lower() == ".gguf"
    if not gguf and not (model.is_dir() and (model / "config.json").is_file()):
        return None
    return prepared_dir(model, "weights", variant, device, version=recipe())


def load(kept: Path) -> tuple[Path, list[TensorSpec], dict] | None:
    """The kept weights' file, tensors and model config, or None when nothing is kept there yet
    (loads.open_prepared copies the file into shared memory)."""
    meta = kept / "weights.json"
    if not meta.is_file():
        return None
    m = json.loads(meta.read_text())
    return kept / "weights.bin", [TensorSpec(**t) for t in m["tensors"]], m["config"]


class KeepStopped(OSError):
    """The loader stops: a prepared form being written is given up (and its partial copy removed)."""


def keep(kept: Path, shm_path: str, specs: list[TensorSpec], config: dict, gpu_buffer=None,
         stop: threading.Event | None = None) -> None:
    """Keeps what was just written to shared memory (or to `gpu_buffer`, on CUDA) for the next start
    (best effort: a cache that cannot be written costs only the time saved). `stop` set: given up."""
    tmp = None
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kept.name}.", dir=kept.parent))
        if gpu_buffer is not None:
            gpu_buffer.cpu().numpy().tofile(tmp / "weights.bin")
        else:
            copy_direct(shm_path, tmp / "weights.bin", stop=stop)
        (tmp / "weights.json").write_text(json.dumps({"tensors": [s.model_dump() for s in specs], "config": config}))
        publish_dir(tmp, kept)
    except OSError as e:
        (log.info if isinstance(e, KeepStopped) else log.warning)("could not keep the prepared weights in %s: %s",
                                                                  kept, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def copy_direct(src: str, dst: Path, chunk: int = 1 << 22, stop: threading.Event | None = None) -> None:
    """Copies a file, writing with O_DIRECT where the file system allows it: through the page cache
    the copy and its writeback took 5.2 s of CPU for 2 GiB on this project's 2-core VM, beside the
    worker computing the model's first prompt; direct, 0.44 s (dd, /dev/shm to the cache's disk)."""
    size = os.path.getsize(src)
    aligned = size - size % 4096  # O_DIRECT writes whole blocks; the tail is written plainly
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:  # e.g. tmpfs: no O_DIRECT
        shutil.copyfile(src, dst)
        return
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    view = memoryview(buf)
    try:
        with open(src, "rb", buffering=0) as f:
            for off in range(0, aligned, chunk):
                if stop is not None and stop.is_set():
                    raise KeepStopped(f"stopped copying {src}")
                n = min(chunk, aligned - off)
                got = f.readinto(view[:n])
                if got != n:
                    raise OSError(f"{src}: short read at {off}")
                os.pwrite(out, view[:n], off)
            os.close(out)
            out = None
            if aligned < size:
                with open(dst, "r+b") as tail:
                    f.seek(aligned)
                    tail.seek(aligned)
                    tail.write(f.read())
    finally:
        if out is not None:
            os.close(out)
        view.release()
        buf.close()


async def keep_quietly(kept: Path, shm_path: str, specs: list[TensorSpec], config: dict, gpu_buffer=None,
                       stop: threading.Event | None = None) -> None:
    """`keep` on a thread of its own at the lowest CPU priority (nice 19): it runs while the model's
    first requests compute (what kept it off their TTFT was the O_DIRECT copy, `copy_direct`; nice
    alone did not). Its own thread, as a thread's niceness cannot be lowered again without privilege;
    not a daemon, so that a loader stopping (`stop` set) removes the partial copy before it exits."""
    import asyncio

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        try:
            keep(kept, shm_path, specs, config, gpu_buffer, stop)
        finally:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    threading.Thread(target=run, name="keep-prepared").start()
    await done
