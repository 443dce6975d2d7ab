"""The KV blocks one engine holds, and what each of them holds.

Every block held is in exactly one of three states:
- free: in the free queue, this engine may overwrite it. The queue is two segments, so that the
  next allocation is found in O(1): the blocks that cache nothing first, then the cached ones in
  LRU order (a cached prefix is overwritten only once no empty block is left);
- referenced: in the block table of one or more of this engine's sequences (a refcount);
- idle shared: held together with another worker (a prefix handed off), unreferenced here and
  still cached; read-only here, so never in the free queue.
A block may carry a prefix-cache key (shared/prefix_hash.py); the index maps each key to the one
block holding it. A free block keeps its key until it is taken, so a freed prefix stays findable
in LRU order. Keys stored and removed since the last `drain_events` are the KV events.

In the mesh the pool starts empty: the worker leases blocks into it (`add_free`), hands surplus
back (`release_surplus`), and a shared block leaves when its last use here ends (when its key is
dropped, or beyond `max_shared_cached` idle ones); `drain_releases` says which blocks left.
Per-sequence bookkeeping is kv_cache_manager.py's, the mesh's policy services/worker/kv_blocks.py's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice


class BlockPool:
    def __init__(self, num_blocks: int, free_blocks: Iterable[int] | None = None, max_shared_cached: int = 256):
        """num_blocks: the arena's size (block ids are below it); free_blocks: those held at the
        start (default: all of them; the mesh: none, the worker leases them)."""
        self.num_blocks = num_blocks
        self.max_shared_cached = max_shared_cached
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._index: dict[int, int] = {}  # key -> block
        # the free queue: blocks caching nothing (in the order allocation takes them), then the
        # cached ones, least recently used first
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks) if free_blocks is None
                                                                   else free_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._shared: set[int] = set()  # held with another worker: read-only here
        self._idle_shared: OrderedDict[int, None] = OrderedDict()  # shared, unreferenced, cached
        self._num_referenced = 0
        self._released: list[int] = []
        self._stored: list[int] = []
        self._removed: list[int] = []

    # -- counts and lookups

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._lru)

    @property
    def num_held(self) -> int:
        return self._num_referenced + self.num_free + len(self._idle_shared)

    @property
    def usage(self) -> float:
        held = self.num_held
        return 1.0 - self.num_free / held if held else 0.0

    def is_free(self, bid: int) -> bool:
        return bid in self._empty or bid in self._lru

    def _free_queue(self):
        """The free blocks in the order allocation takes them."""
        yield from self._empty
        yield from self._lru

    def _unfree(self, bid: int) -> None:
        """Out of the free queue (it must be there)."""
        (self._empty if self._key[bid] is None else self._lru).pop(bid)

    def _to_free(self, bid: int) -> None:
        """Into the free queue, last of its segment (the most recently used cached block)."""
        (self._empty if self._key[bid] is None else self._lru)[bid] = None

    def ref_count(self, bid: int) -> int:
        return self._ref[bid]

    def is_exclusive(self, bid: int) -> bool:
        """Whether dropping its one reference puts the block back in the free queue."""
        return self._ref[bid] == 1 and bid not in self._shared

    def key_of(self, bid: int) -> int | None:
        return self._key[bid]

    def lookup(self, key: int) -> int | None:
        """The block caching this key, if any."""
        return self._index.get(key)

    def cached_keys(self) -> list[int]:
        return list(self._index)

    def held_blocks(self) -> list[int]:
        """Every block held, in any state (O(num_blocks): for shutting down)."""
        return [b for b in range(self.num_blocks) if self._ref[b]] + list(self._free_queue()) + list(self._idle_shared)

    # -- references

    def take(self) -> int:
        """The next free block (one caching nothing, else the least recently used), its key dropped,
        with one reference."""
        bid, _ = (self._empty or self._lru).popitem(last=False)
        self.forget(bid)
        self._ref[bid] = 1
        self._num_referenced += 1
        return bid

    def ref(self, bid: int) -> None:
        """One more reference to a held block (a prefix-cache hit): out of the free queue if it was there."""
        if self._ref[bid] == 0:
            if bid in self._shared:
                self._idle_shared.pop(bid)
            else:
                self._unfree(bid)
            self._num_referenced += 1
        self._ref[bid] += 1

    def unref(self, bid: int) -> None:
        self._ref[bid] -= 1
        if self._ref[bid]:
            return
        self._num_referenced -= 1
        if bid not in self._shared:
            self._to_free(bid)
        elif self._key[bid] is not None:
            self._idle_shared[bid] = None
            while len(self._idle_shared) > self.max_shared_cached:
                self._release_shared(self._idle_shared.popitem(last=False)[0])
        else:
            self._release_shared(bid)

    def _release_shared(self, bid: int) -> None:
        self.forget(bid)
        self._shared.discard(bid)
        self._released.append(bid)

    # -- the prefix cache

    def cache(self, bid: int, key: int) -> None:
        """The block now holds the prefix named by key (a "stored" event), unless it already has a
        key or another block holds this one."""
        if self._key[bid] is None and key not in self._index:
            free = self._empty.pop(bid, False) is None
            self._index[key] = bid
            self._key[bid] = key
            self._stored.append(key)
            if free:
                self._lru[bid] = None

    def forget(self, bid: int) -> None:
        """Drops the block's key (a "removed" event); a free block moves to the empty ones."""
        key = self._key[bid]
        if key is not None:
            if self._index.get(key) == bid:
                del self._index[key]
                self._removed.append(key)
            self._key[bid] = None
            if self._lru.pop(bid, False) is None:
                self._empty[bid] = None

    def restore(self, bid: int, key: int) -> None:
        """A free block whose bytes were put back from elsewhere (the host tier) caches key again
        (a "stored" event), as the most recently used free block."""
        self._unfree(bid)
        self._key[bid] = key
        self._index[key] = bid
        self._stored.append(key)
        self._lru[bid] = None

    def refresh(self, bid: int) -> None:
        """A free block becomes the most recently used (its prefix is about to be hit)."""
        if bid in self._lru:
            self._lru.move_to_end(bid)

    def num_uncached_free(self) -> int:
        """Free blocks that cache nothing: allocation takes them before any cached one."""
        return len(self._empty)

    def cached_in_next(self, n: int) -> list[tuple[int, int]]:
        """(block, key) of the cached blocks among the next n that allocation takes: the prefixes
        those allocations would overwrite."""
        k = n - len(self._empty)
        return [(b, self._key[b]) for b in islice(self._lru, k)] if k > 0 else []

    def restore_targets(self, m: int, keep: set[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Up to m free blocks to put restored bytes in: (the uncached ones first, then (block, key)
        of the least recently used cached ones not in keep, whose keys are spilled first)."""
        dest = list(islice(self._empty, m))
        victims: list[tuple[int, int]] = []
        if len(dest) < m:
            for b in self._lru:
                if b not in keep:
                    victims.append((b, self._key[b]))
                    if len(dest) + len(victims) == m:
                        break
        return dest, victims

    # -- the mesh: blocks leased, returned, handed between workers

    def add_free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self._empty[b] = None
            self._empty.move_to_end(b, last=False)  # fresh blocks are used before the empty ones freed here

    def release_surplus(self, n: int) -> int:
        """Up to n free blocks leave the pool (for drain_releases), the least useful first: those
        that cache nothing, then the least recently used. Returns how many."""
        out = [self._empty.popitem(last=False)[0] for _ in range(min(n, len(self._empty)))]
        while len(out) < n and self._lru:
            b, _ = self._lru.popitem(last=False)
            self.forget(b)
            out.append(b)
        self._released.extend(out)
        return len(out)

    def cached_from(self, n: int) -> list[tuple[int, int]]:
        """(block, key) of the free cached blocks with ids n and beyond."""
        return [(b, self._key[b]) for b in self._lru if b >= n]

    def release_from(self, n: int) -> int:
        """The free and idle shared blocks with ids n and beyond leave the pool (for drain_releases):
        the node's arena shrank below them. Returns how many blocks beyond n are still referenced
        (they leave the same way once freed and this is called again)."""
        for b in [b for b in self._free_queue() if b >= n]:
            self.forget(b)  # a free cached block moves to the empty ones ...
            self._empty.pop(b)  # ... and leaves
            self._released.append(b)
        for b in [b for b in self._idle_shared if b >= n]:
            self._idle_shared.pop(b)
            self._release_shared(b)
        return sum(1 for b in range(n, self.num_blocks) if self._ref[b])

    def hand_over(self, bid: int) -> bool:
        """One reference goes to another worker with its sequence. A block cached here, or still in
        another sequence here, is then held by both (read-only here from now on: True); any other
        leaves this pool (False)."""
        if self._key[bid] is not None or self._ref[bid] > 1:
            self._shared.add(bid)
            self.unref(bid)
            return True
        self._ref[bid] = 0
        self._num_referenced -= 1
        self._shared.discard(bid)  # it may come back later as a block of this worker's own
        return False

    def adopt(self, bid: int, shared: bool) -> None:
        """A reference that comes with a sequence from another worker (shared: that worker keeps
        the block too, so it is read-only here)."""
        if self._ref[bid] == 0:
            if bid in self._shared:
                self._idle_shared.pop(bid, None)
            elif self.is_free(bid):  # already held idle
                self._unfree(bid)
            self._num_referenced += 1
        self._ref[bid] += 1
        if shared:
            self._shared.add(bid)

    def drain_events(self) -> tuple[list[int], list[int]]:
        """Keys (stored, removed) since the last call: the KV events."""
        stored, removed = self._stored, self._removed
        self._stored, self._removed = [], []
        return stored, removed

    def drain_releases(self) -> list[int]:
        """Blocks that left the pool since the last call: the owner gives them back to the node's pool."""
        out, self._released = self._released, []
        return out

    def check(self) -> None:
        """Asserts the pool's invariants (O(num_blocks): for tests)."""
        free, idle = set(self._empty) | set(self._lru), set(self._idle_shared)
        assert not set(self._empty) & set(self._lru), "a block in both segments of the free queue"
        assert all(self._key[b] is None for b in self._empty), "a cached block among the empty ones"
        assert all(self._key[b] is not None for b in self._lru), "an empty block among the cached ones"
        referenced = {b for b in range(self.num_blocks) if self._ref[b]}
        assert all(r >= 0 for r in self._ref), "a negative refcount"
        assert not free & referenced and not idle & referenced and not free & idle, "a block in two states"
        assert not free & self._shared and idle <= self._shared, "a shared block in the free queue"
        assert len(referenced) == self._num_referenced, "the count of referenced blocks drifted"
        assert all(self._key[b] is not None for b in idle), "an idle shared block that caches nothing"
        assert all(self._key[b] == k for k, b in self._index.items()), "a key whose block holds another"
        held = free | idle | referenced
        assert all(b in held for b in self._index.values()), "a key of a block no longer held"
