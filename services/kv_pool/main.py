"""`meshserve serve kv-pool`: owns the node's KV arenas, one per KV shape of the models it serves
(arenas.py: a shared-memory file every worker of that shape maps, or with `--device cuda` one GPU
allocation every such worker opens by its CUDA IPC handle), and who holds which block of each.
The first arena (the shape of the model the node starts with) is made at start, each other one
when a worker of its shape first asks for it, sized by the plan made from the manifest.

Workers lease free blocks in batches (no NATS round trip per block on the hot path) and release
them in batches. A block may be held by several workers at once (a prefill worker keeps a prefix
it handed to a decode worker); it is free again when its last reference is released. A worker
that stops sending heartbeats loses all its references. Workers' KV events (prefix-cache keys
stored and removed) are kept as the node's prefix index, per worker. With `--models` (the
manifest), the workers of a model hold at most its `memory_quota_gb` less its weights, in blocks
of its arena (`KVQuotas`, shared/partitions.py); the blocks each model holds are in the status.
Every message with block ids names their arena (its key; none: the node's first arena).

Two copies of KV bytes happen here, never in a worker's hot path and never over NATS on one node:
- the host swap tier (swap.py): workers spill cached prefix blocks they are about to overwrite
  and bring them back when a prompt starts with that prefix again (`swap`, block ids only);
- cross-node transfers (transfer.py): a decode worker adopting a sequence prefilled on another
  node asks its kv-pool to `import` the blocks; this pool pulls them from the source node's pool
  in chunks and leases them to the worker.
Its subjects name the node (`<ns>.kv.<node>.<verb>`), so every node's kv-pool answers for its own.

It does no tensor math: on the CPU backend an arena is a numpy byte array over the shared file
and torch is never imported; with `--device cuda` torch is imported (lazily) for the GPU buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections import Counter, deque

import orjson

from meshserve.shared import node_memory, shm
from meshserve.shared.bus import Bus
from meshserve.shared.kv_layout import (arena_key, check_kv_cache_dtype, kv_arena_dtype, kv_arena_shape,
                                        kv_bytes_per_block)
from meshserve.shared.manifest import ManifestFile
from meshserve.shared.model.config import ModelConfig
from meshserve.shared.partitions import kv_quota_blocks
from meshserve.shared.schemas import (ArenaDescriptor, ArenaRequest, ArenaResized, ArenaRetired, BlockRefs,
                                      BlockTransfer, Heartbeat, KVEvent, KVImport, KVImportReply, KVShape, LeaseReply,
                                      LeaseRequest, LoadRequest, PoolPressure, ServiceHello, SwapReply, SwapRequest,
                                      TransferReply, WeightsDescriptor)
from meshserve.shared.service import run_service

from . import transfer
from .arenas import ArenaBudgets, manifest_shapes, plan_budgets
from .blocks import ArenaBlocks
from .swap import HostTier

log = logging.getLogger("meshserve.kv_pool")

HELLO_INTERVAL = 1.0
# A new arena whose part is still held by arenas shrinking in place waits this long for their blocks
# to be freed (their workers give back the free ones between steps) before it is made smaller.
DRAIN_WAIT_S = 10.0


class BlockLedger:
    """References per block and per worker, and the blocks each model holds (a block counts for the
    model whose worker leased it until it is free again: a handoff moves it only between workers
    of that model). Pure bookkeeping: the service around it does I/O.

    Block ids go up to the arena's `capacity`; only those below `limit` are leased (the arena's
    size now, which `resize` changes while blocks are held: arenas.py). A block at or beyond the
    limit that is still held (`outside`) is not leased again once free: it waits in `to_punch` for
    the pool to give its memory back."""

    def __init__(self, num_blocks: int, capacity: int | None = None):
        self.capacity = max(num_blocks, capacity or 0)
        self.limit = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * self.capacity
        self.held: dict[str, Counter] = {}
        self.model_of: list[str | None] = [None] * self.capacity
        self.by_model: Counter = Counter()  # model -> blocks in use
        self.peak: Counter = Counter()  # model -> the most it held at once
        self.outside: set[int] = set()  # held blocks at or beyond the limit
        self.to_punch: list[int] = []  # blocks beyond the limit freed since the pool last gave their memory back

    @property
    def num_blocks(self) -> int:
        return self.limit

    def resize(self, n: int) -> list[int]:
        """The arena now has n blocks (at most its capacity): growing frees the new ids nobody holds;
        shrinking stops leasing ids at or beyond n. Returns the free blocks beyond n (their memory
        can go back now); those still held follow into `to_punch` as they are freed."""
        n = max(1, min(n, self.capacity))
        old, self.limit = self.limit, n
        if n >= old:
            self.free.extend(b for b in range(old, n) if not self.refs[b])
            self.outside = {b for b in self.outside if b >= n}
            self.to_punch = [b for b in self.to_punch if b >= n]  # leasable again: never punched under a holder
            return []
        gone = [b for b in self.free if b >= n]
        self.free = deque(b for b in self.free if b < n)
        self.outside |= {b for b in range(n, old) if self.refs[b]}
        return gone

    def lease(self, worker: str, n: int, model: str | None = None, limit: int | None = None) -> list[int]:
        """Up to n free blocks, and no more than leave the model within `limit` blocks."""
        if limit is not None:
            n = min(n, max(0, limit - self.by_model[model]))
        out = [self.free.popleft() for _ in range(min(n, len(self.free)))]
        held = self.held.setdefault(worker, Counter())
        for b in out:
            self.refs[b] = 1
            held[b] += 1
            self.model_of[b] = model
        if out:
            self.by_model[model] += len(out)
            self.peak[model] = max(self.peak[model], self.by_model[model])
        return out

    def _unref(self, b: int, n: int = 1) -> None:
        self.refs[b] -= n
        if self.refs[b] == 0:
            if b < self.limit:
                self.free.append(b)
            else:
                self.outside.discard(b)
                self.to_punch.append(b)
            self.by_model[self.model_of[b]] -= 1
            self.model_of[b] = None

    def retain(self, worker: str, blocks: list[int]) -> None:
        held = self.held.setdefault(worker, Counter())
        for b in blocks:
            self.refs[b] += 1
            held[b] += 1

    def release(self, worker: str, blocks: list[int]) -> None:
        held = self.held.get(worker, Counter())
        for b in blocks:
            if held[b] <= 0:
                log.warning("%s released block %d it does not hold", worker, b)
                continue
            held[b] -= 1
            if not held[b]:
                del held[b]
            self._unref(b)

    def transfer(self, src: str, dst: str, blocks: list[int]) -> bool:
        """Moves one reference per block between holders; the block's count does not change."""
        held = self.held.get(src, Counter())
        if any(held[b] < n for b, n in Counter(blocks).items()):
            return False
        dst_held = self.held.setdefault(dst, Counter())
        for b in blocks:
            held[b] -= 1
            if not held[b]:
                del held[b]
            dst_held[b] += 1
        return True

    def holds(self, worker: str, blocks) -> bool:
        held = self.held.get(worker, Counter())
        return all(held[b] >= n for b, n in Counter(blocks).items())

    def drop_worker(self, worker: str) -> int:
        held = self.held.pop(worker, Counter())
        for b, n in held.items():
            self._unref(b, n)
        return sum(held.values())


