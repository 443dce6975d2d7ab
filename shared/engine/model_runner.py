"""Turns a scheduled batch into tensors, runs the model, samples the next tokens.

Structured-output masks are computed while the model runs (llguidance's pool, without the GIL);
a prompt chunk whose request wants its prompt's logprobs has logits for every position.
A decode with a proposal (seq.draft, speculative.py) computes 1 + k tokens over its cached
context, as that many decode rows (row j attends to the context and the first j proposed tokens),
with logits at each position for the verifier (rejection_sampler.py), which returns the accepted
tokens and the one after them.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshserve.kernels.paged_attention import (AttentionMetadata, PrefillChunk, decode_slots_and_mask,
                                               use_decode_kernel)
from meshserve.shared.model.lora import LoRABatch

from .rejection_sampler import verify
from .sampler import TokenLogprobs, logprobs_of, sample
from .scheduler import ScheduledBatch

PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at a time (vocab-wide rows are large)


@dataclass
class StepResult:
    """What the step computed for one sequence of the batch."""

    # The new tokens: none for a chunk that ends mid-prompt, one, or (verifying a proposal) the
    # accepted proposed tokens and the target's next one; their logprobs (None: not asked for).
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Logprobs of the prompt tokens after this chunk's positions (the token at position c + 1 ...),
    # when the request asked for them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot ids of one sequence's token positions through its block table."""
    return block_table[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, eos_token_ids: list[int] = (),
                 grammars=None, loras: dict | None = None):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.loras = loras if loras is not None else {}  # the engine's adapters by name (shared/model/lora.py)
        self.eos_token_ids = sorted(eos_token_ids)
        self.grammars = grammars  # constraints.Grammars, when the engine has a tokenizer
        self._masker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []  # flattened index of each sequence's last token, if it samples
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        rows: list[tuple[list[int], int]] = []  # decode rows: (block table, context incl. the row's token)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, c = len(ids), seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            verifying = c + n > seq.num_tokens
            if verifying:  # a decode verifying its proposal: the proposed tokens follow
                ids.extend(seq.draft.tokens)
            pos.extend(range(c, c + n))
            bt = seq.block_table
            slot_mapping.extend(bt[p // bs] * bs + p % bs for p in range(c, c + n))
            sample_rows.append(start + n - 1 if c + n >= seq.num_tokens else -1)
            if i < batch.num_decodes or (verifying and not meta.prefills):
                # A verification is n consecutive decodes of one sequence (row j sees c + 1 + j
                # tokens): the decode kernels' arithmetic, so its tokens are those decoding one at
                # a time computes, and a step of decodes and verifications stays one of decodes.
                rows.extend((bt, c + 1 + j) for j in range(n))
                meta.verify_rows |= n > 1
            else:
                slots = None if c == 0 else _slots(torch.tensor(bt), torch.arange(c + n), bs)
                meta.prefills.append(PrefillChunk(start, n, c + n, slots))
        nd = meta.num_decodes = len(rows)
        if nd:
            ctx = [c for _, c in rows]
            nblk = -(-max(ctx) // bs)
            # Padded with block 0 (any valid id: the kernel reads only the context's blocks); one
            # tensor from nested lists, not one per sequence (a few microseconds each).
            table = torch.tensor([(bt + [0] * nblk)[:nblk] for bt, _ in rows], dtype=torch.long)
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

    def run(self, batch: ScheduledBatch, stop: Callable[[int], bool] | None = None) -> list[StepResult]:
        """What the step computes for each sequence of the batch, in its order. stop: the model's
        (asked between layers; Interrupted propagates, with nothing sampled)."""
        ids, pos, meta, rows = self.prepare(batch)
        spec = {i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if s.draft is not None and s.num_computed_tokens + n > s.num_tokens}
        which = [i for i, r in enumerate(rows) if r >= 0 and i not in spec]
        masks = None
        # Masks depend only on the tokens so far (and, verifying, the proposed ones): computed while
        # the model runs. A proposal has one mask per position, each after the tokens before it.
        now = {i: self.grammars.mask_of(batch.seqs[i]) for i in which if batch.seqs[i].params.constraint is not None}
        constrained = [i for i in which if now.get(i) is not None]  # not while it is reasoning
        ahead = {i: self.grammars.lookahead(batch.seqs[i], batch.seqs[i].draft.tokens) for i in sorted(spec)
                 if batch.seqs[i].params.constraint is not None}
        if constrained or ahead:
            masks = self._masker.submit(self.grammars.fill, [now[i] for i in constrained]
                                        + [m for ms in ahead.values() for m in ms])
        adapters = [self.loras[s.lora] if s.lora else None for s in batch.seqs]
        lora = LoRABatch.of(list(zip(adapters, batch.num_tokens)), ids.device)  # None: no row has an adapter
        extra = {k: v for k, v in (("lora", lora), ("stop", stop)) if v is not None}
        hidden = self.model(ids, pos, meta, self.kv_cache, **extra)
        out = [StepResult() for _ in rows]
        start = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.wants_prompt_logprobs:
                out[i].prompt_logprobs = self._prompt_logprobs(hidden, start, n, seq)
            start += n
        if not which and not spec:
            return out
        # One logits row per sampling sequence's last position, then every position of each proposal.
        idx = [rows[i] for i in which]
        for i in sorted(spec):
            n = batch.num_tokens[i]
            idx += range(rows[i] - n + 1, rows[i] + 1)
        # A run of consecutive rows (every decode-only step) as a view: indexing by a list copies (~30 us).
        rows_of = slice(idx[0], idx[-1] + 1) if idx == list(range(idx[0], idx[0] + len(idx))) else idx
        logits = self.model.logits(hidden[rows_of])
        allowed = masks.result() if masks is not None else None
        if which:
            row_masks = None
            if constrained:  # rows of the logits (which) that are constrained, and their masks
                row_masks = ([which.index(i) for i in constrained], allowed[:len(constrained)])
            tokens, logprobs = sample(logits[:len(which)], [batch.seqs[i] for i in which], self.eos_token_ids,
                                      row_masks)
            for i, t, lp in zip(which, tokens, logprobs):
                out[i].tokens, out[i].logprobs = [t], [lp]
        r, m = len(which), len(constrained)
        for i in sorted(spec):
            n = batch.num_tokens[i]
            pos_masks = None
            if i in ahead:
                pos_masks, m = allowed[m:m + n], m + n
            out[i].tokens, out[i].logprobs = verify(logits[r:r + n], batch.seqs[i], self.eos_token_ids, pos_masks)
            r += n
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int, n: int, seq) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens that this step's positions of seq predict (position p:
        token p + 1); its tokens are hidden[start:start + n], from position num_computed_tokens."""
        first = seq.num_computed_tokens
        end = min(first + n, seq.num_prompt_tokens - 1)  # the last prompt position predicts the output
        out: list[TokenLogprobs] = []
        k = seq.params.prompt_logprobs
        for lo in range(first, end, PROMPT_LOGITS_ROWS):
            hi = min(end, lo + PROMPT_LOGITS_ROWS)
            rows = torch.arange(start + lo - first, start + hi - first, device=hidden.device)
            logits = self.model.logits(hidden[rows])
            targets = seq.token_ids[lo + 1:hi + 1]
            out += logprobs_of(logits, targets, [k] * len(targets), ranks=True)
        return out
