"""Resource partitions per model (the manifest's `memory_quota_gb`, `cpus` and `gpu_percent`).

- Memory: a model's quota covers its weights and its KV blocks on a node. The loader refuses weights
  above it; the kv-pool leases the model's workers at most `kv_quota_blocks` blocks of the node's
  arena (the quota less the weights), so a model over it evicts its own cached blocks and then
  queues, never taking another model's.
- Compute on the CPU backend: a set of cores for the model's workers (`cpus`: "0", "0-1", "0,2-3",
  or a count such as 2, which takes that many of the cores no model names, in manifest order).
  The worker moves every one of its threads onto them (`apply_cpus`) and runs at most that many
  torch threads.
- Compute on CUDA: `gpu_percent` is the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE its workers start with
  (read by the CUDA driver when the process creates its context, so it is the share of the model a
  worker starts on); it limits anything only under an MPS daemon (`MPSDaemon`,
  `meshserve up --mps`).

Pure functions and subprocess calls: no torch here (the launcher and the kv-pool import it).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("meshserve.partitions")

GB = 1 << 30
MPS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_CONTROL = "nvidia-cuda-mps-control"


class PartitionError(ValueError):
    """A partition that cannot be applied on this node (a core it lacks, more cores than it has)."""


def parse_cpus(spec) -> list[int] | int:
    """`cpus` of the manifest: a core list ("0", "0-1", "0,2-3": sorted core ids) or a count (an
    integer >= 1: that many cores)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise PartitionError(f"cpus must be a core list such as \"0-1\" or a count such as 2, not {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise PartitionError(f"cpus: a count of cores is at least 1, not {spec} (a list of cores is a string, "
                                 "such as \"0\")")
        return spec
    cores: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise PartitionError(f"cpus {spec!r}: {part!r} is not a core or a range of cores (such as 0 or 0-3)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise PartitionError(f"cpus {spec!r}: the range {part!r} is empty")
        cores.update(range(a, b + 1))
    return sorted(cores)


def resolve_cpus(models: Iterable, available: Iterable[int]) -> dict[str, list[int]]:
    """The cores of each model that has `cpus` (models: the manifest's entries, with `id` and
    `cpus`), on a node whose usable cores are `available`. A list names its cores; counts take the
    cores no list names, in manifest order, without overlap. Raises PartitionError when that is
    not possible on this node."""
    avail = sorted(set(available))
    models = [m for m in models if m.cpus is not None]
    out: dict[str, list[int]] = {}
    named: set[int] = set()
    for m in models:
        cores = parse_cpus(m.cpus)
        if isinstance(cores, list):
            missing = [c for c in cores if c not in avail]
            if missing:
                raise PartitionError(f"model {m.id!r}: cpus {m.cpus!r} names cores {missing} that this node "
                                     f"does not have (it has {format_cpus(avail)})")
            out[m.id] = cores
            named.update(cores)
    rest = [c for c in avail if c not in named]
    i = 0
    for m in models:
        n = parse_cpus(m.cpus)
        if isinstance(n, int):
            if i + n > len(rest):
                raise PartitionError(f"model {m.id!r}: cpus {n} asks for more cores than are left: {len(rest) - i} "
                                     f"of this node's {format_cpus(avail)} are named by no model before it")
            out[m.id] = rest[i:i + n]
            i += n
    return out


def format_cpus(cores: Iterable[int]) -> str:
    """"0-3,6" for [0, 1, 2, 3, 6]."""
    cores, parts = sorted(cores), []
    for c in cores:
        if parts and parts[-1][1] == c - 1:
            parts[-1][1] = c
        else:
            parts.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def process_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def apply_cpus(cores: list[int]) -> None:
    """Every thread of this process onto these cores. Linux keeps an affinity per thread (threads
    made later inherit their creator's), so the OpenMP threads already running move too."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


def threads_for(cores: list[int], threads: int | None) -> int:
    """torch threads on a set of cores: at most one per core (and at most --threads when given)."""
    return max(1, min(threads or len(cores), len(cores)))


def kv_quota_blocks(quota_gb: float | None, weights_bytes: int, block_bytes: int) -> int | None:
    """The KV blocks a model may hold on a node: its memory quota less its weights (None: no quota)."""
    if quota_gb is None:
        return None
    return max(0, (int(quota_gb * GB) - weights_bytes) // block_bytes)


def mps_env(gpu_percent: int | None) -> dict[str, str]:
    """The environment a CUDA worker of a model with `gpu_percent` starts with."""
    return {} if gpu_percent is None else {MPS_ENV: str(int(gpu_percent))}


class MPSDaemon:
    """The CUDA MPS control daemon for `meshserve up --device cuda --mps`: started when none runs
    (and stopped at exit, only then); one already running is used as it is. `binary` is looked up on
    PATH. The daemon's pipe and log directories follow CUDA_MPS_PIPE_DIRECTORY and
    CUDA_MPS_LOG_DIRECTORY, as for the workers it serves."""

    def __init__(self, binary: str | None = None):
        self.binary = binary or shutil.which(MPS_CONTROL)
        self.started = False

    def start_command(self) -> list[str]:
        return [self.binary, "-d"]

    def _control(self, command: str) -> subprocess.CompletedProcess:
        """One command on the daemon's control pipe (what `echo CMD | nvidia-cuda-mps-control` does)."""
        return subprocess.run([self.binary], input=command + "\n", capture_output=True, text=True, timeout=30)

    def running(self) -> bool:
        return self._control("get_server_list").returncode == 0

    def start(self) -> None:
        if not self.binary:
            raise PartitionError(f"--mps: {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver; "
                                 "docs/models.md says how to start MPS by hand)")
        if self.running():
            log.info("an MPS control daemon already runs: using it (not stopped at exit)")
            return
        r = subprocess.run(self.start_command(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise PartitionError(f"--mps: `{' '.join(self.start_command())}` failed ({r.returncode}): "
                                 f"{(r.stderr or r.stdout).strip()}")
        self.started = True
        log.info("started the MPS control daemon (%s)", Path(self.binary).name)

    def stop(self) -> None:
        if self.started:
            self._control("quit")
            self.started = False
