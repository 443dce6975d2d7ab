"""The model-loader's books: which tier each model is in, who maps it, and what to evict.

Pure bookkeeping (no I/O, no torch), so the policy can be read and tested alone: the loader does the
copies. Tiers, hottest first: `mapped` (in the node's shared memory, workers map it), `host` (a
copy in the loader's memory), `disk` (the prepared form or the model's files). A model goes down a
tier when its tier is over budget, the least recently used first; a pinned model and one a worker
maps now are never chosen.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

GB = 1 << 30
Key = tuple[str, str, str | None]  # (path, dtype, quantization)


@dataclass
class Entry:
    key: Key
    name: str
    tier: str = "disk"  # mapped | host | disk | loading | failed
    desc: object | None = None  # its WeightsDescriptor while mapped
    ready_path: str | None = None  # its layered load's readiness file (workers may still map it)
    host: bytes | None = None  # its bytes while in the host tier
    meta: tuple | None = None  # (tensors, config) of the host copy
    nbytes: int = 0
    users: set[str] = field(default_factory=set)  # workers that map it now
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False
    removed: bool = False  # no longer in the manifest: unloaded once no worker maps it
    error: str | None = None
    loading: asyncio.Future | None = None
    loads: dict[str, int] = field(default_factory=dict)  # tier it came from -> count
    load_s: dict[str, float] = field(default_factory=dict)  # tier it came from -> seconds, the last time
    evictions: int = 0
    hits: int = 0  # asks that found it mapped
    prewarms: int = 0  # times a prewarm brought it up a tier ahead of its requests


class Tiers:
    def __init__(self, weights_budget: int | None, host_budget: int, max_mapped: int):
        self.weights_budget, self.host_budget, self.max_mapped = weights_budget, host_budget, max_mapped
        self.entries: dict[Key, Entry] = {}
        self.user_of: dict[str, Key] = {}  # worker -> the model it maps
        self.beside_of: dict[str, set[Key]] = {}  # worker -> what it maps beside it (a speculative draft)
        self.over_budget = 0  # loads that left the mapped tier over its budget (pinned or in use)

    def entry(self, key: Key, name: str) -> Entry:
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = Entry(key, name)
        return e

    def touch(self, e: Entry) -> None:
        e.last_used = time.monotonic()

    def use(self, worker: str, e: Entry, beside: bool = False) -> None:
        """The worker maps `e` from now on, and no longer the model it mapped before (nor what it
        mapped beside that); `beside`: as well as its model (its draft), until its next model."""
        if beside:
            self.beside_of.setdefault(worker, set()).add(e.key)
        else:
            self.release(worker)
            self.user_of[worker] = e.key
        e.users.add(worker)
        self.touch(e)

    def release(self, worker: str) -> None:
        for key in [self.user_of.pop(worker, None), *self.beside_of.pop(worker, ())]:
            old = self.entries.get(key)
            if old is not None:
                old.users.discard(worker)
                self.touch(old)  # used until now

    def mapped(self, e: Entry, desc, nbytes: int, ready_path: str | None = None) -> None:
        came = "source" if desc.tier == "source" else desc.tier
        e.tier, e.desc, e.nbytes, e.error, e.ready_path = "mapped", desc, nbytes, None, ready_path
        e.host = e.meta = None
        e.loads[came] = e.loads.get(came, 0) + 1
        e.load_s[came] = round(desc.load_s, 4)
        self.touch(e)

    def moved(self, e: Entry, tier: str) -> None:
        e.tier, e.desc, e.ready_path = tier, None, None
        e.evictions += 1

    def drop(self, e: Entry) -> None:
        self.entries.pop(e.key, None)

    def _in(self, tier: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.tier == tier]

    def used_bytes(self, tier: str) -> int:
        return sum(e.nbytes for e in self._in(tier))

    def evictions(self) -> list[tuple[Entry, str]]:
        """What to move down now, in order: (entry, to tier), as the budgets ask. Applied by the caller
        (which calls `moved`) before it asks again."""
        out: list[tuple[Entry, str]] = []
        mapped = sorted(self._in("mapped"), key=lambda e: e.last_used)
        count, used = len(mapped), sum(e.nbytes for e in mapped)
        over = lambda: (self.weights_budget is not None and used > self.weights_budget) or count > self.max_mapped  # noqa: E731
        for e in mapped:
            if not over():
                break
            if e.pinned or e.users:
                continue
            to = "host" if e.nbytes <= self.host_budget else "disk"  # older host copies make room for it
            out.append((e, to))
            count, used = count - 1, used - e.nbytes
        if over():
            self.over_budget += 1
        hosted = sorted(self._in("host"), key=lambda e: e.last_used)
        host_used = sum(e.nbytes for e in hosted) + sum(e.nbytes for e, to in out if to == "host")
        for e in hosted:
            if host_used <= self.host_budget:
                break
            if not e.pinned:
                out.append((e, "disk"))
                host_used -= e.nbytes
        return out

    def describe(self) -> str:
        return (f"mapped {self.used_bytes('mapped') / GB:.3f} GiB of "
                f"{'unlimited' if self.weights_budget is None else f'{self.weights_budget / GB:.3f}'}, "
                f"host {self.used_bytes('host') / GB:.3f} of {self.host_budget / GB:.3f} GiB")

    def status(self) -> dict:
        return {"weights_memory_bytes": self.weights_budget, "host_cache_bytes": self.host_budget,
                "max_mapped": self.max_mapped,
                "mapped_bytes": self.used_bytes("mapped"), "host_bytes": self.used_bytes("host"),
                "over_budget_loads": self.over_budget,
                "models": [{"name": e.name, "model": e.key[0], "dtype": e.key[1], "quantization": e.key[2],
                            "tier": e.tier, "bytes": e.nbytes, "pinned": e.pinned, "users": sorted(e.users),
                            "loads": e.loads, "load_s": e.load_s, "evictions": e.evictions, "hits": e.hits,
                            "prewarms": e.prewarms,
                            "error": e.error}
                           for e in self.entries.values()]}
