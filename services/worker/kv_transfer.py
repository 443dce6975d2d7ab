"""A worker's side of moving KV bytes it cannot simply share: from another node, and to and from
the node's host swap tier. The copies themselves are the kv-pool's (services/kv_pool/); a worker
only names blocks, so no KV byte crosses NATS on one node.

- Cross-node adoption: a sequence prefilled on another node arrives as a Handoff whose block ids
  are that node's. The worker asks its own kv-pool to import them (fresh blocks, leased to it,
  filled over NATS in chunks), then adopts the sequence on those. If the transfer fails, the
  worker says why and recomputes the sequence from its prompt and the tokens generated so far,
  as after a lost worker: the stream goes on, from the same token.
- Host swap tier (prefix-cache spill): before a step may overwrite cached blocks, the least
  recently used of them are copied to the tier and forgotten here; when a prompt arrives whose
  prefix is in the tier (known from the pool's KV events, tier "host"), it is copied back into free
  blocks of this worker and registered in its prefix cache, so the engine finds it as a hit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from itertools import islice

from meshserve.shared import telemetry
from meshserve.shared.engine.block_manager import BlockManager, prompt_block_hashes
from meshserve.shared.schemas import (BlockRefs, Handoff, KVEvent, KVImport, KVImportReply, SwapReply,
                                      SwapRequest)

log = logging.getLogger("meshserve.worker.kv")

IMPORT_TIMEOUT = 120.0  # a backstop: the kv-pool answers (failed or not) within its own chunk timeouts
SWAP_TIMEOUT = 5.0
SWAP_BACKOFF = 5.0  # seconds without spilling after a failed swap request (no retry every step)


class KVMover:
    def __init__(self, worker, swap_blocks: int):
        self.w = worker
        self.node = worker.args.node_id
        self.swap_enabled = swap_blocks > 0
        self.host: set[int] = set()  # keys in the node's host tier, as the pool's events tell
        self.pending: dict[str, asyncio.Task] = {}  # request id -> its transfer from another node
        self.cancelled: set[str] = set()
        self.num_imported = self.num_import_failures = self.num_spilled = self.num_restored = 0
        self.swap_paused_until = 0.0

    @property
    def bm(self) -> BlockManager:
        return self.w.engine.block_manager

    def subject(self, verb: str) -> str:
        return self.w.bus.subjects.kv(verb, self.node)

    async def start(self) -> None:
        if self.swap_enabled:
            await self.w.bus.nc.subscribe(self.subject("events"), cb=self._on_event)

    async def _on_event(self, msg) -> None:
        if b'"tier":"host"' not in msg.data:
            return
        ev = KVEvent.decode(msg.data)
        self.host.update(ev.stored)
        self.host.difference_update(ev.removed)

    # -- a sequence prefilled on another node

    def adopt_remote(self, h: Handoff) -> None:
        rid = h.request.request_id
        self.pending[rid] = asyncio.ensure_future(self._adopt_remote(h))

    def cancel(self, request_id: str) -> None:
        """An abort for a sequence still in transfer: dropped when the transfer ends."""
        if request_id in self.pending:
            self.cancelled.add(request_id)

    async def _adopt_remote(self, h: Handoff) -> None:
        w, rid = self.w, h.request.request_id
        imp = KVImport(transfer_id=f"{rid}.{uuid.uuid4().hex[:8]}", worker_id=w.id, src_node=h.node_id,
                       src_worker=h.from_worker, block_ids=h.block_ids, num_tokens=h.num_computed_tokens)
        try:
            with telemetry.span("kv.transfer", h.request.trace, worker=w.id, request_id=rid, src_node=h.node_id,
                                blocks=len(h.block_ids)):
                r = await w.bus.request(self.subject("import"), imp, KVImportReply, timeout=IMPORT_TIMEOUT)
            error = r.error if not r.ok else None
        except Exception as e:  # noqa: BLE001 - no answer from our own pool: recompute
            r, error = None, f"KV transfer {imp.transfer_id}: no answer from node {self.node}'s kv-pool ({e!r})"
        self.pending.pop(rid, None)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            if r is not None and r.ok:
                await w.bus.publish(self.subject("release"), BlockRefs(worker_id=w.id, block_ids=r.block_ids))
            await w._done(rid, "abort")
            return
        if error is None:
            self.num_imported += 1
            w.inbox.append(("adopt", h.model_copy(update=dict(block_ids=r.block_ids, shared_block_ids=[],
                                                              node_id=self.node))))
        else:
            self.num_import_failures += 1
            generated = h.token_ids[len(h.request.prompt_token_ids):]
            log.warning("%s; recomputing %s here from its prompt and %d generated tokens", error, rid, len(generated))
            w.chunk_seq[rid] = h.next_seq
            w.inbox.append(("request", h.request.model_copy(update={"output_token_ids": generated})))
        w.wake.set()

    # -- the host swap tier

    async def _swap(self, req: SwapRequest) -> SwapReply | None:
        """None when it failed: the cache then loses those blocks, as it would without a tier."""
        if time.monotonic() < self.swap_paused_until:
            return None
        try:
            r = await self.w.bus.request(self.subject("swap"), req, SwapReply, timeout=SWAP_TIMEOUT)
            error = None if r.ok else f"refused: {r.error}"
        except Exception as e:  # noqa: BLE001
            error = repr(e)
        if error is not None:
            log.warning("swap request to the kv-pool failed (%s); no spilling for %.0fs", error, SWAP_BACKOFF)
            self.swap_paused_until = time.monotonic() + SWAP_BACKOFF
            return None
        return r

    def _spilled(self, victims: list[tuple[int, int]]) -> None:
        """(block, key) pairs now in the host tier: this worker's cache forgets them."""
        for b, h in victims:
            self.bm.forget(b)
            self.host.add(h)
        self.num_spilled += len(victims)

    def blocks_next_step(self) -> int:
        """At most how many free blocks the next step takes: one per running sequence, plus the
        prompt tokens of the step's budget and a partial block per sequence that prefills."""
        e = self.w.engine
        sched, cfg = e.scheduler, e.config.scheduler
        prefilling = sum(1 for s in sched.running if s.num_tokens - s.num_computed_tokens > 1) + len(sched.waiting)
        if not prefilling:
            return len(sched.running)
        budget = cfg.max_num_batched_tokens // e.config.block_size
        return len(sched.running) + budget + min(prefilling, cfg.max_num_seqs)

    async def make_room(self, n: int) -> None:
        """Makes the next n blocks the engine takes uncached ones, spilling the least recently used
        cached blocks among them to the host tier first (instead of overwriting them)."""
        if not self.swap_enabled or n <= 0:
            return
        bm = self.bm
        if all(bm.hash_of[b] is None for b in islice(bm.free, n)):
            return
        k = n - self.bm.uncached_first()
        if k <= 0:
            return
        victims = [(b, bm.hash_of[b]) for b in islice(bm.free, n - k, n)]
        if await self._swap(SwapRequest(worker_id=self.w.id, swap_out=victims)) is not None:
            self._spilled(victims)

    async def prepare(self, tokens: list[int]) -> int:
        """Before a prompt is queued: marks its cached prefix as recently used, and brings back the
        blocks of that prefix the host tier has. Returns how many blocks came back."""
        bm = self.bm
        if not self.swap_enabled or not bm.enable_prefix_caching:
            return 0
        keys = prompt_block_hashes(tokens[:len(tokens) - 1], bm.block_size, bm.model)
        protect, wanted = set(), []
        for k in keys:  # the chain until its first key that is neither here nor in the tier
            b = bm.cached.get(k)
            if b is not None:
                protect.add(b)
                if b in bm.free:
                    bm.free.move_to_end(b)
            elif k in self.host:
                wanted.append(k)
            else:
                break
        if not wanted:
            return 0
        n_uncached = self.bm.uncached_first()
        free = list(bm.free)
        dest = free[:n_uncached][:len(wanted)]
        victims = [(b, bm.hash_of[b]) for b in free[n_uncached:] if b not in protect][:len(wanted) - len(dest)]
        dest += [b for b, _ in victims]
        wanted = wanted[:len(dest)]
        if not wanted:
            return 0
        r = await self._swap(SwapRequest(worker_id=self.w.id, swap_out=victims, swap_in=list(zip(wanted, dest))))
        if r is None:
            return 0
        self._spilled(victims)
        for k, b in zip(wanted[:r.restored], dest):
            bm.restore(b, k)  # back in this worker's arena and prefix cache
        self.host.difference_update(wanted[r.restored:])  # what the tier no longer had
        self.num_restored += r.restored
        return r.restored
