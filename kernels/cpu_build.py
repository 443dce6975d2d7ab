"""Builds and loads the compiled CPU kernels (kernels/cpu/*.cpp), one torch extension each.

``load(name, source)`` compiles an extension on first use (seconds, once per machine: the build
is cached) and returns the module, or None when it cannot be built (no compiler, no ninja, ...);
the caller then takes its Python reference path. A warning is logged once per extension.

``MESHSERVE_DISABLE_CPU_KERNELS=1`` forces the reference path.

A build leaves a stamp (the hash of its source and of the kernels/cpu/ headers it includes, its
flags, torch and Python versions) beside the library; a later load whose stamp matches imports
the library directly. Asking torch to load it instead costs a second or more per kernel on every
start even when nothing is rebuilt (importing its build helpers, then running ninja to find
nothing to do), and every worker loads several.

The build goes to ``$TORCH_EXTENSIONS_DIR`` when that is set, else under meshserve's cache
(``$MESHSERVE_CACHE``, else ``$XDG_CACHE_HOME/meshserve``, else ``~/.cache/meshserve``) in
``torch_extensions/<python>-<torch>-<cpu>``: it is compiled with -march=native, so the folder is
keyed by the CPU's feature flags and a cache shared between different machines stays correct.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import re
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "cpu"
CFLAGS = ["-O3", "-fopenmp", "-march=native"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}  # name -> module, or None once a build failed


def disabled() -> bool:
    return os.environ.get("MESHSERVE_DISABLE_CPU_KERNELS", "").strip().lower() not in ("", "0", "false", "no")


# From this many rows on, torch's GEMM on AMX tiles (oneDNN) computes a bf16 projection faster than
# the AVX-512 kernels here: a prefill chunk or a decode step of 16+ sequences, not batch-1 decode
# (measured with `python -m meshserve.bench.linear_bench`: at 4 rows the kernel is 1.4-2.3x faster,
# at 16 the GEMM 1.3-2.1x). int8 weights are dequantized for it on every call (no second copy), so
# they go to it from a multiple of this (kernels/int8_linear.py says which).
# MESHSERVE_AMX_GEMM_MIN_ROWS overrides it (the int8 threshold keeps its multiple); 0 never hands a
# projection to the GEMM.
AMX_GEMM_MIN_ROWS = 16


@functools.cache
def amx_gemm_min_rows() -> int:
    """AMX_GEMM_MIN_ROWS (or its override) where torch can use AMX tiles, else 0 (never)."""
    try:
        n = int(os.environ.get("MESHSERVE_AMX_GEMM_MIN_ROWS", AMX_GEMM_MIN_ROWS))
    except ValueError:
        n = AMX_GEMM_MIN_ROWS
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return n if n > 0 and amx() else 0


def amx_gemm(rows: int, factor: float = 1) -> bool:
    """Whether a bf16 projection of `rows` input rows goes to torch's GEMM on AMX tiles (from
    `factor` times the threshold: int8 weights, dequantized per call)."""
    n = amx_gemm_min_rows() * factor
    return 0 < n <= rows


@functools.cache
def _cpuinfo() -> tuple[str, ...]:
    """/proc/cpuinfo's lines (none where it cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return tuple(f)
    except OSError:
        return ()


@functools.cache
def cpu_family() -> tuple[str, int] | None:
    """(vendor, family) of this CPU from /proc/cpuinfo, e.g. ("AuthenticAMD", 26) for a Zen 5; None
    where it does not say (not Linux, not x86)."""
    fields = {}
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    try:
        return fields["vendor_id"], int(fields["cpu family"])
    except (KeyError, ValueError):
        return None


def _cpu_tag() -> str:
    flags = "".join(line for line in _cpuinfo() if line.startswith(("flags", "Features", "model name")))
    return hashlib.sha1(f"{platform.machine()}\n{flags}".encode()).hexdigest()[:10]


def build_dir() -> Path:
    """Where the extensions are built, one folder each."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if os.environ.get("MESHSERVE_CACHE"):
        root = Path(os.environ["MESHSERVE_CACHE"]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "meshserve"
    torch_version = torch.__version__.split("+")[0].replace(".", "")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / "torch_extensions" / f"{py}-torch{torch_version}-{_cpu_tag()}"


def _local_headers(source: str, seen: set[str] | None = None) -> list[str]:
    """The headers of kernels/cpu/ that `source` includes (#include "x.h"), directly or through another."""
    seen = set() if seen is None else seen
    for line in (SOURCES / source).read_text().splitlines():
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m and m.group(1) not in seen and (SOURCES / m.group(1)).is_file():
            seen.add(m.group(1))
            _local_headers(m.group(1), seen)
    return sorted(seen)


def _stamp(name: str, source: str) -> str:
    h = hashlib.sha256((SOURCES / source).read_bytes())
    for header in _local_headers(source):  # a changed header is a changed kernel
        h.update((SOURCES / header).read_bytes())
    h.update(repr((name, CFLAGS, LDFLAGS, torch.__version__, sys.version)).encode())
    return h.hexdigest()


def _import_built(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name: str, source: str) -> ModuleType | None:
    """The compiled module `name` built from kernels/cpu/`source`, or None when disabled or unbuildable."""
    if disabled():
        return None
    if name in _modules:
        return _modules[name]
    with _lock:
        if name in _modules:
            return _modules[name]
        want = _stamp(name, source)
        # One directory per source version: checkouts of different versions sharing the cache (or
        # building at once) never load or overwrite each other's library.
        directory = build_dir() / f"{name}-{want[:16]}"
        stamp, library = directory / "meshserve.stamp", directory / f"{name}.so"
        try:
            if library.is_file() and stamp.is_file() and stamp.read_text() == want:
                _modules[name] = _import_built(name, library)
                return _modules[name]
        except (OSError, ImportError) as e:  # then torch rebuilds it
            log.info("CPU kernel %s: the built library did not load (%s); rebuilding", name, e)
        try:
            from torch.utils.cpp_extension import load as load_extension

            # pip's ninja lives beside this interpreter; an unactivated venv does not have it on PATH.
            bindir = str(Path(sys.executable).parent)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
            directory.mkdir(parents=True, exist_ok=True)
            module = load_extension(name=name, sources=[str(SOURCES / source)], extra_cflags=CFLAGS,
                                     extra_ldflags=LDFLAGS, build_directory=str(directory), verbose=False)
            stamp.write_text(want)
        except Exception as e:  # no compiler, no ninja, no headers, unwritable cache, ...
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            causes = [ln for ln in lines[1:] if any(w in ln.lower() for w in ("error", "not found", "no such"))]
            detail = " | ".join(ln[:200] for ln in lines[:1] + causes[:3])
            log.warning("CPU kernel %s unavailable, using the reference path (%s: %s)", name,
                        type(e).__name__, detail or "no detail")
            module = None
        _modules[name] = module
    return module
