"""KV blocks between nodes, over NATS, in chunks below the server's max_payload.

On one node a prefill -> decode handoff moves block ids only. When the decode worker is on another
node, its kv-pool pulls the bytes from the source node's kv-pool:

    dst kv-pool -> <ns>.kv.<src>.fetch   KVFetchOpen   layouts compared, the holder's blocks checked
                <- KVFetchInfo                         total bytes, chunk size, number of chunks
    dst kv-pool -> <ns>.kv.<src>.chunk   KVChunkRequest(index), a few in flight
                <- the chunk's raw bytes; headers: its index and CRC-32 (or an error)
    dst kv-pool -> <ns>.kv.<src>.close   KVFetchClose  the source drops the holder's references

Pulling (request/reply per chunk) is the flow control NATS lacks: the source sends a chunk only
when asked, the destination asks for at most `window` at once. Every reply is checked (index,
length, CRC-32) and written straight into the destination's blocks; a lost reply is asked for
again once, then the transfer fails with an error that says which chunk of what and why. A chunk
is at most max_payload (of the connection that sends it) less room for headers; nothing is ever too
large to send, and a server too small to carry any chunk is an error at once, not a timeout.

Block ids are of one arena: the open names the source's (`KVFetchOpen.arena`, none: the node's
first), and the destination writes into the arena it passes (the adopting worker's). The source
serves from its arena while the holder (the prefill worker that handed the sequence
off) keeps its reference: it checks that on every chunk, so blocks reclaimed from a dead worker
are never served. A pull not closed within `ttl` seconds is dropped and its references released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import nats.errors

from meshserve.shared.bus import Bus, reply_error
from meshserve.shared.schemas import KVChunkRequest, KVFetchClose, KVFetchInfo, KVFetchOpen

from .blocks import ArenaBlocks

log = logging.getLogger("meshserve.kv_pool.transfer")

HEADROOM = 4096  # bytes of max_payload left for the headers and the protocol's own overhead
NO_RESPONDERS_WAIT = 1.0  # seconds a source with no subscriber is asked again before the pull fails
H_INDEX, H_CRC = "Meshserve-Chunk", "Meshserve-Crc32"  # an error is the bus's ERROR_HEADER


class TransferError(RuntimeError):
    """A transfer that cannot complete; the message says which and why."""


def chunk_limit(max_payload: int, wanted: int = 0) -> int:
    limit = max_payload - HEADROOM
    if limit <= 0:
        raise TransferError(f"the NATS server's max_payload ({max_payload} bytes) leaves no room for a KV "
                            f"chunk; it must be above {HEADROOM} bytes")
    return min(wanted, limit) if wanted > 0 else limit


@dataclass
class TransferStats:
    served: int = 0  # pulls opened here as the source
    chunks_sent: int = 0
    bytes_sent: int = 0
    received: int = 0  # pulls completed here as the destination
    chunks_received: int = 0
    bytes_received: int = 0
    failed: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Pull:
    holder: str
    block_ids: list[int]  # copied, then released at close
    also_release: list[int]
    chunk_bytes: int
    total: int
    blocks: ArenaBlocks  # the arena the ids are of, its holders and its release
    held: dict[str, Counter]
    release: object
    created: float = field(default_factory=time.monotonic)


class FetchServer:
    """The source side: serves chunks of its arenas' blocks to other nodes' kv-pools."""

    def __init__(self, bus: Bus, arena, stats: TransferStats, ttl: float = 120.0):
        """arena(key) -> (blocks, held: holder -> its references, release(holder, ids)) of the arena a
        pull names (None: the node's first; LookupError: no such arena)."""
        self.bus, self.arena, self.stats = bus, arena, stats
        self.ttl = ttl
        self.pulls: dict[str, _Pull] = {}

    @staticmethod
    def _holds(held: dict[str, Counter], holder: str, block_ids: list[int]) -> bool:
        mine = held.get(holder, Counter())
        return all(mine[b] >= n for b, n in Counter(block_ids).items())

    async def on_open(self, msg) -> None:
        o = KVFetchOpen.decode(msg.data)
        try:
            b, held, release = self.arena(o.arena)
        except LookupError as e:
            await msg.respond(KVFetchInfo(ok=False, error=str(e)).encode())
            return
        if o.dtype != b.dtype or o.block_shape != b.block_shape:
            info = KVFetchInfo(ok=False, error=f"KV layouts differ: this node has {b.dtype} blocks of "
                               f"{b.block_shape}, the destination {o.dtype} of {o.block_shape}")
        elif not self._holds(held, o.holder, o.block_ids + o.also_release):
            info = KVFetchInfo(ok=False, error=f"{o.holder} no longer holds blocks {o.block_ids[:8]}... here "
                               "(the worker is gone and its blocks were reclaimed?)")
        else:
            try:
                size = chunk_limit(self.bus.nc.max_payload, o.max_chunk_bytes)
            except TransferError as e:
                info = KVFetchInfo(ok=False, error=str(e))
            else:
                total = len(o.block_ids) * b.block_bytes
                self.pulls[o.transfer_id] = _Pull(o.holder, list(o.block_ids), list(o.also_release), size, total,
                                                  b, held, release)
                self.stats.served += 1
                info = KVFetchInfo(ok=True, total_bytes=total, chunk_bytes=size, num_chunks=-(-total // size))
        await msg.respond(info.encode())

    async def on_chunk(self, msg) -> None:
        r = KVChunkRequest.decode(msg.data)
        p = self.pulls.get(r.transfer_id)
        if p is None:
            return await self._error(msg, f"no open transfer {r.transfer_id!r} (closed, or dropped after "
                                          f"{self.ttl:.0f}s)")
        if not 0 <= r.index < -(-p.total // p.chunk_bytes):
            return await self._error(msg, f"chunk {r.index} is out of range")
        if not self._holds(p.held, p.holder, p.block_ids):
            return await self._error(msg, f"{p.holder} no longer holds the blocks (the worker is gone?)")
        offset = r.index * p.chunk_bytes
        data = p.blocks.read_range(p.block_ids, offset, min(p.chunk_bytes, p.total - offset))
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += len(data)
        await self.bus.nc.publish(msg.reply, data, headers={H_INDEX: str(r.index), H_CRC: str(zlib.crc32(data))})

    async def on_close(self, msg) -> None:
        c = KVFetchClose.decode(msg.data)
        p = self.pulls.pop(c.transfer_id, None)
        if p is not None and c.release:
            p.release(p.holder, p.block_ids + p.also_release)
        if msg.reply:
            await msg.respond(b"{}")

    async def _error(self, msg, error: str) -> None:
        await self.bus.respond_error(msg, error)

    def expire(self) -> None:
        now = time.monotonic()
        for tid, p in list(self.pulls.items()):
            if now - p.created > self.ttl:
                del self.pulls[tid]
                p.release(p.holder, p.block_ids + p.also_release)
                log.warning("transfer %s was never closed: dropped after %.0fs, %s's references released",
                            tid, self.ttl, p.holder)


async def pull(bus: Bus, src_node: str, transfer_id: str, holder: str, src_blocks: list[int],
               dst_blocks: list[int], blocks: ArenaBlocks, max_chunk_bytes: int = 0, timeout: float = 5.0,
               window: int = 4, retries: int = 1, stats: TransferStats | None = None,
               also_release: list[int] | None = None, src_arena: str | None = None) -> tuple[int, int]:
    """The destination side: copies `src_blocks` of node `src_node`'s arena `src_arena` (None: its
    first) into `dst_blocks` of `blocks` (an arena here).
    Returns (bytes, chunks); raises TransferError. Closes the pull (the holder's references on the
    source go, on `also_release` too) whether it worked or not: a failed transfer is recomputed,
    never retried from there."""
    stats = stats or TransferStats()
    nc, s = bus.nc, bus.subjects
    what = f"KV transfer {transfer_id} ({len(src_blocks)} blocks from node {src_node})"
    try:
        opened = KVFetchOpen(transfer_id=transfer_id, holder=holder, block_ids=src_blocks, arena=src_arena,
                             dtype=blocks.dtype, block_shape=blocks.block_shape,
                             max_chunk_bytes=chunk_limit(nc.max_payload, max_chunk_bytes),
                             also_release=also_release or [])
        deadline = time.monotonic() + min(timeout, NO_RESPONDERS_WAIT)
        while True:
            try:
                m = await nc.request(s.kv("fetch", src_node), opened.encode(), timeout=timeout)
                break
            except nats.errors.NoRespondersError:  # the server may not have seen a fresh subscription yet
                if time.monotonic() > deadline:
                    raise TransferError(f"{what}: no kv-pool answers for node {src_node!r}") from None
                await asyncio.sleep(0.1)
            except nats.errors.TimeoutError:
                raise TransferError(f"{what}: the kv-pool of node {src_node!r} did not answer in "
                                    f"{timeout:.1f}s") from None
        info = KVFetchInfo.decode(m.data)
        if not info.ok:
            raise TransferError(f"{what}: {info.error}")
        if info.total_bytes != len(src_blocks) * blocks.block_bytes:
            raise TransferError(f"{what}: the source offers {info.total_bytes} bytes, "
                                f"{len(src_blocks) * blocks.block_bytes} expected")
        n, size = info.num_chunks, info.chunk_bytes
        subject, sem = s.kv("chunk", src_node), asyncio.Semaphore(window)

        async def one(i: int) -> None:
            req = KVChunkRequest(transfer_id=transfer_id, index=i).encode()
            async with sem:
                for attempt in range(retries + 1):
                    try:
                        r = await nc.request(subject, req, timeout=timeout)
                        break
                    except nats.errors.TimeoutError:
                        if attempt == retries:
                            raise TransferError(f"{what}: chunk {i + 1} of {n} not answered in {timeout:.1f}s "
                                                f"({retries + 1} tries)") from None
                    except nats.errors.NoRespondersError:
                        if attempt == retries:
                            raise TransferError(f"{what}: the kv-pool of node {src_node!r} went away at chunk "
                                                f"{i + 1} of {n}") from None
                        await asyncio.sleep(0.1)
            hdr = r.headers or {}
            error = reply_error(r)
            if error is not None:
                raise TransferError(f"{what}: chunk {i + 1} of {n}: {error}")
            want = min(size, info.total_bytes - i * size)
            if hdr.get(H_INDEX) != str(i) or len(r.data) != want:
                raise TransferError(f"{what}: chunk {i + 1} of {n} came back as index {hdr.get(H_INDEX)} with "
                                    f"{len(r.data)} bytes ({want} expected)")
            if hdr.get(H_CRC) != str(zlib.crc32(r.data)):
                raise TransferError(f"{what}: chunk {i + 1} of {n} fails its CRC-32 check")
            blocks.write_range(dst_blocks, i * size, r.data)
            stats.chunks_received += 1
            stats.bytes_received += len(r.data)

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        stats.received += 1
        return info.total_bytes, n
    except TransferError as e:
        stats.failed += 1
        stats.last_error = str(e)
        raise
    finally:
        try:
            await nc.request(s.kv("close", src_node), KVFetchClose(transfer_id=transfer_id).encode(), timeout=2)
        except Exception as e:  # noqa: BLE001 - the source's ttl releases the references then
            log.warning("%s: could not close the pull on node %s: %s", what, src_node, e)
