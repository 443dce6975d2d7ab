"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step takes all running decodes first, then fills the rest of the token budget with
prefill chunks; while decodes run, prompts get at most `max_prefill_tokens_with_decodes` of it,
which bounds the step and so the streams' gaps.

Priorities (interactive 0, normal 1, background 2): waiting sequences sit in one FIFO per level
(`WaitingQueue`); the next admitted is the head with the best effective level, which improves by
one per `priority_aging_s` seconds waited, so no level starves. A running sequence keeps the level
it was admitted at. Prompt chunks go by level: a waiting sequence of a higher priority than a
running prompt gets the budget before it. One that does not fit (blocks or `max_num_seqs`)
preempts running sequences of strictly lower priority, lowest and newest first; a sequence
preempted so `max_priority_preemptions` times is not preempted for priority again. With one
priority in use all this is first-come-first-served, as before.

Siblings (the choices of a request with n > 1, `add(seq, after=first)`) wait outside the queue
until the first one's prompt blocks are computed, then join the head of their level: the prefix
cache gives them those blocks, so the shared prompt is computed once and each sibling computes only
its partial last block. A sequence that wants its prompt's logprobs is admitted without prefix-cache
hits: every position it needs is computed.

Preemption is by recompute: the blocks are freed (their prefix-cache keys survive, so the
sequence often gets them back) and the sequence returns to the head of its level. When blocks
run out for running sequences, the lowest-priority newest one is preempted, and nothing new is
admitted in that step (no thrashing).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import PRIORITIES, Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64  # sequences in one step
    prefill_chunk_size: int = 512  # most prompt tokens one sequence computes in one step
    # Most prompt tokens in a step that also runs decodes: bounds the step, so the running
    # streams' inter-token latency stays low while prompts still progress every step.
    max_prefill_tokens_with_decodes: int = 128
    # A waiting sequence's effective priority improves by one level per this many seconds waited
    # (0: no aging), so a steady stream of higher priorities never starves a lower one.
    priority_aging_s: float = 10.0
    # A sequence preempted this many times to make room for higher priorities is then left alone
    # (out-of-blocks preemption still applies): its recompute cost stays bounded.
    max_priority_preemptions: int = 2


