"""Draft-model proposals: a smaller model with the same tokenizer proposes k tokens, one forward
pass each, batched over the sequences; the target verifies them in one step.

The draft keeps its own small paged KV cache (its own BlockPool and KVCacheManager, no prefix
cache) in the engine's process, and a mirror of each sequence: the same tokens, its own block
table. Before proposing, a mirror catches up with its sequence: its KV stays valid up to the
first token where the two differ (the proposed tokens the target rejected), and it computes the
rest. A sequence new to the draft (just adopted, or resumed) computes its whole context there
once. Mirrors whose sequences left the engine are freed (retain).

A greedy request's draft proposes argmax tokens; a sampled one draws from the draft's filtered
distribution (temperature, top-k/p, min-p; no logits processors) and reports it, for the
rejection rule (rejection_sampler.py).
"""

from __future__ import annotations

import torch

from meshserve.shared.kv_layout import kv_arena_shape

from .block_pool import BlockPool
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner
from .sampler import _filter
from .scheduler import ScheduledBatch
from .sequence import Draft, Sequence


class DraftModelProposer:
    def __init__(self, model, num_blocks: int = 512, block_size: int = 16):
        cfg = model.cfg
        kv = torch.zeros(kv_arena_shape(cfg, num_blocks, block_size), dtype=model.dtype,
                         device=getattr(model, "device", None))
        self.model = model
        self.kv = KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, kv, block_size)
        self.mirrors: dict[str, Sequence] = {}
        self.synced: dict[str, int] = {}  # request id -> tokens its mirror shared with it after the last sync

    def retain(self, request_ids) -> None:
        """Frees the mirrors of sequences no longer in the engine (finished, aborted, handed off)."""
        for rid in [r for r in self.mirrors if r not in request_ids]:
            self.kv.free(self.mirrors.pop(rid))
            self.synced.pop(rid, None)

    def _sync(self, seq: Sequence) -> Sequence:
        m = self.mirrors.get(seq.request_id)
        if m is None:
            m = self.mirrors[seq.request_id] = Sequence(seq.request_id, seq.prompt_token_ids, seq.params,
                                                        cache_salt=seq.cache_salt)
            self.synced[seq.request_id] = 0
        same = min(self.synced[seq.request_id], m.num_tokens, seq.num_tokens)
        while same < min(m.num_tokens, seq.num_tokens) and m.token_ids[same] == seq.token_ids[same]:
            same += 1
        m.token_ids = list(seq.token_ids)
        m.num_computed_tokens = min(m.num_computed_tokens, same, seq.num_tokens - 1)
        m.num_published_blocks = 0
        self.kv.trim(m)
        m.params = seq.params
        self.synced[seq.request_id] = seq.num_tokens
        return m

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]:
        mirrors, out = [], [None] * len(seqs)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            m = self._sync(seq)
            if self.kv.allocate(m, m.num_tokens - m.num_computed_tokens, lookahead=k):
                mirrors.append((i, m, k, seq.generator))
            else:  # the draft's cache is full: this one decodes without a proposal, and starts over later
                self.kv.free(m)
                del self.mirrors[seq.request_id]
        drafts = {i: ([], []) for i, *_ in mirrors}
        live = mirrors
        with torch.inference_mode():
            while live:
                tokens = self._step([m for _, m, _, _ in live], [g for *_, g in live])
                still = []
                for (i, m, k, g), (t, q) in zip(live, tokens):
                    drafts[i][0].append(t)
                    drafts[i][1].append(q)
                    m.token_ids.append(t)
                    if len(drafts[i][0]) < k:
                        still.append((i, m, k, g))
                live = still
        for i, (toks, qs) in drafts.items():
            out[i] = Draft(toks, None if qs[0] is None else torch.stack(qs))
        return out

    def _step(self, mirrors: list[Sequence], generators: list) -> list[tuple[int, torch.Tensor | None]]:
        """One draft forward pass: each mirror computes its uncomputed tokens and draws the next."""
        order = sorted(range(len(mirrors)), key=lambda j: mirrors[j].num_tokens - mirrors[j].num_computed_tokens > 1)
        seqs = [mirrors[j] for j in order]
        nums = [s.num_tokens - s.num_computed_tokens for s in seqs]
        batch = ScheduledBatch(seqs, nums, sum(1 for n in nums if n == 1))
        ids, pos, meta, rows = self.runner.prepare(batch)
        hidden = self.model(ids, pos, meta, self.runner.kv_cache)
        logits = self.model.logits(hidden[rows]).float()
        out: list = [None] * len(mirrors)
        for r, (j, s, n) in enumerate(zip(order, seqs, nums)):
            s.num_computed_tokens += n
            if s.params.greedy:
                out[j] = (int(logits[r].argmax()), None)
                continue
            g = generators[j]
            row = logits[r] if g is None else logits[r].to(g.device)
            q = _filter(row, s.params).softmax(-1)
            noise = torch.empty_like(q).exponential_(generator=g)
            out[j] = (int((q / noise).argmax()), q)
        return out
