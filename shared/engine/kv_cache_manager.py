"""Each sequence's side of the paged KV cache: its block table, its prefix-cache hits, what the
next step needs, and handing a sequence (with its blocks) to another worker and back.

The blocks themselves, their refcounts and the prefix-cache index are the BlockPool's
(block_pool.py); this module asks it for blocks and gives them back. A sequence's full blocks
are keyed by chained hashes (shared/prefix_hash.py), computed once and kept on the sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..prefix_hash import block_hash, namespace, prompt_block_hashes
from .block_pool import BlockPool
from .sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True, model: str = ""):
        self.pool, self.block_size = pool, block_size
        self.enable_prefix_caching, self.model = enable_prefix_caching, model
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_keys(self, seq: Sequence, upto: int) -> list[int]:
        """Extends seq.block_hashes to cover the full blocks among its first `upto` tokens."""
        bs, ns = self.block_size, self.namespace(seq)
        for i in range(len(seq.block_hashes), upto // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], ns))
        return seq.block_hashes

    def namespace(self, seq: Sequence) -> str:
        """What the sequence's block keys are salted with (prefix_hash.namespace)."""
        return namespace(self.model, seq.lora_key, seq.cache_salt)

    def prefix_keys(self, tokens: list[int], lora_key: str | None = None, cache_salt: str | None = None) -> list[int]:
        """The keys a sequence of these tokens (with that LoRA adapter and cache salt) looks up when
        admitted (its full blocks, less the last token, which is always computed); none without
        prefix caching."""
        if not self.enable_prefix_caching:
            return []
        return prompt_block_hashes(tokens[:len(tokens) - 1], self.block_size,
                                   namespace(self.model, lora_key, cache_salt))

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the sequence's leading tokens; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._block_keys(seq, seq.num_tokens - 1):
            bid = self.pool.lookup(key)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def _plan(self, seq: Sequence, num_new_tokens: int, lookahead: int = 0) -> tuple[bool, list[int], int, int]:
        """(first allocation, prefix-cache hits, new blocks to take, how many more free blocks that needs)."""
        first = not seq.block_table and seq.num_computed_tokens == 0
        hits = self._match_prefix(seq) if first else []
        cached = len(hits) * self.block_size  # a chunk sized before the hits were known ends at the same place
        need = self.blocks_needed(seq.num_computed_tokens + min(cached + num_new_tokens, seq.num_tokens) + lookahead)
        new = need - len(seq.block_table) - len(hits)
        reclaim = sum(1 for b in hits if self.pool.is_free(b))  # hits sitting in the free queue
        return first, hits, new, max(0, new - (self.pool.num_free - reclaim))

    def blocks_short(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks missing for allocate(seq, num_new_tokens) to succeed (0: it fits)."""
        return self._plan(seq, num_new_tokens)[3]

    def num_freeable(self, seq: Sequence) -> int:
        """Blocks free(seq) would put back in the free queue (those no one else holds)."""
        return sum(1 for b in seq.block_table if self.pool.is_exclusive(b))

    def allocate(self, seq: Sequence, num_new_tokens: int, lookahead: int = 0) -> bool:
        """Gives seq the blocks to hold num_new_tokens more computed tokens, and `lookahead` more
        (proposed tokens a speculative step verifies); False if there are too few.
        The first allocation of a sequence starts it on its cached prefix."""
        first, hits, new, short = self._plan(seq, num_new_tokens, lookahead)
        if short:
            return False
        pool = self.pool
        for b in hits:
            pool.ref(b)
        seq.block_table.extend(hits)
        for _ in range(max(new, 0)):
            seq.block_table.append(pool.take())
        if first:
            cached = len(hits) * self.block_size
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            if self.enable_prefix_caching:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += cached
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publishes the sequence's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full == seq.num_published_blocks:  # nothing new (most decode steps)
            return
        keys = self._block_keys(seq, seq.num_computed_tokens)
        for i in range(seq.num_published_blocks, full):
            self.pool.cache(seq.block_table[i], keys[i])
        seq.num_published_blocks = full

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks past what the sequence's tokens need (those a speculative step took for
        proposed tokens that were rejected). They were taken for this step and never published."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            self.pool.unref(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks; the tail goes to the free queue first since it is the least shared."""
        for bid in reversed(seq.block_table):
            self.pool.unref(bid)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_published_blocks = 0

    def detach(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Hands seq's blocks to another worker. Full cached blocks (and any another sequence here
        still uses) stay here too (both hold them, so they become read-only here); the rest leave
        this engine entirely. Returns (all block ids, the shared ones)."""
        blocks = list(seq.block_table)
        shared = [b for b in blocks if self.pool.hand_over(b)]
        seq.block_table = []
        return blocks, shared

    def adopt(self, seq: Sequence, block_ids: list[int], shared_ids: Iterable[int],
              num_computed_tokens: int, num_cached_tokens: int = 0) -> None:
        """Takes over a sequence whose first num_computed_tokens are in block_ids (computed elsewhere)."""
        shared = set(shared_ids)
        for bid in block_ids:
            self.pool.adopt(bid, bid in shared)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens, seq.num_cached_tokens = num_computed_tokens, num_cached_tokens