@dataclass
class ScheduledBatch:
    """Sequences of one step, decodes (one new token) first, with how many tokens each computes."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int

    def __len__(self) -> int:
        return len(self.seqs)


class WaitingQueue:
    """Waiting sequences, one FIFO per priority level; a preempted one goes back to the head of its own.

    `peek` gives the head with the best effective level (its level less one per `aging_s` seconds
    since it joined the queue, but never better than `floor`, the best priority present), ties to the
    longer wait. Within a level the order is FIFO, so with one priority in use this is exactly a
    single first-come-first-served queue, however long sequences wait."""

    def __init__(self, aging_s: float, clock):
        self.levels: list[deque[Sequence]] = [deque() for _ in PRIORITIES]
        self.aging_s, self.clock = aging_s, clock
        self.floor = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.levels)

    def __iter__(self):
        return (s for q in self.levels for s in q)

    def append(self, seq: Sequence) -> None:
        seq.queued_at = self.clock()
        self.levels[seq.priority].append(seq)

    def appendleft(self, seq: Sequence) -> None:
        seq.queued_at = self.clock()
        self.levels[seq.priority].appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self.levels[seq.priority].remove(seq)

    def effective_level(self, seq: Sequence, now: float) -> int:
        if self.aging_s <= 0:
            return seq.priority
        return min(seq.priority, max(self.floor, seq.priority - int((now - seq.queued_at) // self.aging_s)))

    def peek(self) -> Sequence | None:
        now = self.clock()
        return min((q[0] for q in self.levels if q), key=lambda s: (self.effective_level(s, now), s.queued_at),
                   default=None)

    def pop(self, seq: Sequence) -> None:
        """Takes seq, the head of its level, out."""
        assert self.levels[seq.priority][0] is seq
        self.levels[seq.priority].popleft()

    def counts(self) -> list[int]:
        return [len(q) for q in self.levels]


@dataclass
class _Step:
    """The batch being built in one schedule() call."""

    budget: int
    scheduled: dict[int, tuple[Sequence, int]] = field(default_factory=dict)  # id -> (seq, tokens)
    preempted: bool = False  # out of blocks: admit nothing more this step
    evicted: set[int] = field(default_factory=set)  # ids preempted in this step: not re-admitted in it

    def add(self, seq: Sequence, n: int) -> None:
        self.scheduled[id(seq)] = (seq, n)
        self.budget -= n

    def drop(self, seq: Sequence) -> None:
        _, n = self.scheduled.pop(id(seq), (seq, 0))
        self.budget += n

    def batch(self) -> ScheduledBatch:
        items = list(self.scheduled.values())
        decodes = [(s, n) for s, n in items if n == 1]
        prefills = [(s, n) for s, n in items if n != 1]
        return ScheduledBatch([s for s, _ in decodes + prefills], [n for _, n in decodes + prefills], len(decodes))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock=time.monotonic):
        self.config, self.kv = config, kv
        self.waiting = WaitingQueue(config.priority_aging_s, clock)
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # siblings waiting for their first one's prompt (add(after=...))
        self.num_preemptions = 0
        self.num_priority_preemptions = 0

    def add(self, seq: Sequence, after: Sequence | None = None) -> None:
        """after: a sequence with the same prompt, added before: seq waits until its prompt is cached."""
        if after is not None and self.kv.enable_prefix_caching and not after.is_finished:
            seq.after = after
            self.held.append(seq)
        else:
            self.waiting.append(seq)

    def _release_held(self) -> None:
        """Queues the siblings whose first one has its prompt's full blocks computed (or left)."""
        ready = []
        for seq in self.held:
            first = seq.after
            gone = first.is_finished or (first.status is SequenceStatus.RUNNING and first not in self.running)
            full = first.num_prompt_tokens // self.kv.block_size * self.kv.block_size
            if gone or first.num_computed_tokens >= full:
                ready.append(seq)
        for seq in reversed(ready):
            self.held.remove(seq)
            seq.after = None
            self.waiting.appendleft(seq)

    def adopt(self, seq: Sequence) -> None:
        """A sequence that arrives with its KV computed elsewhere joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        seq.level = seq.priority
        self.running.append(seq)

    def detach(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Takes a running sequence out, its blocks handed over (KVCacheManager.detach)."""
        self.running.remove(seq)
        return self.kv.detach(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held)

    def blocks_next_step(self, new_prompts: int = 0) -> int:
        """At most how many free blocks the next schedule() takes, if `new_prompts` more prompts are
        queued before it: one per running sequence, plus, when prompts are to be computed, the step's
        token budget in blocks and a partial block per sequence that prefills. What the engine's
        owner keeps free (and uncached) before a step."""
        prefilling = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens > 1) + len(self.waiting)
        prefilling += new_prompts
        if not prefilling:
            return len(self.running)
        cfg = self.config
        return len(self.running) + cfg.max_num_batched_tokens // self.kv.block_size + min(prefilling, cfg.max_num_seqs)

    def _preempt(self, seq: Sequence, step: _Step, for_priority: bool = False) -> None:
        self.running.remove(seq)
        step.drop(seq)
        step.evicted.add(id(seq))
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if for_priority:
            seq.num_priority_preemptions += 1
            self.num_priority_preemptions += 1
        self.waiting.appendleft(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_size)

    def schedule(self) -> ScheduledBatch:
        if self.held:
            self._release_held()
        step = _Step(self.config.max_num_batched_tokens)
        present = [s.priority for s in self.running] + [p for p, q in enumerate(self.waiting.levels) if q]
        self.waiting.floor = min(present, default=0)  # aging never passes the best priority present
        by_level = sorted(self.running, key=lambda s: s.level)  # stable: in order within a level
        # Running decodes first, so a long prefill never stalls them; then the prompts, within a
        # smaller budget while decodes run (it bounds the step, hence the inter-token latency).
        for seq in [s for s in by_level if s.num_tokens - s.num_computed_tokens <= 1]:
            self._run(step, seq)
        if step.scheduled:
            step.budget = min(step.budget, self.config.max_prefill_tokens_with_decodes)
        for seq in [s for s in by_level if s.num_tokens - s.num_computed_tokens > 1]:
            self._admit(step, outranking=seq.level)  # waiting prompts of a higher priority go first
            self._run(step, seq)
        self._admit(step)
        return step.batch()

    def _run(self, step: _Step, seq: Sequence) -> None:
        """Schedules a running sequence, preempting the lowest-priority newest others while blocks are short."""
        if step.budget <= 0 or seq.status is not SequenceStatus.RUNNING or id(seq) in step.scheduled:
            return
        n = self._chunk(seq, step.budget)
        while not self.kv.allocate(seq, n):
            others = [s for s in reversed(self.running) if id(s) not in step.scheduled]
            victim = max(others, key=lambda s: s.level)  # the newest of the lowest priority
            self._preempt(victim, step)
            step.preempted = True
            if victim is seq:
                return
        step.add(seq, n)

    def _admit(self, step: _Step, outranking: int | None = None) -> None:
        """Admits waiting sequences in queue order while the step has room (with `outranking`, only
        those whose priority is higher than that level), making room by priority preemption."""
        while not step.preempted and step.budget > 0 and self.waiting:
            seq = self.waiting.peek()
            if id(seq) in step.evicted or (outranking is not None and seq.priority >= outranking):
                return
            n = self._chunk(seq, step.budget)
            with self._prefix_hits(seq):
                if len(self.running) >= self.config.max_num_seqs or not self.kv.allocate(seq, n):
                    if not self._make_room(seq, n, step):
                        return
            n = min(n, self._chunk(seq, step.budget))  # allocate() may have found a cached prefix
            self.waiting.pop(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            seq.level = self.waiting.effective_level(seq, self.waiting.clock())
            self.running.append(seq)
            step.add(seq, n)

    @contextlib.contextmanager
    def _prefix_hits(self, seq: Sequence):
        """Admission without prefix-cache hits for a sequence that still needs its prompt's logprobs
        (they come from computing the positions); the cache itself is untouched."""
        if not (seq.wants_prompt_logprobs and self.kv.enable_prefix_caching):
            yield
            return
        self.kv.enable_prefix_caching = False
        try:
            yield
        finally:
            self.kv.enable_prefix_caching = True

    def _make_room(self, seq: Sequence, n: int, step: _Step) -> bool:
        """Preempts running sequences of a lower priority than seq (lowest level, newest first) until
        seq gets a seat and its blocks; preempts nobody when that cannot be enough."""
        cands = [s for s in reversed(self.running)
                 if s.level > seq.priority and s.num_priority_preemptions < self.config.max_priority_preemptions]
        cands.sort(key=lambda s: -s.level)  # stable: newest first within a level
        seats = len(self.running) - self.config.max_num_seqs + 1
        short = self.kv.blocks_short(seq, n)
        victims = []
        for v in cands:
            if seats <= 0 and short <= 0:
                break
            victims.append(v)
            seats, short = seats - 1, short - self.kv.num_freeable(v)
        if seats > 0 or short > 0:
            return False
        for v in victims:
            self._preempt(v, step, for_priority=True)
        return self.kv.allocate(seq, n)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.held:
            self.held.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq)
