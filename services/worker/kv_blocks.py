"""A worker's KV blocks in the mesh: every decision about which blocks of the node's arena it holds.

The arena is the node's arena of its model's KV shape (services/kv_pool/arenas.py); every request
to the pool names it (the client's `arena`), and the pool's broadcasts of other arenas (their host
tier's events, their pressure) are not this worker's business: its blocks cannot help them.

The engine keeps the blocks it holds in its BlockPool (shared/engine/block_pool.py) and says how
many free ones its next step may take (Scheduler.blocks_next_step). This class keeps that pool
stocked from, and trimmed back to, the node's kv-pool (kv_pool_client.py), through the engine's
public API only:

- leasing: before each step, enough free blocks for it even if RESERVE_PROMPTS more prompts
  arrive first (Scheduler.blocks_next_step), `lease_blocks // 4` at a time at least; and while the
  arena has blocks no one uses, fresh ones rather than overwrite a cached prefix (the step takes
  uncached free blocks first: BlockPool.num_uncached_free);
- give-back: beyond two leases of surplus (and nothing waiting), the blocks that cache nothing,
  so the free blocks that hold prefixes stay this worker's prefix cache;
- pool pressure: when a lease the kv-pool could not fill makes it publish `pressure`, for
  PRESSURE_S seconds every worker of the node gives back cached free blocks too, least recently
  used first, so one worker's prefix cache never starves another's requests (when the model's
  memory quota was the limit, only that model's workers do);
- the model's memory quota (shared/partitions.py): the pool leases no block beyond it, so a
  model at its quota overwrites (or spills) its own cached blocks, then its requests wait or are
  preempted as when the arena is full; once this worker alone holds the quota it asks only every
  QUOTA_RECHECK_S (the quota may grow), and a request that could never fit in it is refused
  (`LLMEngine.block_limit`);
- the arena's size (services/kv_pool/arenas.py `resizes`): the engine's pool has room for ids up
  to the arena's capacity, the kv-pool leases ids below its size now. When a reload shrinks the
  arena in use (`resized`), the blocks this worker holds at or beyond the new size leave as they
  become free (cached ones spilled to the host tier first), before every step until none is left,
  and a request that needs more blocks than the arena has is refused (`LLMEngine.block_limit`);
- spill and restore (the host swap tier): cached blocks about to be overwritten or given back are
  copied to the tier first (`make_room`); a prompt whose prefix continues in the tier gets those
  blocks copied back into free blocks here and registered as cached (`prepare`), so the engine
  finds them as hits;
- handoff: a prefilled sequence leaves with its blocks (`detach`, the blocks kept cached retained
  once more at the pool), a handed-off one is adopted on them (`adopt`);
- cross-node import: a sequence prefilled on another node is pulled into fresh blocks here first
  (`import_remote`); when that fails it is recomputed from its tokens;
- preemption by swap (`PreemptionSwap`, the engine's swapper): a preempted sequence's blocks go to
  the host tier and come back into fresh blocks when it resumes.

Everything here runs on the worker's event loop between engine steps (the step runs in a thread).
What changes the worker's streams is reported through `report(kind, handoff)`, which the worker
applies between steps: "adopt" (imported: adopt it), "recompute" (the import failed), "aborted"
(an abort came during the import), "reclaim" (pool pressure: call `reclaim`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import nats.errors

from meshserve.shared.engine import wire
from meshserve.shared.engine.llm_engine import LLMEngine
from meshserve.shared.kv_layout import kv_bytes_per_block
from meshserve.shared.schemas import ArenaResized, Handoff, KVEvent, PoolPressure

from .kv_pool_client import KVPoolClient

log = logging.getLogger("meshserve.worker.kv")

PRESSURE_S = 5.0  # after the kv-pool ran short, this long the worker gives back cached blocks too
QUOTA_RECHECK_S = 1.0  # at its model's quota, a worker still asks this often (the quota may have grown)
# The free blocks kept cover a step in which this many prompts arrive first: a prompt that comes
# (or whose prefix comes back from the host tier) does not wait on a lease round trip.
RESERVE_PROMPTS = 2


class KVBlocks:
    def __init__(self, engine: LLMEngine, client: KVPoolClient, lease_blocks: int, swap_blocks: int,
                 report: Callable[[str, Handoff | None], None], arena_blocks: int | None = None):
        """arena_blocks: the arena's size when the worker asked for it (its descriptor's num_blocks)."""
        self.engine, self.pool, self.client = engine, engine.block_pool, client
        self.lease_blocks, self.swap_enabled, self.report = lease_blocks, swap_blocks > 0, report
        self.swap_blocks = swap_blocks
        self.pool_dry_until = 0.0  # monotonic time before which the kv-pool is known to have no free blocks
        self.host: set[int] = set()  # keys in the node's host tier, as the pool's events tell
        self.pending: dict[str, asyncio.Task] = {}  # request id -> its import from another node
        self.cancelled: set[str] = set()
        self.num_imported = self.num_import_failures = self.num_spilled = self.num_restored = 0
        self.quota_blocks: int | None = None  # the model's KV quota on this node, as the pool's leases say
        self.quota_asked = 0.0  # when it last asked the pool
        self.arena = client.arena  # the key of the arena its engine's block ids are of
        self.arena_blocks = arena_blocks  # the arena's size now: ids at or beyond it go back to the pool
        self.outside = False  # it may hold blocks at or beyond arena_blocks (the arena shrank)
        self._limit()
        self.subscriptions = []  # to the pool's broadcasts, ended at close (a model switch makes a new KVBlocks)

    async def start(self) -> None:
        if self.swap_enabled:
            self.subscriptions.append(await self.client.subscribe("host_events", self._on_host_event))
            e = self.engine
            block_bytes = kv_bytes_per_block(e.model.cfg, e.config.block_size, e.kv_cache.dtype)
            e.set_swapper(PreemptionSwap(self.client, asyncio.get_running_loop(), self.swap_blocks, block_bytes))
        await self.lease(self.lease_blocks)
        await self.client.publish_events(cleared=True)
        self.subscriptions.append(await self.client.subscribe("pressure", self._on_pressure))
        self.subscriptions.append(await self.client.subscribe("resized", self._on_resized))

    async def close(self) -> None:
        """Gives every block back (the worker stops, or switches model) and stops listening."""
        for sub in self.subscriptions:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:  # the connection is closing: nothing more comes anyway
                pass
        self.subscriptions = []
        held = self.pool.held_blocks()
        if held:
            await self.client.release(held)

    def _mine(self, arena: str | None) -> bool:
        """A broadcast about this engine's arena (None: the node's first; only an old pool sends it)."""
        return arena is None or self.arena is None or arena == self.arena

    async def _on_host_event(self, msg) -> None:
        ev = KVEvent.decode(msg.data)
        if not self._mine(ev.arena):
            return  # another arena's host tier: its keys could never be restored into these blocks
        self.host.update(ev.stored)
        self.host.difference_update(ev.removed)

    async def _on_pressure(self, msg) -> None:
        p = PoolPressure.decode(msg.data)
        if p.model is not None and p.model != self.client.model:
            return  # another model at its quota: not this worker's blocks to give
        if not self._mine(p.arena):
            return  # another arena ran short: blocks of this one would not help
        self.pool_dry_until = time.monotonic() + PRESSURE_S
        self.report("reclaim", None)

    async def _on_resized(self, msg) -> None:
        r = ArenaResized.decode(msg.data)
        if r.key == self.arena:
            self._sized(r.num_blocks)
            self.report("reclaim", None)  # blocks beyond the new size go back between steps

    def _sized(self, n: int | None) -> None:
        """The arena has n blocks now (a resize, or a lease reply that says so)."""
        if n is None or n == self.arena_blocks:
            return
        shrunk = self.arena_blocks is None or n < self.arena_blocks
        self.arena_blocks = n
        self.outside = self.outside or shrunk
        self._limit()

    def _limit(self) -> None:
        """The most blocks one request may need: the arena's size, and the model's quota."""
        caps = [(c, why) for c, why in ((self.quota_blocks, "the model's memory quota"),
                                        (self.arena_blocks, "the node's KV arena of its shape")) if c is not None]
        self.engine.block_limit, self.engine.block_limit_why = min(caps) if caps else (None, "")

    async def release_outside(self) -> None:
        """Gives back the blocks at or beyond the arena's size that are free here (after a shrink),
        spilling the cached ones to the host tier first; the ones still in use follow when freed."""
        if not self.outside or self.arena_blocks is None:
            return
        victims = self.pool.cached_from(self.arena_blocks)
        if victims and self.swap_enabled and await self.client.swap(victims) is not None:
            self._spilled(victims)
        self.outside = self.pool.release_from(self.arena_blocks) > 0
        n = await self.publish_changes()
        if n:
            log.info("%s gave back %d KV blocks beyond arena %s's new size (%d blocks)%s", self.client.worker_id, n,
                     self.arena, self.arena_blocks, "; more once freed" if self.outside else "")

    # -- leasing and giving back

    async def lease(self, n: int) -> int:
        if self.quota_blocks is not None:
            room = self.quota_blocks - self.pool.num_held
            if room > 0:
                n = min(n, room)
            elif time.monotonic() < self.quota_asked + QUOTA_RECHECK_S:
                return 0  # at the model's quota: the step takes this worker's own cached blocks
        self.quota_asked = time.monotonic()
        r = await self.client.lease(n)
        self.pool.add_free(r.block_ids)
        self.quota_blocks = r.quota_blocks
        self._limit()
        self._sized(r.arena_blocks)
        return len(r.block_ids)

    async def before_step(self) -> None:
        """Free blocks for the next step, uncached ones where the arena has them, and the cached ones
        the step would still overwrite spilled to the host tier."""
        await self.release_outside()
        pool, lease, sched = self.pool, self.lease_blocks, self.engine.scheduler
        want, need = sched.blocks_next_step(RESERVE_PROMPTS), sched.blocks_next_step()
        if pool.num_free < want:
            await self.lease(max(want - pool.num_free, lease // 4))
        elif pool.num_free > want + 2 * lease and not sched.num_waiting:
            await self.give_back(pool.num_free - want - lease, keep_uncached=need)
        uncached = pool.num_uncached_free()
        if uncached < min(need, pool.num_free) and time.monotonic() >= self.pool_dry_until:
            # The step would overwrite cached prefixes: while the node's arena has blocks no one
            # uses, lease those instead, and spill (or lose) prefixes only once it has none.
            asked = max(need - uncached, lease // 4)
            if await self.lease(asked) < asked:
                self.pool_dry_until = time.monotonic() + 1.0  # do not ask again every step
        await self.make_room(need)  # ... and those the step would still overwrite

    async def reclaim(self) -> None:
        """Another worker of the node is short of blocks (or the arena shrank): give back all beyond
        the reserve."""
        await self.release_outside()
        await self.give_back(self.pool.num_free - self.engine.scheduler.blocks_next_step(RESERVE_PROMPTS))

    async def give_back(self, n: int, keep_uncached: int = 0) -> None:
        """Returns up to n free blocks to the pool. While it has blocks to spare, only blocks that
        cache nothing, beyond the `keep_uncached` the next step takes: the free blocks that hold
        prefixes stay this worker's prefix cache (copying them to the host tier would cost time for
        nothing). Under pressure, those too, least recently used first, spilled to the host tier on
        the way."""
        if time.monotonic() >= self.pool_dry_until:
            n = min(n, self.pool.num_uncached_free() - keep_uncached)
        if n <= 0:
            return
        await self.make_room(n)
        self.pool.release_surplus(n)
        await self.publish_changes()

    async def after_step(self) -> None:
        """The step's KV events and the blocks that left, and blocks beyond a shrunk arena that its
        finished sequences freed (the worker may go idle now: no next step would give them back)."""
        await self.release_outside()
        await self.publish_changes()

    async def publish_changes(self) -> int:
        """The KV events of the last step (or give-back), and the blocks that left the engine's pool
        (how many it returns)."""
        stored, removed = self.pool.drain_events()
        if stored or removed:
            await self.client.publish_events(stored, removed)
        released = self.pool.drain_releases()
        if released:
            await self.client.release(released)
        return len(released)

    # -- the host swap tier

    async def make_room(self, n: int) -> None:
        """Makes the next n blocks the engine takes uncached ones, spilling the least recently used
        cached blocks among them to the host tier first (instead of overwriting them)."""
        if not self.swap_enabled or n <= 0:
            return
        victims = self.pool.cached_in_next(n)
        if victims and await self.client.swap(victims) is not None:
            self._spilled(victims)

    def _spilled(self, victims: list[tuple[int, int]]) -> None:
        """(block, key) pairs now in the host tier: this worker's cache forgets them."""
        for b, key in victims:
            self.pool.forget(b)
            self.host.add(key)
        self.num_spilled += len(victims)

    async def prepare(self, tokens: list[int], lora_key: str | None = None, cache_salt: str | None = None) -> int:
        """Before a prompt (of that LoRA adapter and cache salt) is queued: marks its cached prefix as recently used,
        and brings back the blocks of that prefix the host tier has. Returns how many blocks came back."""
        if not self.swap_enabled:
            return 0
        pool, protect, wanted = self.pool, set(), []
        for key in self.engine.kv_cache_manager.prefix_keys(tokens, lora_key, cache_salt):
            b = pool.lookup(key)  # the chain until its first key that is neither here nor in the tier
            if b is not None:
                protect.add(b)
                pool.refresh(b)
            elif key in self.host:
                wanted.append(key)
            else:
                break
        if not wanted:
            return 0
        dest, victims = pool.restore_targets(len(wanted), protect)
        dest += [b for b, _ in victims]
        wanted = wanted[:len(dest)]
        if not wanted:
            return 0
        r = await self.client.swap(victims, list(zip(wanted, dest)))
        if r is None:
            return 0
        self._spilled(victims)
        for key, b in zip(wanted[:r.restored], dest):
            pool.restore(b, key)  # back in this worker's arena and prefix cache
        self.host.difference_update(wanted[r.restored:])  # what the tier no longer had
        self.num_restored += r.restored
        return r.restored

    # -- handoff, on this node and from another

    async def detach(self, request_id: str):
        """Takes a prefilled sequence out of the engine with its blocks: (sequence, block ids, the
        ones this worker keeps cached). Those get one more reference at the pool first, so it never
        frees them under anyone."""
        seq, blocks, shared = self.engine.detach(request_id)
        if shared:
            await self.client.retain(shared)
        return seq, blocks, shared

    def adopt(self, h: Handoff, lora: str | None = None) -> None:
        """Continues a sequence handed off on this node's blocks (the pool moved a reference here);
        lora: the engine's name of its adapter, already loaded."""
        if h.arena and self.arena and h.arena != self.arena:  # the scheduler never sends one: ids of another arena
            raise ValueError(f"handoff of {h.request.request_id} names blocks of KV arena {h.arena}; this worker's "
                             f"engine is on {self.arena}")
        req = h.request
        seq = self.engine.new_sequence(req.request_id, req.prompt_token_ids, wire.sampling_params(req.sampling),
                                       time.monotonic(), h.token_ids[len(req.prompt_token_ids):], req.priority,
                                       lora, req.cache_salt)
        self.engine.adopt(seq, h.block_ids, h.shared_block_ids, h.num_computed_tokens, h.num_cached_tokens)

    def import_remote(self, h: Handoff) -> None:
        """A sequence prefilled on another node: its blocks are pulled here first, then reported."""
        self.pending[h.request.request_id] = asyncio.ensure_future(self._import(h))

    def cancel(self, request_id: str) -> None:
        """An abort for a sequence still in transfer: dropped when the transfer ends."""
        if request_id in self.pending:
            self.cancelled.add(request_id)

    async def _import(self, h: Handoff) -> None:
        rid = h.request.request_id
        block_ids, error = await self.client.import_blocks(h)
        self.pending.pop(rid, None)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            if block_ids:
                await self.client.release(block_ids)
            self.report("aborted", h)
        elif error is None:
            self.num_imported += 1
            self.report("adopt", h.model_copy(update=dict(block_ids=block_ids, shared_block_ids=[],
                                                          node_id=self.client.node)))
        else:
            self.num_import_failures += 1
            log.warning("%s; recomputing %s here from its prompt and %d generated tokens", error, rid,
                        len(h.token_ids) - len(h.request.prompt_token_ids))
            self.report("recompute", h)


