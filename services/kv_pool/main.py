"""`meshserve serve kv-pool`: owns the node's KV arena (a shared-memory file every worker maps)
and who holds which block.

Workers lease free blocks in batches (no NATS round trip per block on the hot path) and release
them in batches. A block may be held by several workers at once (a prefill worker keeps a prefix
it handed to a decode worker); it is free again when its last reference is released. A worker
that stops sending heartbeats loses all its references. Workers' KV events (prefix-cache keys
stored and removed) are kept as the node's prefix index, per worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

import orjson

from meshserve.shared import shm
from meshserve.shared.bus import Bus
from meshserve.shared.engine.llm import DTYPES
from meshserve.shared.engine.llm_engine import kv_arena_shape, kv_bytes_per_block
from meshserve.shared.model.config import ModelConfig
from meshserve.shared.schemas import (ArenaDescriptor, BlockRefs, BlockTransfer, Heartbeat, KVEvent,
                                      LeaseReply, LeaseRequest, LoadRequest, TransferReply,
                                      WeightsDescriptor)
from meshserve.shared.service import run_service

log = logging.getLogger("meshserve.kv_pool")


class BlockLedger:
    """References per block and per worker. Pure bookkeeping: the service around it does I/O."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.held: dict[str, Counter] = {}

    def lease(self, worker: str, n: int) -> list[int]:
        out = [self.free.popleft() for _ in range(min(n, len(self.free)))]
        held = self.held.setdefault(worker, Counter())
        for b in out:
            self.refs[b] = 1
            held[b] += 1
        return out

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
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

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

    def drop_worker(self, worker: str) -> int:
        held = self.held.pop(worker, Counter())
        for b, n in held.items():
            self.refs[b] -= n
            if self.refs[b] == 0:
                self.free.append(b)
        return sum(held.values())


class KVPool:
    def __init__(self, bus: Bus, args, desc: ArenaDescriptor):
        self.bus, self.args, self.desc = bus, args, desc
        self.ledger = BlockLedger(desc.num_blocks)
        self.last_seen: dict[str, float] = {}
        self.prefix_index: dict[str, set[int]] = {}

    async def serve(self) -> None:
        s, nc = self.bus.subjects, self.bus.nc

        async def on_arena(msg):
            await msg.respond(self.desc.encode())

        async def on_lease(msg):
            req = LeaseRequest.decode(msg.data)
            self.last_seen[req.worker_id] = time.monotonic()
            blocks = self.ledger.lease(req.worker_id, req.num_blocks)
            await msg.respond(LeaseReply(block_ids=blocks, free_blocks=len(self.ledger.free)).encode())

        async def on_release(msg):
            r = BlockRefs.decode(msg.data)
            self.ledger.release(r.worker_id, r.block_ids)

        async def on_retain(msg):
            r = BlockRefs.decode(msg.data)
            self.ledger.retain(r.worker_id, r.block_ids)

        async def on_transfer(msg):
            t = BlockTransfer.decode(msg.data)
            ok = self.ledger.transfer(t.from_worker, t.to_worker, t.block_ids)
            await msg.respond(TransferReply(ok=ok, error=None if ok else "blocks no longer held").encode())

        async def on_heartbeat(msg):
            self.last_seen[Heartbeat.decode(msg.data).worker_id] = time.monotonic()

        async def on_event(msg):
            ev = KVEvent.decode(msg.data)
            idx = self.prefix_index.setdefault(ev.worker_id, set())
            if ev.cleared:
                idx.clear()
            idx.update(ev.stored)
            idx.difference_update(ev.removed)

        async def on_status(msg):
            await msg.respond(orjson.dumps({
                "num_blocks": self.desc.num_blocks, "free_blocks": len(self.ledger.free),
                "holders": {w: sum(c.values()) for w, c in self.ledger.held.items()},
                "cached_blocks": {w: len(i) for w, i in self.prefix_index.items()}}))

        for verb, cb in (("arena", on_arena), ("lease", on_lease), ("release", on_release),
                         ("retain", on_retain), ("transfer", on_transfer), ("status", on_status)):
            await nc.subscribe(s.kv(verb), cb=cb)
        await nc.subscribe(s.heartbeat, cb=on_heartbeat)
        await nc.subscribe(s.kv("events"), cb=on_event)
        self.reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Takes back the blocks of workers that went silent (killed, crashed, partitioned)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for w, seen in list(self.last_seen.items()):
                if now - seen > self.args.worker_timeout:
                    n = self.ledger.drop_worker(w)
                    del self.last_seen[w]
                    self.prefix_index.pop(w, None)
                    log.warning("worker %s silent for %.1fs: reclaimed %d block references", w, now - seen, n)


def add_arguments(p) -> None:
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="size of the node's KV arena")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--worker-timeout", type=float, default=3.0, help="seconds without heartbeat before a "
                   "worker's blocks are reclaimed")


async def make_arena(bus: Bus, args) -> ArenaDescriptor:
    """Sizes the arena from the model's shape (asked of the model loader) and creates it."""
    w = await bus.request(bus.subjects.models("load"), LoadRequest(model=args.model, dtype=args.dtype),
                          WeightsDescriptor, timeout=600)
    cfg = ModelConfig(**w.config)
    dtype = DTYPES[args.dtype]
    num_blocks = max(1, int(args.kv_cache_gb * (1 << 30)) // kv_bytes_per_block(cfg, args.block_size, dtype))
    shape = kv_arena_shape(cfg, num_blocks, args.block_size)
    nbytes = num_blocks * kv_bytes_per_block(cfg, args.block_size, dtype)
    path = shm.create(f"meshserve-{bus.subjects.ns}-{args.node_id}-kv", nbytes)
    log.info("KV arena: %d blocks of %d tokens, %.2f GiB at %s", num_blocks, args.block_size, nbytes / (1 << 30), path)
    return ArenaDescriptor(node_id=args.node_id, path=str(path), dtype=args.dtype, shape=shape,
                           block_size=args.block_size, num_blocks=num_blocks)


async def main(args) -> None:
    async def start(bus: Bus):
        desc = await make_arena(bus, args)
        pool = KVPool(bus, args, desc)
        await pool.serve()
        return lambda: shm.unlink(desc.path)

    await run_service("kv-pool", args, start)
