"""The paged KV cache's bookkeeping: which blocks each sequence owns, and the prefix cache.

A full block is keyed by a chained hash of (parent block's hash, its tokens, the model), so a
key names the whole prefix up to that block. Blocks are refcounted; a block whose count drops
to zero keeps its key and stays findable in LRU order until its space is needed again.

In the mesh a worker manages only the blocks it holds from the node's kv-pool: it starts with
none, `add_free` gives it leased blocks, and blocks it shares with another worker (after a
prefill -> decode handoff) are never overwritten here: when their cache entry is dropped they
go to `to_release`, for the worker to hand back to the pool.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from .sequence import Sequence


def block_hash(parent: int | None, tokens: list[int], model: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(model.encode())
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(tokens: list[int], block_size: int, model: str) -> list[int]:
    """The chained keys of a prompt's full blocks (what a router compares with workers' caches)."""
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        out.append(block_hash(out[-1] if out else None, tokens[i * block_size:(i + 1) * block_size], model))
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model: str = "", free_blocks: Iterable[int] | None = None, max_shared_cached: int = 256):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.model = enable_prefix_caching, model
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # Blocks this manager may overwrite, least recently used first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks) if free_blocks is None
                                                                 else free_blocks)
        self.shared: set[int] = set()  # held together with another worker: read-only here
        self.free_shared: OrderedDict[int, None] = OrderedDict()  # shared, unreferenced, still cached
        self.max_shared_cached = max_shared_cached
        self.to_release: list[int] = []  # shared blocks dropped from the cache: back to the pool
        self.stored: list[int] = []  # prefix-cache keys added since the last drain (KV events)
        self.removed: list[int] = []  # ... and removed
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_held_blocks(self) -> int:
        return sum(1 for r in self.ref_count if r) + len(self.free) + len(self.free_shared)

    @property
    def usage(self) -> float:
        held = self.num_held_blocks
        return 1.0 - len(self.free) / held if held else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, seq: Sequence, upto: int) -> list[int]:
        """Extends seq.block_hashes to cover the full blocks among its first `upto` tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), upto // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], self.model))
        return seq.block_hashes

    def forget(self, bid: int) -> None:
        """Drops the block's prefix-cache key (a "removed" KV event); the block itself stays where it is."""
        h = self.hash_of[bid]
        if h is not None:
            if self.cached.get(h) == bid:
                del self.cached[h]
                self.removed.append(h)
            self.hash_of[bid] = None

    def restore(self, bid: int, h: int) -> None:
        """A free block whose bytes were put back from elsewhere (the host tier) caches key h again
        (a "stored" KV event), as the most recently used free block."""
        self.hash_of[bid] = h
        self.cached[h] = bid
        self.stored.append(h)
        self.free.move_to_end(bid)

    def uncached_first(self) -> int:
        """Puts the free blocks that cache nothing before the cached ones, so allocation takes them
        first and the cached ones are the next victims; returns how many there are."""
        uncached = [b for b in self.free if self.hash_of[b] is None]
        for b in reversed(uncached):
            self.free.move_to_end(b, last=False)
        return len(uncached)

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        self.forget(bid)
        self.ref_count[bid] = 1
        return bid

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the sequence's leading tokens; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._full_block_hashes(seq, seq.num_tokens - 1):
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def _plan(self, seq: Sequence, num_new_tokens: int) -> tuple[bool, list[int], int, int]:
        """(first allocation, prefix-cache hits, new blocks to take, how many more free blocks that needs)."""
        first = not seq.block_table and seq.num_computed_tokens == 0
        hits = self._match_prefix(seq) if first else []
        cached = len(hits) * self.block_size  # a chunk sized before the hits were known ends at the same place
        need = self.blocks_needed(seq.num_computed_tokens + min(cached + num_new_tokens, seq.num_tokens))
        new = need - len(seq.block_table) - len(hits)
        reclaim = sum(1 for b in hits if b in self.free)  # hits sitting in the free list
        return first, hits, new, max(0, new - (len(self.free) - reclaim))

    def blocks_short(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks missing for allocate(seq, num_new_tokens) to succeed (0: it fits)."""
        return self._plan(seq, num_new_tokens)[3]

    def num_freeable(self, seq: Sequence) -> int:
        """Blocks free_seq(seq) would put back in the free list (those no one else holds)."""
        return sum(1 for b in seq.block_table if self.ref_count[b] == 1 and b not in self.shared)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Gives seq the blocks to hold num_new_tokens more computed tokens; False if there are too few."""
        first, hits, new, short = self._plan(seq, num_new_tokens)
        if short:
            return False
        for b in hits:
            if self.ref_count[b] == 0:
                (self.free_shared if b in self.shared else self.free).pop(b)
            self.ref_count[b] += 1
        seq.block_table.extend(hits)
        for _ in range(max(new, 0)):
            seq.block_table.append(self._take_free())
        if first:
            cached = len(hits) * self.block_size
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            if self.enable_prefix_caching:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += cached
        return True

    def num_new_tokens_cached(self, seq: Sequence) -> int:
        """Tokens a waiting sequence would find in the prefix cache (for routing and admission)."""
        return len(self._match_prefix(seq)) * self.block_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publishes the sequence's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        for i in range(seq.num_published_blocks, full):
            bid, h = seq.block_table[i], hashes[i]
            if self.hash_of[bid] is None and h not in self.cached:
                self.cached[h] = bid
                self.hash_of[bid] = h
                self.stored.append(h)
        seq.num_published_blocks = full

    def _unref(self, bid: int) -> None:
        self.ref_count[bid] -= 1
        if self.ref_count[bid]:
            return
        if bid not in self.shared:
            self.free[bid] = None
        elif self.hash_of[bid] is not None:
            self.free_shared[bid] = None
            while len(self.free_shared) > self.max_shared_cached:
                self._release_shared(self.free_shared.popitem(last=False)[0])
        else:
            self._release_shared(bid)

    def _release_shared(self, bid: int) -> None:
        self.forget(bid)
        self.shared.discard(bid)
        self.to_release.append(bid)

    def free_seq(self, seq: Sequence) -> None:
        """Releases seq's blocks; the tail is evicted first since it is the least shared."""
        for bid in reversed(seq.block_table):
            self._unref(bid)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_published_blocks = 0

    # -- the mesh: blocks leased from and returned to the node's kv-pool, handed between workers

    def add_free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self.free[b] = None
            self.free.move_to_end(b, last=False)  # fresh blocks are used before cached ones

    def take_surplus(self, n: int) -> list[int]:
        """Up to n free blocks to give back to the pool, the least useful (uncached, then LRU) first."""
        out = [b for b in self.free if self.hash_of[b] is None][:n]
        for b in out:
            del self.free[b]
        while len(out) < n and self.free:
            b, _ = self.free.popitem(last=False)
            self.forget(b)
            out.append(b)
        return out

    def detach_seq(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Hands seq's blocks to another worker. Full cached blocks stay in this cache too (both
        hold them, so they become read-only here); the rest leave this manager entirely.
        Returns (all block ids, the shared ones)."""
        blocks, shared = list(seq.block_table), []
        for bid in blocks:
            if self.hash_of[bid] is not None:
                shared.append(bid)
                self.shared.add(bid)
                self._unref(bid)
            else:
                self.ref_count[bid] -= 1
                assert self.ref_count[bid] == 0, "an uncached block is only ever in one sequence"
        seq.block_table = []
        return blocks, shared

    def adopt_seq(self, seq: Sequence, block_ids: list[int], shared_ids: Iterable[int]) -> None:
        """Takes over a sequence prefilled elsewhere, with its blocks."""
        shared = set(shared_ids)
        for bid in block_ids:
            self.ref_count[bid] += 1
            if bid in shared:
                self.shared.add(bid)
        seq.block_table = list(block_ids)

    def drain_events(self) -> tuple[list[int], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def drain_releases(self) -> list[int]:
        out, self.to_release = self.to_release, []
        return out
