"""Node-level compute priority between the workers of one node, which share its cores.

Each engine orders its own steps by class, but a prefill worker computing an interactive prompt
shares the cores with a decode worker that keeps decoding a background batch on all its threads:
the interactive prompt takes about twice as long. So a worker whose engine has interactive
prompt work (an L1 sequence waiting or mid-prefill; an L1 stream that only decodes claims
nothing) announces a claim on `<ns>.compute.<node>.claim`, and a worker of that node about to
run a step whose best class is below the claim's waits:

- the claim is announced when it starts and when it ends (at once, not on the heartbeat), and
  repeated every REFRESH_S while it lasts: a lease, so the claim of a worker that died expires
  by itself after LEASE_S;
- a wait is woken by the claim's end, a new or expired claim, or the waiting worker's own
  inbox; never a fixed sleep;
- a worker waits at most `max_yield_s` in a row, then runs at least one step before it may wait
  again: normal and background work keep progressing under a steady interactive stream;
- steps that include interactive sequences never wait; with `--scheduling fcfs` or
  `--no-compute-yield` nothing waits (and nothing is claimed);
- only workers whose cores overlap yield to each other (a model pinned to its own cores by the
  manifest's `cpus` has nothing to gain).

ClaimTable is the decision, pure (times passed in); ComputeClaims its NATS side.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

from meshserve.shared.limits import PRIORITIES, priority_level
from meshserve.shared.schemas import ComputeClaim

log = logging.getLogger("meshserve.worker")

REFRESH_S = 0.25  # a live claim is repeated this often
LEASE_S = 1.0  # ... and has ended when not heard again for this long
MAX_YIELD_S = 1.0  # the longest a worker waits in a row (--max-yield-s)


def add_compute_yield_argument(p) -> None:
    """--compute-yield / --no-compute-yield (workers, `meshserve up`)."""
    p.add_argument("--compute-yield", action=argparse.BooleanOptionalAction, default=True,
                   help="a step whose best class is below an interactive prompt another worker of the node computes "
                        "waits for it, at most --max-yield-s in a row (docs/scheduling.md; default: on)")


@dataclass(frozen=True)
class Claim:
    level: int  # the claimant's class (0: interactive)
    expires: float  # on this worker's clock
    cores: frozenset[int]  # empty: the whole node


class ClaimTable:
    """The live claims of the other workers of a node, and this worker's run of waits. Off when
    not `enabled` (--no-compute-yield) or under `fcfs` scheduling: nothing waits."""

    def __init__(self, max_yield_s: float = MAX_YIELD_S, enabled: bool = True, scheduling: str = "priority"):
        self.max_yield_s, self.enabled = max_yield_s, enabled and scheduling != "fcfs"
        self.claims: dict[str, Claim] = {}
        self.yield_started: float | None = None  # when the current run of waits began
        self.owes_step = False  # it waited max_yield_s: the next step runs whatever the claims

    def claim(self, worker_id: str, level: int, expires: float, cores=()) -> None:
        """A claim started or was refreshed."""
        self.claims[worker_id] = Claim(level, expires, frozenset(cores))

    def release(self, worker_id: str) -> None:
        self.claims.pop(worker_id, None)

    def wait_until(self, step_level: int | None, cores, now: float) -> float | None:
        """None: run the step (of best class `step_level`, on `cores`) now. Else: wait until at most
        this time, and ask again then (or when a claim changes)."""
        if not self.enabled or step_level is None or self.owes_step:
            return None
        self.claims = {w: c for w, c in self.claims.items() if c.expires > now}
        mine = frozenset(cores)
        over = [c for c in self.claims.values()
                if c.level < step_level and (not c.cores or not mine or c.cores & mine)]
        if not over:
            return None
        if self.yield_started is None:
            self.yield_started = now
        bound = self.yield_started + self.max_yield_s
        if now >= bound:
            self.owes_step = True
            return None
        return min(bound, min(c.expires for c in over))

    def claimed(self, level: int, cores, now: float) -> bool:
        """Whether another worker whose cores overlap these holds a live claim of class `level`."""
        mine = frozenset(cores)
        return any(c.level == level and c.expires > now and (not c.cores or not mine or c.cores & mine)
                   for c in self.claims.values())

    def stepped(self) -> None:
        """A step ran: the next wait starts a new run."""
        self.yield_started, self.owes_step = None, False


class ComputeClaims:
    """This worker's claim (announced, refreshed, ended) and its waits for the others' claims."""

    def __init__(self, bus, worker_id: str, node_id: str, cores=(), enabled: bool = True,
                 scheduling: str = "priority", max_yield_s: float = MAX_YIELD_S, clock=time.monotonic):
        self.bus, self.id, self.clock = bus, worker_id, clock
        self.subject = bus.subjects.compute("claim", node_id)
        self.cores = list(cores)
        self.table = ClaimTable(max_yield_s, enabled, scheduling)
        self.enabled = self.table.enabled  # off: it neither claims nor waits
        self.changed = asyncio.Event()  # a claim started or ended
        self.level: int | None = None  # this worker's claim (None: none)
        self.refresher: asyncio.Task | None = None
        self.yields = 0  # runs of waits
        self.yield_s = 0.0  # seconds waited in all
        self.counted = False  # the current run is counted

    async def start(self) -> None:
        if self.enabled:
            await self.bus.nc.subscribe(self.subject, cb=self._on_claim)

    async def close(self) -> None:
        await self.hold(None)

    @property
    def claiming(self) -> bool:
        return self.level is not None

    # -- this worker's claim

    async def hold(self, level: int | None) -> None:
        """Claim the node's cores for work of class `level` (None: no claim), announcing a change at once."""
        if not self.enabled or level == self.level:
            return
        self.level = level
        if self.refresher is not None:
            self.refresher.cancel()
            self.refresher = None
        await self._announce(level)
        if level is not None:
            self.refresher = asyncio.ensure_future(self._refresh(level))

    async def _refresh(self, level: int) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self._announce(level)

    async def _announce(self, level: int | None) -> None:
        msg = ComputeClaim(worker_id=self.id, priority=PRIORITIES[level if level is not None else 0],
                           active=level is not None, lease_s=LEASE_S, cores=self.cores)
        try:
            await self.bus.publish(self.subject, msg)
        except Exception as e:  # noqa: BLE001 - a bus reconnecting: the lease ends it or the next refresh says it
            log.warning("worker %s: compute claim not sent (%s)", self.id, e or type(e).__name__)

    async def _on_claim(self, msg) -> None:
        c = ComputeClaim.decode(msg.data)
        if c.worker_id == self.id:
            return
        before = self.table.claims.get(c.worker_id)
        if c.active:
            self.table.claim(c.worker_id, priority_level(c.priority), self.clock() + c.lease_s, c.cores)
        else:
            self.table.release(c.worker_id)
        if before is None or not c.active or before.level != priority_level(c.priority):
            self.changed.set()  # a waiter asks again (a refresh only extends the lease it waits on)

    # -- the others' claims

    def wait_until(self, step_level: int | None) -> float | None:
        """None: the step (of best class `step_level`) runs now; else it waits until at most then."""
        return self.table.wait_until(step_level, self.cores, self.clock())

    def claimed(self, level: int) -> bool:
        """Another worker of the node (on these cores) claims them for work of class `level` now."""
        return self.table.enabled and self.table.claimed(level, self.cores, self.clock())

    async def wait(self, step_level: int | None, wake: asyncio.Event) -> None:
        """Waits while a claim outranks the step: until the claims change (an end, a new claim), the
        earliest claim expires, the bound is reached, or `wake` (the worker's inbox) is set."""
        self.changed.clear()
        until = self.wait_until(step_level)
        if until is None:
            return
        if not self.counted:
            self.counted, self.yields = True, self.yields + 1
        t0 = self.clock()
        waits = [asyncio.ensure_future(e.wait()) for e in (self.changed, wake)]
        try:
            await asyncio.wait(waits, timeout=max(0.0, until - t0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self.yield_s += self.clock() - t0

    def stepped(self) -> None:
        self.table.stepped()
        self.counted = False
