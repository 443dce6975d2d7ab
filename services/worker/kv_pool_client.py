"""A worker's calls on its node's kv-pool (services/kv_pool/): its subjects as methods, no policy.

Everything goes by block ids, of the arena of the model the worker serves (`arena`: its key, sent
with each of them; a node has one arena per KV shape, services/kv_pool/arenas.py): the bytes the
pool copies (to and from the host swap tier, from another node's arena) never reach the worker,
and no KV byte crosses NATS on one node. Which blocks to lease, give back, spill or restore is
decided in kv_blocks.py.
"""

from __future__ import annotations

import logging
import time
import uuid

from meshserve.shared import telemetry
from meshserve.shared.bus import Bus
from meshserve.shared.schemas import (ArenaDescriptor, ArenaRequest, BlockRefs, Handoff, KVEvent, KVImport,
                                      KVImportReply, KVShape, LeaseReply, LeaseRequest, ServiceHello, SwapReply,
                                      SwapRequest)

log = logging.getLogger("meshserve.worker.kv")

IMPORT_TIMEOUT = 120.0  # a backstop: the kv-pool answers (failed or not) within its own chunk timeouts
SWAP_TIMEOUT = 5.0
SWAP_BACKOFF = 5.0  # seconds without spilling after a failed swap request (no retry every step)


class KVPoolClient:
    def __init__(self, bus: Bus, node: str, worker_id: str):
        self.bus, self.node, self.worker_id = bus, node, worker_id
        self.swap_paused_until = 0.0
        # What this worker's leases count against (the model's memory quota): set by the worker
        # whenever it serves a model.
        self.model: str | None = None
        self.weights_bytes = 0
        self.arena: str | None = None  # the key of that model's arena (its KV shape): what its block ids are of

    def subject(self, verb: str) -> str:
        return self.bus.subjects.kv(verb, self.node)

    async def subscribe(self, verb: str, cb):
        """cb(msg) for each message the pool publishes on this verb (pressure, host_events); returns the
        subscription (unsubscribe() ends it)."""
        return await self.bus.nc.subscribe(self.subject(verb), cb=cb)

    async def watch_epoch(self, epoch: str, on_change) -> None:
        """on_change(new_epoch) when the pool's hello names another arena epoch than `epoch` (the
        one this worker mapped): the pool restarted and its ledger starts afresh."""
        async def on_hello(msg):
            try:
                seen = ServiceHello.decode(msg.data).service_id
            except Exception:  # noqa: BLE001
                return
            if epoch and seen != epoch:
                on_change(seen)

        await self.subscribe("hello", on_hello)

    async def arena_of(self, shape: KVShape | None = None, model: str | None = None) -> ArenaDescriptor:
        """The node's arena for KV of this shape (made by the pool if none of its shape asked before;
        RuntimeError saying why when it cannot be); None: the node's first arena."""
        return await self.bus.request(self.subject("arena"), ArenaRequest(worker_id=self.worker_id, model=model,
                                                                          shape=shape), ArenaDescriptor, timeout=900)

    async def lease(self, n: int) -> LeaseReply:
        """Up to n free blocks of the arena, now this worker's (fewer when the arena is short or its
        model at its quota; the reply says the quota)."""
        return await self.bus.request(self.subject("lease"), LeaseRequest(
            worker_id=self.worker_id, num_blocks=n, model=self.model, weights_bytes=self.weights_bytes,
            arena=self.arena),
            LeaseReply, timeout=10)

    async def release(self, block_ids: list[int]) -> None:
        await self.bus.publish(self.subject("release"), BlockRefs(worker_id=self.worker_id, block_ids=block_ids,
                                                                  arena=self.arena))

    async def retain(self, block_ids: list[int]) -> None:
        """One more reference on each block (this worker keeps them while another takes them over)."""
        await self.bus.publish(self.subject("retain"), BlockRefs(worker_id=self.worker_id, block_ids=block_ids,
                                                                 arena=self.arena))

    async def publish_events(self, stored: list[int] = (), removed: list[int] = (), cleared: bool = False) -> None:
        await self.bus.publish(self.subject("events"), KVEvent(worker_id=self.worker_id, stored=list(stored),
                                                               removed=list(removed), cleared=cleared,
                                                               node_id=self.node, arena=self.arena))

    async def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]] = ()) -> SwapReply | None:
        """Spills (block, key) pairs to the host tier, then fills (key, block) pairs from it. None when
        it failed: the cache then loses those blocks, as it would without a tier."""
        if time.monotonic() < self.swap_paused_until:
            return None
        req = SwapRequest(worker_id=self.worker_id, arena=self.arena, swap_out=swap_out, swap_in=list(swap_in))
        try:
            r = await self.bus.request(self.subject("swap"), req, SwapReply, timeout=SWAP_TIMEOUT)
            error = None if r.ok else f"refused: {r.error}"
        except Exception as e:  # noqa: BLE001
            error = repr(e)
        if error is not None:
            log.warning("swap request to the kv-pool failed (%s); no spilling for %.0fs", error, SWAP_BACKOFF)
            self.swap_paused_until = time.monotonic() + SWAP_BACKOFF
            return None
        return r

    async def import_blocks(self, h: Handoff) -> tuple[list[int] | None, str | None]:
        """Has the pool pull a sequence handed off on another node into fresh blocks leased to this
        worker: (those block ids, None), or (None, why not)."""
        rid = h.request.request_id
        imp = KVImport(transfer_id=f"{rid}.{uuid.uuid4().hex[:8]}", worker_id=self.worker_id, src_node=h.node_id,
                       src_worker=h.from_worker, block_ids=h.block_ids, num_tokens=h.num_computed_tokens,
                       model=self.model, arena=self.arena, src_arena=h.arena)
        try:
            with telemetry.span("kv.transfer", h.request.trace, worker=self.worker_id, request_id=rid,
                                src_node=h.node_id, blocks=len(h.block_ids)):
                r = await self.bus.request(self.subject("import"), imp, KVImportReply, timeout=IMPORT_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - no answer from our own pool: recompute
            return None, f"KV transfer {imp.transfer_id}: no answer from node {self.node}'s kv-pool ({e!r})"
        return (r.block_ids, None) if r.ok else (None, r.error)
