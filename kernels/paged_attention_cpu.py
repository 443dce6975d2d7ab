"""Loader of the compiled CPU decode-attention kernel (kernels/cpu/paged_attention.cpp).

``load()`` compiles the extension on first use (tens of seconds, once per machine: the build is
cached) and returns the module, or None when it cannot be built (no compiler, no ninja, ...); the
caller then takes the reference path in paged_attention.py. A warning is logged once.

``MESHSERVE_DISABLE_CPU_KERNELS=1`` forces the reference path.

The build goes to ``$TORCH_EXTENSIONS_DIR`` when that is set, else under meshserve's cache
(``$MESHSERVE_CACHE``, else ``$XDG_CACHE_HOME/meshserve``, else ``~/.cache/meshserve``) in
``torch_extensions/<python>-<torch>-<cpu>``: it is compiled with -march=native, so the folder is
keyed by the CPU's feature flags and a cache shared between different machines stays correct.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "cpu" / "paged_attention.cpp"
NAME = "meshserve_paged_attention_cpu"
CFLAGS = ["-O3", "-fopenmp", "-march=native"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_tried = False
_module: ModuleType | None = None


def disabled() -> bool:
    return os.environ.get("MESHSERVE_DISABLE_CPU_KERNELS", "").strip().lower() not in ("", "0", "false", "no")


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()}\n{flags}".encode()).hexdigest()[:10]


def build_dir() -> Path | None:
    """Where the extension is built; None lets torch pick (TORCH_EXTENSIONS_DIR)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    if os.environ.get("MESHSERVE_CACHE"):
        root = Path(os.environ["MESHSERVE_CACHE"]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "meshserve"
    torch_version = torch.__version__.split("+")[0].replace(".", "")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / "torch_extensions" / f"{py}-torch{torch_version}-{_cpu_tag()}" / NAME


def load() -> ModuleType | None:
    """The compiled module (``paged_decode_attention``), or None when disabled or unbuildable."""
    global _tried, _module
    if disabled():
        return None
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            from torch.utils.cpp_extension import load as load_extension

            # pip's ninja lives beside this interpreter; an unactivated venv does not have it on PATH.
            bindir = str(Path(sys.executable).parent)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
            directory = build_dir()
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
            _module = load_extension(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                     extra_ldflags=LDFLAGS,
                                     build_directory=str(directory) if directory is not None else None,
                                     verbose=False)
        except Exception as e:  # no compiler, no ninja, no headers, unwritable cache, ...
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            causes = [ln for ln in lines[1:] if any(w in ln.lower() for w in ("error", "not found", "no such"))]
            detail = " | ".join(ln[:200] for ln in lines[:1] + causes[:3])
            log.warning("CPU paged-attention kernel unavailable, using the reference path (%s: %s)",
                        type(e).__name__, detail or "no detail")
            _module = None
        _tried = True
    return _module