class KVQuotas:
    """Each model's KV blocks on this node: its manifest `memory_quota_gb` less its weights (which
    its workers report with their leases), in blocks of its arena. The manifest is re-read when its
    file changes."""

    def __init__(self, manifest_path: str | None, block_bytes: int = 0):
        self.file = ManifestFile(manifest_path) if manifest_path else None
        self.block_bytes = block_bytes  # the default: the node's first arena's
        self.weights: dict[str, int] = {}  # model -> its weights' bytes, as its workers report them

    def saw(self, model: str | None, weights_bytes: int) -> None:
        if model is not None and weights_bytes:
            self.weights[model] = weights_bytes

    def limit(self, model: str | None, block_bytes: int | None = None) -> int | None:
        """block_bytes: of the model's arena (its KV shape's blocks)."""
        manifest = self.file.current() if self.file is not None else None
        spec = manifest.get(model) if manifest is not None and model else None
        if spec is None:
            return None
        return kv_quota_blocks(spec.memory_quota_gb, self.weights.get(model, 0), block_bytes or self.block_bytes)


class Arena:
    """One KV arena of the node (arenas.py): its descriptor, its memory, its blocks as bytes (what the
    swap tier and transfers copy), the ledger of who holds which of its blocks, and its host tier."""

    def __init__(self, desc: ArenaDescriptor, buf=None):
        """buf: the arena's memory as create_arena made it (else opened from the descriptor)."""
        host = desc.backend == "cpu"
        if buf is None:
            buf = node_memory.open_buffer(desc.backend, desc.path, desc.ipc, numpy=host)
        self.desc, self.key, self.buf = desc, desc.key, buf
        if host:  # bytes only: numpy over the shared file
            self.blocks = ArenaBlocks.of_bytes(buf, desc.dtype, desc.shape, desc.block_size)
        else:  # a GPU arena's blocks are staged through host memory
            self.blocks = ArenaBlocks(shm.view(buf, 0, desc.dtype, desc.shape), desc.block_size)
        self.ledger = BlockLedger(desc.num_blocks, desc.capacity_blocks)
        self.host = HostTier(desc.swap_blocks, self.blocks.block_bytes)
        self.models: set[str] = set()  # the models whose workers asked for it
        self.punch_failed = False

    @property
    def resizable(self) -> bool:
        """A shared file (made with room to grow); a GPU allocation cannot change size in place."""
        return self.desc.backend == "cpu"

    @property
    def nbytes(self) -> int:
        """The memory the arena may take: its blocks, and those beyond a shrink still held."""
        return self.nbytes_but(None)

    def nbytes_but(self, worker: str | None) -> int:
        """nbytes, less the blocks beyond a shrink that only `worker` holds: a worker switching away
        from this arena gives them back once its new arena is made."""
        led = self.ledger
        mine = led.held.get(worker) if worker is not None else None
        outside = sum(1 for b in led.outside if mine[b] < led.refs[b]) if mine else len(led.outside)
        return (led.limit + outside) * self.blocks.block_bytes

    def resize(self, n: int) -> None:
        """n blocks from now on (arenas.py `resizes`); the memory of the blocks beyond n goes back
        as soon as nobody holds them."""
        self.give_back(self.ledger.resize(n))

    def give_back(self, blocks: list[int] | None = None) -> None:
        """The memory of free blocks beyond the limit (`blocks`, else those freed since the last
        call) leaves the shared file: the node gets it back."""
        if blocks is None:
            blocks, self.ledger.to_punch = self.ledger.to_punch, []
        if blocks and not self.punch_failed and not shm.punch(self.desc.path, self.blocks.byte_ranges(blocks)):
            self.punch_failed = True
            log.warning("KV arena %s: this file system cannot give back the memory of blocks beyond a shrink "
                        "(fallocate PUNCH_HOLE); they keep their memory until the arena is retired", self.key)

    def status(self) -> dict:
        return {"dtype": self.desc.dtype, "shape": self.desc.shape, "num_blocks": self.ledger.limit,
                "capacity_blocks": self.ledger.capacity, "outside_blocks": len(self.ledger.outside),
                "free_blocks": len(self.ledger.free), "block_bytes": self.blocks.block_bytes,
                "bytes": self.nbytes, "models": sorted(self.models),
                "resident_bytes": shm.resident_bytes(self.desc.path) if self.desc.backend == "cpu" else None,
                "holders": {w: n for w, c in self.ledger.held.items() if (n := sum(c.values()))},
                "swap": self.host.stats()}


