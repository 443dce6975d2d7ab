"""The paged KV cache's bookkeeping: which blocks each sequence owns, and the prefix cache.

A full block is keyed by a chained hash of (parent block's hash, its tokens, the model), so a
key names the whole prefix up to that block. Blocks are refcounted; a block whose count drops
to zero keeps its key and stays findable in LRU order until its space is needed again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .sequence import Sequence


def block_hash(parent: int | None, tokens: list[int], model: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(model.encode())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model: str = ""):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.model = enable_prefix_caching, model
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, seq: Sequence, upto: int) -> list[int]:
        """Extends seq.block_hashes to cover the full blocks among its first `upto` tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), upto // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], self.model))
        return seq.block_hashes

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        h = self.hash_of[bid]
        if h is not None:  # evict its prefix-cache entry
            if self.cached.get(h) == bid:
                del self.cached[h]
            self.hash_of[bid] = None
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

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Gives seq the blocks to hold num_new_tokens more computed tokens; False if there are too few."""
        first = not seq.block_table and seq.num_computed_tokens == 0
        hits = self._match_prefix(seq) if first else []
        need = self.blocks_needed(seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens)
        new = need - len(seq.block_table) - len(hits)
        reclaim = sum(1 for b in hits if self.ref_count[b] == 0)  # hits sitting in the free list
        if new > len(self.free) - reclaim:
            return False
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
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
        seq.num_published_blocks = full

    def free_seq(self, seq: Sequence) -> None:
        """Releases seq's blocks; the tail is evicted first since it is the least shared."""
        for bid in reversed(seq.block_table):
            self.ref_count[bid] -= 1
            if self.ref_count[bid] == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_published_blocks = 0
