"""Preemption by swap: a preempted sequence's KV blocks go to host memory and come back into fresh
blocks when it resumes, so it continues without recomputing anything.

Blocks are named by keys: a full block by its chained prefix-cache hash (the same key names the
same tokens anywhere), the partial last block by a hash of its tokens salted apart from those. The
scheduler plans the copies (`ScheduledBatch.swap_out` / `swap_in`); the engine runs them before the
step's model run, swap-outs first (their blocks may be reused in the same step). A swapper is:

    available(num_blocks) -> bool          room for that many blocks
    swap_out(block_ids, keys) -> bool      copy the blocks out under their keys
    swap_in(block_ids, keys) -> int        copy back the leading keys found; how many
    discard(keys)                          the sequence will not resume (finished, aborted)
    block_bytes                            bytes of one block

`HostSwap` is the in-process engine's (a host buffer per swapped block); in the mesh the worker
plugs in the kv-pool's host tier (services/worker/preemption.py), block ids only on the bus. A
swap-in that finds fewer blocks than it asked for is not an error: the sequence recomputes the rest.
"""

from __future__ import annotations

import torch

from meshserve.shared.prefix_hash import block_hash


def swap_keys(token_ids: list[int], num_tokens: int, block_size: int, model: str) -> list[int]:
    """Keys of the blocks holding the first num_tokens tokens."""
    keys: list[int] = []
    for i in range(0, num_tokens, block_size):
        full = i + block_size <= num_tokens
        parent = keys[-1] if keys else None
        keys.append(block_hash(parent, token_ids[i:min(i + block_size, num_tokens)], model if full else
                               model + "#partial"))
    return keys


class HostSwap:
    """Host memory for the in-process engine's swapped blocks: at most capacity_bytes of them.
    On a GPU the buffers are pinned, so the copies run at the bus's speed."""

    def __init__(self, kv_cache: torch.Tensor, block_size: int, capacity_bytes: int):
        self.kv, self.block_size = kv_cache, block_size
        per_slot = kv_cache[:, :, :1].numel() * kv_cache.element_size()
        self.block_bytes = per_slot * block_size
        self.capacity = capacity_bytes // self.block_bytes
        self.store: dict[int, list] = {}  # key -> [block's bytes, sequences that will want it back]

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        bs = self.block_size
        idx = torch.arange(bs).repeat(len(block_ids)) + torch.tensor(block_ids).repeat_interleave(bs) * bs
        return idx.to(self.kv.device)

    def available(self, num_blocks: int) -> bool:
        return len(self.store) + num_blocks <= self.capacity

    def swap_out(self, block_ids: list[int], keys: list[int]) -> bool:
        if not self.available(len(block_ids)):
            return False
        data = self.kv.index_select(2, self._slots(block_ids))
        if self.kv.is_cuda:
            data = data.to("cpu", non_blocking=False).pin_memory()
        bs = self.block_size
        for i, k in enumerate(keys):  # two sequences may share a prefix: the same key, kept once
            entry = self.store.setdefault(k, [data[:, :, i * bs:(i + 1) * bs], 0])
            entry[1] += 1
        return True

    def swap_in(self, block_ids: list[int], keys: list[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        if n:
            data = torch.cat([self.store[k][0] for k in keys[:n]], dim=2)
            self.kv.index_copy_(2, self._slots(block_ids[:n]), data.to(self.kv.device))
        self.discard(keys)
        return n

    def discard(self, keys: list[int]) -> None:
        for k in keys:
            entry = self.store.get(k)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self.store[k]
