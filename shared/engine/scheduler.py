"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step takes all running decodes first, then fills the rest of the token budget with
prefill chunks (running ones, then waiting ones in arrival order); while decodes run, prompts get
at most `max_prefill_tokens_with_decodes` of it, which bounds the step and so the streams' gaps.
When blocks run out, the newest running sequence is preempted by recompute: its blocks are freed (their prefix-cache
keys survive, so it often gets them back) and it returns to the head of the queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64  # sequences in one step
    prefill_chunk_size: int = 512  # most prompt tokens one sequence computes in one step
    # Most prompt tokens in a step that also runs decodes: bounds the step, so the running
    # streams' inter-token latency stays low while prompts still progress every step.
    max_prefill_tokens_with_decodes: int = 128


@dataclass
class ScheduledBatch:
    """Sequences of one step, decodes (one new token) first, with how many tokens each computes."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config, self.bm = config, block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """A sequence that arrives with its KV computed elsewhere joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_size)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[tuple[Sequence, int]] = []
        scheduled: set[int] = set()
        preempted = False

        def run(seq: Sequence) -> None:
            """Schedules a running sequence, preempting the newest others while blocks are short."""
            nonlocal budget, preempted
            if budget <= 0 or seq.status is not SequenceStatus.RUNNING:
                return
            n = self._chunk(seq, budget)
            while not self.bm.allocate(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return
            scheduled.add(id(seq))
            budget -= n
            (decodes.append(seq) if n == 1 else prefills.append((seq, n)))

        # Running decodes first, so a long prefill never stalls them; then the prompts, within a
        # smaller budget while decodes run (it bounds the step, hence the inter-token latency).
        in_prefill = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens <= 1]:
            run(seq)
        if decodes:
            budget = min(budget, self.config.max_prefill_tokens_with_decodes)
        for seq in in_prefill:
            run(seq)
        # Waiting sequences, in order, while they fit (none after a preemption: no thrashing).
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            if not self.bm.allocate(seq, n):
                break
            n = self._chunk(seq, budget)  # allocate() may have found a cached prefix
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= n
            (decodes.append(seq) if n == 1 else prefills.append((seq, n)))
        seqs = decodes + [s for s, _ in prefills]
        return ScheduledBatch(seqs, [1] * len(decodes) + [n for _, n in prefills], len(decodes))

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free_seq(seq)
