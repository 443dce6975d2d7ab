"""Turns a scheduled batch into tensors, runs the model, samples the next tokens."""

from __future__ import annotations

import torch

from meshserve.kernels.paged_attention import (AttentionMetadata, PrefillChunk, decode_slots_and_mask,
                                               use_decode_kernel)

from .sampler import TokenLogprobs, sample
from .scheduler import ScheduledBatch


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot ids of one sequence's token positions through its block table."""
    return block_table[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []  # flattened index of each sequence's last token, if it samples
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=batch.num_decodes)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, c = len(ids), seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            pos.extend(range(c, c + n))
            bt = seq.block_table
            slot_mapping.extend(bt[p // bs] * bs + p % bs for p in range(c, c + n))
            sample_rows.append(start + n - 1 if c + n == seq.num_tokens else -1)
            if i >= batch.num_decodes:
                slots = None if c == 0 else _slots(torch.tensor(bt), torch.arange(c + n), bs)
                meta.prefills.append(PrefillChunk(start, n, c + n, slots))
        nd = batch.num_decodes
        if nd:
            ctx = [s.num_computed_tokens + 1 for s in batch.seqs[:nd]]
            t = max(ctx)
            nblk = -(-t // bs)
            table = torch.zeros(nd, nblk, dtype=torch.long)
            for i, s in enumerate(batch.seqs[:nd]):
                row = s.block_table[:nblk]
                table[i, :len(row)] = torch.tensor(row)
            meta.decode_block_tables, meta.decode_context_lens, meta.block_size = table, torch.tensor(ctx), bs
            if not use_decode_kernel(self.kv_cache):  # the reference path gathers through slot ids
                meta.decode_slots, meta.decode_mask = decode_slots_and_mask(table, meta.decode_context_lens, bs)
        meta.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long)
        ids_t, pos_t = torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
        device = self.kv_cache.device
        if device.type != "cpu":  # built on the host, then copied to the arena's device
            to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
            ids_t, pos_t, meta.slot_mapping = to(ids_t), to(pos_t), to(meta.slot_mapping)
            for name in ("decode_block_tables", "decode_context_lens", "decode_slots", "decode_mask"):
                if getattr(meta, name) is not None:
                    setattr(meta, name, to(getattr(meta, name)))
            for p in meta.prefills:
                if p.slots is not None:
                    p.slots = to(p.slots)
        return ids_t, pos_t, meta, sample_rows

    def run(self, batch: ScheduledBatch) -> list[tuple[int, TokenLogprobs | None] | None]:
        """The next token of each sequence of the batch (None for a chunk that ends mid-prompt)."""
        ids, pos, meta, rows = self.prepare(batch)
        hidden = self.model(ids, pos, meta, self.kv_cache)
        which = [i for i, r in enumerate(rows) if r >= 0]
        out: list[tuple[int, TokenLogprobs | None] | None] = [None] * len(rows)
        if not which:
            return out
        logits = self.model.logits(hidden[[rows[i] for i in which]])
        seqs = [batch.seqs[i] for i in which]
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for i, t, lp in zip(which, tokens, logprobs):
            out[i] = (t, lp)
        return out