class UnknownArena(LookupError):
    """A message names an arena this kv-pool does not have (made by a pool that restarted?)."""


class KVPool:
    def __init__(self, bus: Bus, args, desc: ArenaDescriptor, buf=None, budgets: ArenaBudgets | None = None):
        """desc, buf: the node's first arena (made at start: create_arena); budgets: how big later
        ones may be (arenas.py; default: nothing beyond the first)."""
        self.bus, self.args, self.desc = bus, args, desc
        self.node = desc.node_id
        first = Arena(desc, buf)
        self.first = first.key
        self.arenas: dict[str, Arena] = {first.key: first}
        self.budgets = budgets or ArenaBudgets(total=desc.num_blocks * first.blocks.block_bytes)
        self.budgets.made.setdefault(first.key, first.nbytes)
        self.budgets.block[first.key] = first.blocks.block_bytes
        self.last_seen: dict[str, float] = {}
        self.prefix_index: dict[str, set[int]] = {}
        self.transfers = transfer.TransferStats()
        self.fetch = transfer.FetchServer(bus, self._fetch_arena, self.transfers, ttl=args.transfer_ttl)
        self.tasks: set[asyncio.Task] = set()
        self.quotas = KVQuotas(getattr(args, "models", None), first.blocks.block_bytes)
        self.model_of: dict[str, str] = {}  # worker -> the model of its last lease
        self.arena_of: dict[str, str] = {}  # worker -> the arena its heartbeat names (the one it serves from)
        self.asked: dict[str, tuple[str, float]] = {}  # worker -> (arena it asked for, when) until it serves from it
        self.planned_from = None  # the manifest the budgets were last planned from
        self.retired: list[dict] = []  # the last arenas retired, for status
        self.resized: list[dict] = []  # the last arenas resized in place, for status
        # GPU arenas retired, freed once no worker of the node has them open (CUDA leaves freeing an
        # allocation another process still maps undefined)
        self.freeing = node_memory.RetiredBuffers(getattr(args, "worker_timeout", 3.0))

    def kv(self, verb: str) -> str:
        return self.bus.subjects.kv(verb, self.node)

    # -- the arenas

    def arena(self, key: str | None) -> Arena:
        """The arena a message names (None: the node's first)."""
        a = self.arenas.get(key or self.first)
        if a is None:
            raise UnknownArena(f"node {self.node}'s kv-pool has no KV arena {key!r} (it has "
                               f"{', '.join(self.arenas)})")
        return a

    def _fetch_arena(self, key: str | None):
        a = self.arena(key)
        return a.blocks, a.ledger.held, a.ledger.release

    def arena_for(self, req: ArenaRequest) -> Arena:
        """The arena of the asker's KV shape, made now if it is the first to ask (its size from the
        budgets, after retiring what the plan wants the memory of); ValueError saying why when the
        node's KV memory has no room for it."""
        if req.shape is not None and req.shape.key not in self.arenas:
            self.plan_again(req.worker_id)
        if req.shape is None:
            a = self.arena(None)
        elif req.shape.key in self.arenas:
            a = self.arenas[req.shape.key]
        else:
            key, nbytes = req.shape.key, self.budgets.for_arena(req.shape.key)
            flag = getattr(self.args, "kv_cache_dtype", "auto")
            if (req.shape.dtype == "int8") != (flag == "int8") and key not in self.budgets.planned:
                raise ValueError(f"a KV arena of {req.shape.dtype} asked for by {req.model}, but this kv-pool runs "
                                 f"--kv-cache-dtype {flag} and its manifest gives no model that KV cache: start the "
                                 "node's kv-pool and workers with the same --kv-cache-dtype (and manifest)")
            desc, buf = create_arena(self.bus.subjects.ns, self.node, req.shape, req.shape.dtype,
                                     self.args.block_size, nbytes, self.budgets.swap_for(nbytes),
                                     getattr(self.args, "device", "cpu"), self.desc.epoch,
                                     why=f"for model {req.model}", nats_url=getattr(self.bus, "url", ""),
                                     capacity_bytes=self.budgets.total)
            a = self.arenas[key] = Arena(desc, buf)
            self.budgets.made[key] = a.nbytes
            self.budgets.block[key] = a.blocks.block_bytes
        if req.model:
            a.models.add(req.model)
        if req.worker_id:
            self.asked[req.worker_id] = a.key, time.monotonic()
        return a

    async def wait_for_room(self, req: ArenaRequest) -> None:
        """Before a new shape's arena is made: plans again, and while arenas shrinking in place still
        hold its part (blocks in use beyond their new size), waits up to DRAIN_WAIT_S for them to be
        freed rather than make it smaller (it would grow later) or refuse it."""
        key = req.shape.key if req.shape is not None else None
        if key is None or key in self.arenas:
            return
        self.plan_again(req.worker_id)
        deadline = time.monotonic() + DRAIN_WAIT_S
        while (key not in self.arenas and key in self.budgets.planned and time.monotonic() < deadline
               and any(a.nbytes_but(req.worker_id) > a.ledger.limit * a.blocks.block_bytes
                       for a in self.arenas.values())
               and self.budgets.for_arena(key) < self.budgets.planned[key]):
            await asyncio.sleep(0.05)
            self.resize_in_place(but=req.worker_id)

    def plan_again(self, asker: str | None = None) -> None:
        """The plan from the manifest as it is now, and the arenas retired and resized after it
        (before an arena is made; the reaper does the same every half second). asker: the worker
        asking for a new arena (`resize_in_place`'s `but`)."""
        self.replan()
        self.retire_unused()
        self.resize_in_place(but=asker)

    def replan(self) -> None:
        """Plans the KV memory again when the manifest changed (a reload): the parts of arenas not
        made yet follow the new manifest at once, the arenas made keep theirs until retired."""
        manifest = self.quotas.file.current() if self.quotas.file is not None else None
        if manifest is None or manifest is self.planned_from:
            return
        self.planned_from = manifest
        shapes = manifest_shapes(manifest, self.args.dtype, getattr(self.args, "kv_cache_dtype", "auto"))
        p = plan_budgets(self.budgets.total, self.budgets.swap, [(m, s.key if s else None, q) for m, s, q in shapes])
        if p.planned != self.budgets.planned or p.complete != self.budgets.complete:
            log.info("KV memory planned again (the manifest changed): %s", p.planned)
        self.budgets.replan(p.planned, p.complete)

    def in_use(self, now: float) -> set[str]:
        """Arenas someone uses: blocks held, a live worker serving from it (its heartbeat), or asked
        for within --arena-retire-after seconds by a worker not yet serving from it (mapping it)."""
        limit = getattr(self.args, "arena_retire_after", 30.0)
        return ({k for k, a in self.arenas.items() if any(a.ledger.held.values())} | set(self.arena_of.values())
                | {k for k, t in self.asked.values() if now - t < limit})

    def retire_unused(self) -> None:
        """Retires the arenas the plan wants the memory of (`ArenaBudgets.retirable`) that nobody
        uses: the file loses its name, the memory goes back to the node's KV budget, and the workers
        that still map it are told to let go (`retired`)."""
        for key in self.budgets.retirable(self.in_use(time.monotonic()), self.resizable()):
            a = self.arenas.pop(key)
            nbytes = a.nbytes
            reason = ("no model of the manifest has its KV shape" if key not in self.budgets.planned
                      else f"made with {nbytes} bytes, planned {self.budgets.planned[key]}")
            self.budgets.retire(key)
            node_memory.release(a.desc.backend, a.desc.path)
            if a.desc.backend == "cuda":
                self.freeing.retire(a.desc.ipc["handle"], a.buf, nbytes, f"KV arena {key} ({a.desc.arena_id})")
            log.info("KV arena %s retired (%s): %d bytes back to the node's KV memory", key, reason, nbytes)
            self.retired = (self.retired + [{"key": key, "bytes": nbytes, "models": sorted(a.models),
                                             "reason": reason, "at": time.time()}])[-8:]
            self._spawn(self.bus.publish(self.kv("retired"), ArenaRetired(node_id=self.node, key=key,
                                                                          arena_id=a.desc.arena_id, reason=reason)))

    def resizable(self) -> set[str]:
        if not getattr(self.args, "arena_resize", True):
            return set()
        return {k for k, a in self.arenas.items() if a.resizable}

    def resize_in_place(self, but: str | None = None) -> None:
        """Moves the arenas that can change size in place (shared files) toward their parts of the
        plan, in use or not (`ArenaBudgets.resizes`): one shrunk leases only the ids below its new
        size, and the memory of those beyond goes back as their holders free them (its workers are
        told: `resized`); one grown leases the new ids at once. but: a worker asking for a new
        arena, whose blocks beyond a shrink do not count (it is switching away from them)."""
        for k, a in self.arenas.items():
            a.give_back()
            self.budgets.made[k] = a.nbytes_but(but)
        for key, nbytes in self.budgets.resizes(self.resizable()).items():
            a = self.arenas[key]
            old, n = a.ledger.limit, nbytes // a.blocks.block_bytes
            a.resize(n)
            if a.ledger.limit == old:
                continue
            self.budgets.made[key] = a.nbytes_but(but)
            log.info("KV arena %s resized in place: %d -> %d blocks (%d held beyond the new size)", key, old,
                     a.ledger.limit, len(a.ledger.outside))
            self.resized = (self.resized + [{"key": key, "from_blocks": old, "to_blocks": a.ledger.limit,
                                             "at": time.time()}])[-8:]
            self._spawn(self.bus.publish(self.kv("resized"), ArenaResized(
                node_id=self.node, key=key, arena_id=a.desc.arena_id, num_blocks=a.ledger.limit)))

    def _spawn(self, coro) -> None:
        """Runs coro as its own task, kept until it ends."""
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    # -- the host swap tier

    async def swap(self, req: SwapRequest) -> SwapReply:
        """Copies spilled blocks into the arena's host tier, then found ones back into the worker's blocks."""
        a = self.arena(req.arena)
        if not a.host.enabled:
            return SwapReply(ok=False, error="this kv-pool has no swap tier (--swap-space 0)")
        blocks = {b for b, _ in req.swap_out} | {b for _, b in req.swap_in}  # a block may be spilled and refilled
        if not a.ledger.holds(req.worker_id, blocks):
            return SwapReply(ok=False, error=f"{req.worker_id} does not hold all of blocks {sorted(blocks)[:8]}... "
                             f"of arena {a.key}")
        reply = a.host.apply(a.blocks, req)
        await self._publish_host_events(a)
        return reply

    async def _publish_host_events(self, a: Arena) -> None:
        stored, removed = a.host.drain_events()
        if stored or removed:
            await self.bus.publish(self.kv("host_events"), KVEvent(
                worker_id=f"kv-pool-{self.node}", node_id=self.node, stored=stored, removed=removed, tier="host",
                arena=a.key))

    # -- cross-node transfers, destination side

    async def import_blocks(self, req: KVImport) -> KVImportReply:
        """Leases fresh blocks of the worker's arena to it and fills them with the source node's blocks."""
        t0 = time.monotonic()
        try:
            a = self.arena(req.arena)
        except UnknownArena as e:  # nothing pulled: the source still waits for its references to go
            await self.bus.publish(self.bus.subjects.kv("release", req.src_node),
                                   BlockRefs(worker_id=req.src_worker, block_ids=req.block_ids, arena=req.src_arena))
            return KVImportReply(ok=False, error=f"KV transfer {req.transfer_id}: {e}", seconds=0.0)
        n = min(len(req.block_ids), -(-req.num_tokens // a.desc.block_size))  # blocks with KV in them
        self.last_seen.setdefault(req.worker_id, time.monotonic())  # reaped like any holder if it is gone
        model = req.model or self.model_of.get(req.worker_id)
        limit = self.quotas.limit(model, a.blocks.block_bytes)
        dst = a.ledger.lease(req.worker_id, n, model, limit)
        try:
            if len(dst) < n:
                room = (f"model {model}'s memory quota leaves it {len(dst)} more blocks" if limit is not None
                        and a.ledger.free else f"node {self.node}'s arena {a.key} has {len(dst)} free blocks")
                raise transfer.TransferError(f"KV transfer {req.transfer_id}: {room}, {n} needed")
            nbytes, chunks = await transfer.pull(
                self.bus, req.src_node, req.transfer_id, req.src_worker, req.block_ids[:n], dst, a.blocks,
                max_chunk_bytes=self.args.transfer_chunk_bytes, timeout=self.args.transfer_timeout,
                stats=self.transfers, also_release=req.block_ids[n:], src_arena=req.src_arena)
        except Exception as e:  # noqa: BLE001 - TransferError, or anything else: the worker must hear why
            if not isinstance(e, transfer.TransferError):
                log.exception("KV transfer %s failed", req.transfer_id)
                e = transfer.TransferError(f"KV transfer {req.transfer_id} from node {req.src_node}: {e!r}")
            a.ledger.release(req.worker_id, dst)
            if len(dst) < n:  # pull() did not run: the source still waits for its references to go
                await self.bus.publish(self.bus.subjects.kv("release", req.src_node),
                                       BlockRefs(worker_id=req.src_worker, block_ids=req.block_ids,
                                                 arena=req.src_arena))
                self.transfers.failed += 1
                self.transfers.last_error = str(e)
            log.warning("%s", e)
            return KVImportReply(ok=False, error=str(e), seconds=time.monotonic() - t0)
        dt = time.monotonic() - t0
        log.info("KV transfer %s: %d blocks (%d bytes, %d chunks) from node %s in %.3fs", req.transfer_id, n,
                 nbytes, chunks, req.src_node, dt)
        return KVImportReply(ok=True, block_ids=dst, bytes=nbytes, chunks=chunks, seconds=dt)

    def lease(self, req: LeaseRequest) -> LeaseReply:
        """Free blocks of the worker's arena, within its model's quota; a lease left short publishes
        pressure (for the model's workers only when its quota, not the arena, was the limit)."""
        a = self.arena(req.arena)
        self.last_seen[req.worker_id] = time.monotonic()
        if req.model is not None:
            self.model_of[req.worker_id] = req.model
        self.quotas.saw(req.model, req.weights_bytes)
        limit = self.quotas.limit(req.model, a.blocks.block_bytes)
        blocks = a.ledger.lease(req.worker_id, req.num_blocks, req.model, limit)
        return LeaseReply(block_ids=blocks, free_blocks=len(a.ledger.free), quota_blocks=limit,
                          model_blocks=a.ledger.by_model[req.model], arena_blocks=a.ledger.limit)

    def models_status(self) -> dict[str, dict]:
        """Per model: the blocks its workers hold now, the most they held at once, its quota (in
        blocks of its arena, which it names)."""
        out = {}
        for a in self.arenas.values():
            bb, led = a.blocks.block_bytes, a.ledger
            for m in sorted({m for m in (*led.by_model, *led.peak) if m is not None}):
                out[m] = {"blocks": led.by_model[m], "bytes": led.by_model[m] * bb, "peak_blocks": led.peak[m],
                          "quota_blocks": self.quotas.limit(m, bb), "weights_bytes": self.quotas.weights.get(m),
                          "arena": a.key}
        return dict(sorted(out.items()))

    def status(self) -> dict:
        """The node's first arena's numbers at the top (as before arenas per shape), each arena's in
        `arenas`; holders and the swap tier summed over them."""
        first, arenas = self.arenas.get(self.first), list(self.arenas.values())
        holders: Counter = Counter()
        for a in arenas:
            holders.update({w: sum(c.values()) for w, c in a.ledger.held.items()})
        swap: Counter = Counter()
        for a in arenas:
            swap.update(a.host.stats())
        return {"node_id": self.node, "num_blocks": first.ledger.limit if first else 0,
                "free_blocks": len(first.ledger.free) if first else 0,
                "block_bytes": first.blocks.block_bytes if first else 0, "models": self.models_status(),
                "holders": dict(holders), "cached_blocks": {w: len(i) for w, i in self.prefix_index.items()},
                "swap": dict(swap), "arenas": {k: a.status() for k, a in self.arenas.items()},
                "budgets": self.budgets.describe(), "retired": self.retired, "resized": self.resized,
                "gpu_retired": self.freeing.status(),
                "transfers": {**self.transfers.as_dict(), "open_pulls": len(self.fetch.pulls)}}

    async def serve(self) -> None:
        s, nc = self.bus.subjects, self.bus.nc

        async def on_arena(msg):
            async def answer():  # its own task: an ask that waits for room holds up no other
                try:
                    req = ArenaRequest.decode(msg.data) if msg.data.strip() else ArenaRequest()
                    await self.wait_for_room(req)
                    a = self.arena_for(req)
                    if req.worker_id:
                        self.freeing.asked(req.worker_id)
                except (ValueError, UnknownArena) as e:
                    log.warning("arena refused: %s", e)
                    await self.bus.respond_error(msg, str(e))
                    return
                await msg.respond(a.desc.encode())
            self._spawn(answer())

        async def on_lease(msg):
            req = LeaseRequest.decode(msg.data)
            try:
                reply = self.lease(req)
            except UnknownArena as e:
                await self.bus.respond_error(msg, str(e))
                return
            await msg.respond(reply.encode())
            if len(reply.block_ids) < req.num_blocks:
                held = self.arena(req.arena).ledger.held
                by_quota = reply.quota_blocks is not None and reply.model_blocks >= reply.quota_blocks
                others = reply.model_blocks > len(held.get(req.worker_id, ()))
                if by_quota and not others:
                    return  # the asker holds its model's whole quota: nobody else's blocks would help
                await self.bus.publish(self.kv("pressure"), PoolPressure(
                    node_id=self.node, asked=req.num_blocks, free_blocks=reply.free_blocks,
                    model=req.model if by_quota else None, arena=self.arena(req.arena).key))

        def refs(data: bytes, verb: str) -> tuple[BlockRefs, Arena] | None:
            r = BlockRefs.decode(data)
            try:
                return r, self.arena(r.arena)
            except UnknownArena as e:
                log.warning("%s of %s ignored: %s", verb, r.worker_id, e)
                return None

        async def on_release(msg):
            if (got := refs(msg.data, "release")) is not None:
                got[1].ledger.release(got[0].worker_id, got[0].block_ids)

        async def on_retain(msg):
            if (got := refs(msg.data, "retain")) is not None:
                got[1].ledger.retain(got[0].worker_id, got[0].block_ids)

        async def on_transfer(msg):
            t = BlockTransfer.decode(msg.data)
            try:
                ok, error = self.arena(t.arena).ledger.transfer(t.from_worker, t.to_worker, t.block_ids), None
            except UnknownArena as e:
                ok, error = False, str(e)
            await msg.respond(TransferReply(ok=ok, error=None if ok else error or "blocks no longer held").encode())

        async def on_heartbeat(msg):
            hb = Heartbeat.decode(msg.data)
            if hb.node_id == self.node:
                self.last_seen[hb.worker_id] = time.monotonic()
                self.freeing.heard(hb.worker_id, hb.ipc_open)
                if hb.arena:
                    self.arena_of[hb.worker_id] = hb.arena
                    if self.asked.get(hb.worker_id, ("",))[0] == hb.arena:
                        del self.asked[hb.worker_id]  # it serves from what it asked for: held by the heartbeat now

        async def on_event(msg):
            ev = KVEvent.decode(msg.data)
            idx = self.prefix_index.setdefault(ev.worker_id, set())
            if ev.cleared:
                idx.clear()
            idx.update(ev.stored)
            idx.difference_update(ev.removed)

        async def on_status(msg):
            await msg.respond(orjson.dumps(self.status()))

        async def on_swap(msg):
            req = SwapRequest.decode(msg.data)
            try:
                reply = await self.swap(req)
            except UnknownArena as e:
                reply = SwapReply(ok=False, error=str(e))
            await msg.respond(reply.encode())

        async def on_import(msg):
            async def run():  # its own task: transfers overlap, and the pool keeps answering meanwhile
                await msg.respond((await self.import_blocks(KVImport.decode(msg.data))).encode())
            self._spawn(run())

        for verb, cb in (("arena", on_arena), ("lease", on_lease), ("release", on_release),
                         ("retain", on_retain), ("transfer", on_transfer), ("status", on_status),
                         ("events", on_event), ("host_events", on_event), ("swap", on_swap), ("import", on_import),
                         ("fetch", self.fetch.on_open), ("chunk", self.fetch.on_chunk), ("close", self.fetch.on_close)):
            await nc.subscribe(self.kv(verb), cb=cb)
        await nc.subscribe(s.heartbeat, cb=on_heartbeat)
        self.reaper = asyncio.ensure_future(self._reap())
        self.greeter = asyncio.ensure_future(self._hello())

    async def _hello(self) -> None:
        """The pool's epoch every second: a worker that hears a new one knows the pool restarted and
        that the blocks it holds are no longer its own (docs/faults.md). One epoch for all arenas."""
        while True:
            try:
                await self.bus.publish(self.kv("hello"), ServiceHello(service_id=self.desc.epoch))
            except Exception as e:  # noqa: BLE001 - the bus may be reconnecting
                log.debug("hello not sent: %s", e)
            await asyncio.sleep(HELLO_INTERVAL)

    async def _reap(self) -> None:
        """Takes back the blocks of workers that went silent (killed, crashed, partitioned); plans
        the arenas again after a manifest reload and retires those the plan wants the memory of."""
        while True:
            await asyncio.sleep(0.5)
            now, since = time.monotonic(), self.bus.heard_since()  # the pool's own time off the bus is no one's silence
            for w, seen in list(self.last_seen.items()):
                if self.bus.silent_for(seen, now) > self.args.worker_timeout:
                    n = sum(a.ledger.drop_worker(w) for a in self.arenas.values())
                    del self.last_seen[w]
                    self.prefix_index.pop(w, None)
                    self.model_of.pop(w, None)
                    self.arena_of.pop(w, None)
                    self.asked.pop(w, None)
                    log.warning("worker %s silent for %.1fs: reclaimed %d block references", w, now - seen, n)
            self.fetch.expire()
            for what in self.freeing.collect(now, since):
                log.info("freed the GPU memory of %s: no worker has it open", what)
            try:
                self.plan_again()
            except Exception:  # noqa: BLE001 - never stop reaping for it
                log.exception("KV arenas not planned again")

    def close(self) -> None:
        """The pool stops: the arenas' shared files lose their names (mappings stay valid)."""
        for a in self.arenas.values():
            node_memory.release(a.desc.backend, a.desc.path)


def add_arguments(p) -> None:
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="the node's KV memory, divided between its "
                   "arenas (one per KV shape of the manifest's models, by their parts: docs/models.md)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--worker-timeout", type=float, default=3.0, help="seconds without heartbeat before a "
                   "worker's blocks are reclaimed")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of host memory for the swap tier of "
                   "evicted prefix-cache blocks (0: none), divided between the arenas as --kv-cache-gb is")
    p.add_argument("--arena-retire-after", type=float, default=30.0, help="seconds a worker's ask for an arena "
                   "keeps it from being retired until the worker serves from it (a reload can leave an arena without "
                   "a model, or sized anew: docs/models.md, KV arenas)")
    p.add_argument("--arena-resize", action=argparse.BooleanOptionalAction, default=True,
                   help="resize the node's shared-memory KV arenas in place when a reload changes their parts, even "
                        "while in use (default); --no-arena-resize: only retire idle ones, as with --device cuda "
                        "(docs/models.md, KV arenas)")
    p.add_argument("--transfer-chunk-bytes", type=int, default=1 << 20, help="largest chunk of a cross-node KV "
                   "transfer (also capped by the server's max_payload)")
    p.add_argument("--transfer-timeout", type=float, default=5.0, help="seconds to wait for one chunk (or the "
                   "source's answer) before a cross-node KV transfer fails")
    p.add_argument("--transfer-ttl", type=float, default=120.0, help="seconds after which a pull from this node "
                   "that was never closed is dropped")