class PreemptionSwap:
    """The engine's swapper in the mesh (shared/engine/swap.py's interface): a preempted sequence's
    blocks go to the node's host tier and come back, by block ids and keys only (the pool copies).

    The engine calls it from its step thread, between scheduling and the model run, so each call is
    a request made on the worker's event loop and waited for. The tier is an LRU shared with the
    prefix-cache spill: blocks it dropped meanwhile are recomputed (the engine resumes from those
    that came back). A failed or refused copy out makes that preemption a recompute."""

    TIMEOUT = 6.0

    def __init__(self, client: KVPoolClient, loop: asyncio.AbstractEventLoop, capacity_blocks: int,
                 block_bytes: int):
        self.client, self.loop = client, loop
        self.capacity, self.block_bytes = capacity_blocks, block_bytes

    def available(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= self.capacity // 2  # half: the tier also keeps spilled prefixes

    def _swap(self, swap_out, swap_in=()):
        try:
            return asyncio.run_coroutine_threadsafe(self.client.swap(swap_out, swap_in), self.loop).result(self.TIMEOUT)
        except Exception as e:  # noqa: BLE001 - the sequence recomputes instead
            log.warning("preemption swap failed (%r): recomputing instead", e)
            return None

    def swap_out(self, block_ids: list[int], keys: list[int]) -> bool:
        return self._swap(list(zip(block_ids, keys))) is not None

    def swap_in(self, block_ids: list[int], keys: list[int]) -> int:
        r = self._swap([], list(zip(keys, block_ids)))
        return r.restored if r is not None else 0

    def discard(self, keys: list[int]) -> None:
        """Nothing to do: the tier's LRU drops what nobody asks for again."""
