"""Layered loading: a worker runs a model's first layers while the model-loader still writes the later ones.

The loader writes a model's weights in parts, in the order a forward pass reads them (`part_of`):
part 0 holds everything a step needs first (the embedding, the final norm, a tied head), parts 1..N
the layers 0..N-1, part N+1 an untied lm_head. After each part it sets one int64 word in a small
shared file next to the weights (`<weights>-ready`, the `ready_path` of the descriptor) to the number of parts written;
-1 says the load failed. A worker's model waits on that word (`LayerGate.wait`) before it reads a
part: a load the worker started before the loader finished costs it only the parts it has not
reached. Once every part is in, the gate is done and the model drops it (no check per layer then).

No torch here: the loader's copies from the disk and host tiers run without it. The word is written
after the part's bytes by the same process (x86's stores are seen in order; the bytes go through
the page cache of one tmpfs file, which every mapping shares).
"""

from __future__ import annotations

import os
import time

import numpy as np

FAILED = -1
STALL_S = float(os.environ.get("MESHSERVE_LAYER_STALL_S", "120"))  # no new part for this long: give up


def part_of(name: str, num_layers: int) -> int:
    """Which part of the load a tensor of the loader's weights dict is in (see the module docstring)."""
    if name.startswith("layers."):
        return int(name.split(".", 2)[1]) + 1
    if name.startswith("lm_head"):
        return num_layers + 1
    return 0


def num_parts(num_layers: int) -> int:
    return num_layers + 2


class LoadFailed(RuntimeError):
    """The loader gave up on the model while a worker was already running on it."""


class LayerGate:
    """The readiness word of one layered load, as a worker's model sees it."""

    def __init__(self, path: str, total: int):
        self.path, self.total = path, total
        self._word = np.memmap(path, dtype=np.int64, mode="r", shape=(1,))
        self._inode = os.stat(path).st_ino  # a restarted loader makes a new file under the same name
        self.done = False
        self.waited_s = 0.0  # time steps spent waiting for parts (logged once it is done)

    def ready(self) -> int:
        return int(self._word[0])

    def wait(self, part: int) -> None:
        """Returns once `part` is written; raises LoadFailed if the loader failed or stalled."""
        if self.done:
            return
        got = self.ready()
        if got > part:
            self._check_done(got)
            return
        t0 = last = checked = time.monotonic()
        while got <= part:
            if got == FAILED:
                raise LoadFailed(f"the model-loader failed to load these weights ({self.path})")
            now = time.monotonic()
            if now - last > STALL_S:
                raise LoadFailed(f"the model-loader wrote no part of these weights for {STALL_S:g} s ({self.path})")
            if now - checked > 1.0:
                checked = now
                if not self._same_file():
                    raise LoadFailed(f"the model-loader dropped this load (restarted?): {self.path} is gone or new")
            time.sleep(0.0005)
            new = self.ready()
            if new != got:
                got, last = new, time.monotonic()
        self.waited_s += time.monotonic() - t0
        self._check_done(got)

    def _same_file(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def _check_done(self, got: int) -> None:
        if got >= self.total:
            self.done = True
            self._word = None  # unmapped: nothing reads it any more


def open_gate(ready_path: str | None, num_layers: int) -> LayerGate | None:
    """The gate of a descriptor's weights, or None when they were complete when it was sent."""
    if ready_path is None:
        return None
    gate = LayerGate(ready_path, num_parts(num_layers))
    gate.wait(-1)  # marks it done at once when the load finished meanwhile
    return None if gate.done else gate