def create_arena(ns: str, node: str, cfg, dtype: str, block_size: int, nbytes: int, swap_bytes: int,
                 device: str, epoch: str, why: str = "", nats_url: str = "",
                 capacity_bytes: int = 0) -> tuple[ArenaDescriptor, object]:
    """An arena of `nbytes` (whole blocks) for KV of cfg's shape in `dtype` (the arena's element dtype),
    in shared memory or on the GPU (`device`); ValueError when nbytes holds no block. A shared file
    is made with room for `capacity_bytes` (the node's whole KV budget), which costs no memory until
    written (a sparse file), so the arena can grow in place; a GPU allocation has exactly nbytes."""
    block_bytes = kv_bytes_per_block(cfg, block_size, dtype)
    num_blocks = nbytes // block_bytes
    key = arena_key(cfg, dtype)
    if num_blocks < 1:
        raise ValueError(f"node {node}'s KV memory has no room for an arena of KV shape {key}"
                         f"{' ' + why if why else ''}: "
                         f"{nbytes} bytes left for it, a block takes {block_bytes} (the manifest's models share "
                         "--kv-cache-gb, docs/models.md)")
    capacity = max(num_blocks, capacity_bytes // block_bytes) if device == "cpu" else num_blocks
    shape = kv_arena_shape(cfg, capacity, block_size, dtype)
    buf, path, ipc = node_memory.create(f"{shm.mesh_prefix(ns, node, nats_url)}-kv-{key}", capacity * block_bytes,
                                        device, numpy=device == "cpu")
    swap_blocks = swap_bytes // block_bytes
    log.info("KV arena %s%s: %d blocks of %d tokens in %s, %.3f GiB at %s; host swap tier: %d blocks", key,
             f" ({why})" if why else "", num_blocks, block_size, dtype, num_blocks * block_bytes / (1 << 30), path,
             swap_blocks)
    return ArenaDescriptor(node_id=node, key=key, path=path, backend=device, ipc=ipc, dtype=dtype, shape=shape,
                           block_size=block_size, num_blocks=num_blocks, capacity_blocks=capacity,
                           swap_blocks=swap_blocks, epoch=epoch, arena_id=uuid.uuid4().hex), buf


def plan(args) -> tuple[ArenaBudgets, KVShape | None]:
    """The node's KV memory per arena key, from the manifest (arenas.py; without one, everything for
    the first arena), and the shape of the first arena: the manifest's first model whose shape is known."""
    total, swap = int(args.kv_cache_gb * (1 << 30)), int(args.swap_space * (1 << 30))
    manifest = ManifestFile(args.models).current() if getattr(args, "models", None) else None
    if manifest is None:
        return ArenaBudgets(total, swap), None
    shapes = manifest_shapes(manifest, args.dtype, getattr(args, "kv_cache_dtype", "auto"))
    b = plan_budgets(total, swap, [(m, shape.key if shape else None, q) for m, shape, q in shapes])
    log.info("KV memory per arena: %s; reserve %d bytes", b.planned, b.describe()["reserve_bytes"])
    return b, next((shape for _, shape, _ in shapes if shape is not None), None)


async def make_arena(bus: Bus, args) -> tuple[ArenaDescriptor, object, ArenaBudgets]:
    """The node's first arena, created at start, and the plan for the others. Its shape: the
    manifest's first model whose shape is known without loading it; else (no manifest, or none
    known) that of --model, asked of the model loader. Returns its descriptor, its memory (keep it
    alive) and the budgets."""
    device = getattr(args, "device", "cpu")
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    check_kv_cache_dtype(kv_cache_dtype)
    budgets, shape = plan(args)
    if shape is None:
        # The variant the workers run (the loader keeps each one it is asked for: asking another would load it).
        load = LoadRequest(model=args.model, dtype=args.dtype, quantization=args.quantization)
        w = await bus.request(bus.subjects.models("load", args.node_id), load, WeightsDescriptor, timeout=600)
        cfg = ModelConfig(**w.config)
        dtype = kv_arena_dtype(kv_cache_dtype, args.dtype)  # int8: each row's values and its scale
        shape = KVShape(num_hidden_layers=cfg.num_hidden_layers, num_key_value_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, dtype=dtype)
    if not getattr(args, "models", None):  # no manifest: the node's KV memory is this arena's, never retired
        budgets.replan({shape.key: budgets.total}, complete=True)
    nbytes = budgets.for_arena(shape.key)
    desc, buf = create_arena(bus.subjects.ns, args.node_id, shape, shape.dtype, args.block_size, nbytes,
                             budgets.swap_for(nbytes), device, uuid.uuid4().hex, why="made at start",
                             nats_url=getattr(bus, "url", ""), capacity_bytes=budgets.total)
    return desc, buf, budgets


async def main(args) -> None:
    async def start(bus: Bus):
        desc, buf, budgets = await make_arena(bus, args)
        try:
            pool = KVPool(bus, args, desc, buf, budgets)
            await pool.serve()
        except BaseException:  # a failed or cancelled start (shared/service.py) leaves no arena file
            node_memory.release(desc.backend, desc.path)
            raise
        return pool.close

    await run_service("kv-pool", args, start)
