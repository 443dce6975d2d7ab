"""The host swap tier of a node's KV cache: prefix-cache blocks evicted from the arena, kept in
host memory of the kv-pool, least recently used dropped first, by their chained prefix keys.

A worker about to overwrite a cached block it no longer uses asks the kv-pool to copy it here
(`SwapRequest.swap_out`, block ids only cross NATS); a later request whose prompt starts with that
prefix asks for it back into a block of its own (`swap_in`) and skips recomputing it. The tier is
inclusive: a block copied back stays here too (it costs nothing until the space is needed), so
spilling it again is free. On the CPU backend the arena is host memory as well; the tier is what
keeps a prefix alive once the arena's blocks are taken for other work. On the CUDA backend the
copies are torch copies between the GPU arena and this host memory (blocks.py). The tier holds
its bytes in arrays of the kind the arena's blocks come in (numpy on the CPU backend, where the
kv-pool has no torch; torch host memory for a GPU arena).
"""

from __future__ import annotations

from collections import OrderedDict

from meshserve.shared.schemas import SwapReply, SwapRequest

from .blocks import ArenaBlocks, empty_bytes_like


class HostTier:
    """`capacity` blocks of `block_bytes` each. Pure bookkeeping plus the copies; no I/O."""

    def __init__(self, capacity: int, block_bytes: int):
        self.capacity, self.block_bytes = max(0, capacity), block_bytes
        self.store = None  # [capacity, block_bytes], made with the first block put (empty_bytes_like)
        self.index: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(self.capacity - 1, -1, -1))
        self.stored: list[int] = []  # keys added since the last drain (KV events, tier "host")
        self.removed: list[int] = []
        self.num_swapped_out = 0  # blocks copied arena -> host
        self.num_swapped_in = 0  # blocks copied host -> arena
        self.num_evicted = 0  # entries dropped for space
        self.num_lookups = 0  # keys asked for
        self.num_hits = 0  # of those, found

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: int) -> bool:
        return key in self.index

    def put(self, key: int, data) -> bool:
        """Keeps a block's bytes under its key; False if it was there already (then only refreshed)."""
        if not self.enabled:
            return False
        slot = self.index.get(key)
        if slot is not None:
            self.index.move_to_end(key)
            return False
        if not self.free_slots:
            old, slot = self.index.popitem(last=False)
            self.removed.append(old)
            self.num_evicted += 1
        else:
            slot = self.free_slots.pop()
        if self.store is None:
            self.store = empty_bytes_like(data, (self.capacity, self.block_bytes))
        self.store[slot][...] = data.reshape(-1)
        self.index[key] = slot
        self.stored.append(key)
        self.num_swapped_out += 1
        return True

    def get(self, key: int):
        """The block's bytes (a view into the tier: copy them before the next put), refreshed as used."""
        self.num_lookups += 1
        slot = self.index.get(key)
        if slot is None:
            return None
        self.index.move_to_end(key)
        self.num_hits += 1
        self.num_swapped_in += 1
        return self.store[slot]

    def drain_events(self) -> tuple[list[int], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def apply(self, blocks: ArenaBlocks, req: SwapRequest) -> SwapReply:
        """Copies `swap_out` blocks of the arena here, then the leading found keys of `swap_in` back."""
        stored = sum(self.put(h, blocks.read(b)) for b, h in req.swap_out)
        restored = 0
        for h, b in req.swap_in:  # a prefix chain: the first miss ends it
            data = self.get(h)
            if data is None:
                break
            blocks.write(b, data)
            restored += 1
        return SwapReply(ok=True, stored=stored, restored=restored)

    def stats(self) -> dict:
        return {"capacity_blocks": self.capacity, "used_blocks": len(self.index),
                "swapped_out": self.num_swapped_out, "swapped_in": self.num_swapped_in,
                "lookups": self.num_lookups, "hits": self.num_hits, "evicted": self.num_evicted}
