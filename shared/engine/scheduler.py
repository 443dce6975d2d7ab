"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Every step takes all running decodes first, then fills the rest of the token budget with
prefill chunks; while decodes run, prompts get at most `max_prefill_tokens_with_decodes` of it,
which bounds the step and so the streams' gaps.

The order and the preemptions follow the policy (policy.py: classes interactive / normal /
background with their guarantees, shorter prompts first within a class, victims by score; or
plain first-come-first-served with `policy="fcfs"`). Prompt chunks go by rank: a waiting prompt
that outranks a running one gets the budget before it. One that does not fit (blocks or
`max_num_seqs`) preempts running sequences the policy lets it preempt, best victims first, and
only when that frees enough. When blocks run out for running sequences, the best victim among the
others is preempted, and nothing new is admitted in that step (no thrashing).

Siblings (the choices of a request with n > 1, `add(seq, after=first)`) wait outside the queue
until the first one's prompt blocks are computed, then join the head of their level: the prefix
cache gives them those blocks, so the shared prompt is computed once and each sibling computes only
its partial last block. A sequence that wants its prompt's logprobs is admitted without prefix-cache
hits: every position it needs is computed.

A preemption is by swap or by recompute (`preemption_mode`; "auto" compares their measured costs,
policy.PreemptionCosts). Recompute frees the blocks (their prefix-cache keys survive, so the
sequence often gets them back) and prefills prompt + generated tokens again; swap copies the
blocks to host memory (swap.py) and back into fresh blocks when the sequence resumes. Either way
the sequence continues exactly where it was (its seeded generator is its own).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .kv_cache_manager import KVCacheManager
from .policy import INTERACTIVE, NORMAL, OVERTAKE_FACTOR, PRIORITIES, Policy, PreemptionCosts
from .sequence import Sequence, SequenceStatus
from .swap import swap_keys


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64  # sequences in one step
    prefill_chunk_size: int = 512  # most prompt tokens one sequence computes in one step
    # Most prompt tokens in a step that also runs decodes: bounds the step, so the running
    # streams' inter-token latency stays low while prompts still progress every step.
    max_prefill_tokens_with_decodes: int = 128
    policy: str = "priority"  # or "fcfs": one first-come-first-served queue (policy.py)
    min_normal_share: float = 0.2  # of the output tokens, guaranteed to normal while it has work
    share_window_tokens: int = 1024  # the shares are over about this many recent output tokens
    min_run_s: float = 0.5  # a sequence resumed from a preemption is not preempted again sooner
    short_first: bool = True  # within a class, shorter remaining prompts first
    # ... until later arrivals whose prompts add up to this many times its own went first (policy.py)
    overtake_factor: float = OVERTAKE_FACTOR
    preemption_mode: str = "auto"  # "swap", "recompute", or "auto": the cheaper by measured costs
    # While an interactive request is here or came less than interactive_guard_s ago, the other
    # prompts get at most this many tokens of a step between them: the next interactive prompt
    # never waits behind a long chunk of a batch prompt (the step in progress bounds its wait).
    max_prefill_tokens_near_interactive: int = 32
    interactive_guard_s: float = 5.0


class SwapOp(NamedTuple):
    """A copy of a sequence's blocks to host memory or back; `start`: the token the first block begins at."""

    seq: Sequence
    block_ids: list[int]
    keys: list[int]
    start: int


@dataclass
class ScheduledBatch:
    """Sequences of one step, decodes (one new token) first, then decodes verifying a proposal
    (1 + k tokens), then prompt chunks, with how many tokens each computes; and the KV copies to
    run before it, out to host memory first, then in."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int
    swap_out: list[SwapOp] = field(default_factory=list)
    swap_in: list[SwapOp] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class WaitingQueue:
    """Waiting sequences in the policy's order (`Policy.waiting_key`): arrival order within a rank,
    a preempted sequence back at the head of its class. With fcfs, one first-come-first-served queue."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.seqs: list[Sequence] = []
        self._next = 0  # arrival order
        self._head = 0  # preempted sequences: before every arrival, the latest first

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self):
        return iter(self.seqs)

    def append(self, seq: Sequence) -> None:
        seq.queue_order, self._next = self._next, self._next + 1
        self.seqs.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._head -= 1
        seq.queue_order = self._head
        self.seqs.append(seq)

    def remove(self, seq: Sequence) -> None:
        self.seqs.remove(seq)

    def peek(self) -> Sequence | None:
        return min(self.seqs, key=self.policy.waiting_key, default=None)

    def pop(self, seq: Sequence) -> None:
        self.seqs.remove(seq)

    def counts(self) -> list[int]:
        return [sum(s.priority == p for s in self.seqs) for p in range(len(PRIORITIES))]


@dataclass
class _Step:
    """The batch being built in one schedule() call."""

    budget: int
    scheduled: dict[int, tuple[Sequence, int]] = field(default_factory=dict)  # id -> (seq, tokens)
    preempted: bool = False  # out of blocks: admit nothing more this step
    evicted: set[int] = field(default_factory=set)  # ids preempted in this step: not re-admitted in it
    swap_out: list = field(default_factory=list)
    swap_in: list = field(default_factory=list)
    # What is left for prompts that are not interactive (None: no cap); none once an interactive
    # prompt is in the step: its first token does not wait for a batch chunk computed beside it.
    guard: int | None = None

    def room(self, seq: Sequence) -> int:
        """Tokens seq may still take in this step."""
        return self.budget if self.guard is None or seq.priority == INTERACTIVE else min(self.budget, self.guard)

    def add(self, seq: Sequence, n: int) -> None:
        if self.guard is not None:
            if seq.priority != INTERACTIVE:
                self.guard -= n
            elif seq.num_tokens - seq.num_computed_tokens > 1:
                self.guard = 0
        self.scheduled[id(seq)] = (seq, n)
        self.budget -= n

    def drop(self, seq: Sequence) -> None:
        _, n = self.scheduled.pop(id(seq), (seq, 0))
        self.budget += n

    def batch(self) -> ScheduledBatch:
        items = list(self.scheduled.values())
        decodes = [(s, n) for s, n in items if n == 1]
        verifying = [(s, n) for s, n in items if n != 1 and s.num_computed_tokens + n > s.num_tokens]
        prompts = [(s, n) for s, n in items if n != 1 and s.num_computed_tokens + n <= s.num_tokens]
        order = decodes + verifying + prompts
        return ScheduledBatch([s for s, _ in order], [n for _, n in order], len(decodes), self.swap_out, self.swap_in)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock=time.monotonic):
        if config.policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling policy must be 'priority' or 'fcfs', not {config.policy!r}")
        if config.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption mode must be auto, swap or recompute, not {config.preemption_mode!r}")
        self.config, self.kv, self.clock = config, kv, clock
        self.policy = Policy(config, lambda: self.clock())
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # siblings waiting for their first one's prompt (add(after=...))
        self.costs = PreemptionCosts()
        self.swapper = None  # where swapped KV goes (swap.py); None: recompute only
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.preemptions_by_mode = {"swap": 0, "recompute": 0}
        self.last_interactive = float("-inf")  # when an interactive request last came (the clock's time)
        self.max_draft_tokens = 0  # speculative decoding: most proposed tokens a decode may verify

    def add(self, seq: Sequence, after: Sequence | None = None) -> None:
        """after: a sequence with the same prompt, added before: seq waits until its prompt is cached."""
        if seq.priority == INTERACTIVE:
            self.last_interactive = self.clock()
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

    def _sequences(self):
        yield from self.running
        yield from self.waiting
        yield from self.held

    def top_class(self) -> int | None:
        """The best class (lowest level) among its sequences, which its next step includes (the
        policy serves the best class first); None: nothing to run."""
        return min((s.priority for s in self._sequences()), default=None)

    def has_prompt_work(self, level: int) -> bool:
        """A sequence of class `level` waiting, or running with prompt tokens still to compute
        (not one that only decodes)."""
        return any(s.priority == level and (s.status is not SequenceStatus.RUNNING
                                            or s.num_tokens - s.num_computed_tokens > 1)
                   for s in self._sequences())

    def blocks_next_step(self, new_prompts: int = 0) -> int:
        """At most how many free blocks the next schedule() takes, if `new_prompts` more prompts are
        queued before it: one per running sequence, plus, when prompts are to be computed, the step's
        token budget in blocks and a partial block per sequence that prefills, plus the blocks of the
        swapped-out sequences that may resume (their KV comes back into fresh blocks). What the
        engine's owner keeps free (and uncached) before a step."""
        prefilling = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens > 1) + len(self.waiting)
        prefilling += new_prompts
        # A decode that verifies proposed tokens takes blocks for them too.
        per_seq = 1 + (self.kv.blocks_needed(self.max_draft_tokens) if self.max_draft_tokens else 0)
        if not prefilling:
            return per_seq * len(self.running)
        cfg = self.config
        swapped = sum(len(s.swap_keys) for s in self.waiting if s.swapped_tokens)
        return (per_seq * len(self.running) + cfg.max_num_batched_tokens // self.kv.block_size
                + min(prefilling, cfg.max_num_seqs) + swapped)

    # -- preemption

    def _mode(self, seq: Sequence) -> str:
        k = seq.num_computed_tokens
        nblocks = self.kv.blocks_needed(k)
        sw = self.swapper
        can_swap = sw is not None and sw.available(nblocks)
        return self.costs.choose(self.config.preemption_mode, nblocks * (sw.block_bytes if sw else 0), k, can_swap)

    def _preempt(self, seq: Sequence, step: _Step, for_priority: bool = False) -> None:
        mode = self._mode(seq)
        self.running.remove(seq)
        step.drop(seq)
        step.evicted.add(id(seq))
        if mode == "swap":  # the blocks' bytes are copied out before the step reuses them
            k = seq.num_computed_tokens
            seq.swap_keys = swap_keys(seq.token_ids, k, self.kv.block_size, self.kv.namespace(seq))
            seq.swapped_tokens = k
            step.swap_out.append(SwapOp(seq, seq.block_table[:len(seq.swap_keys)], seq.swap_keys, 0))
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_mode[mode] += 1
        if for_priority:
            seq.num_priority_preemptions += 1
            self.num_priority_preemptions += 1
        self.waiting.appendleft(seq)

    def swap_failed(self, seq: Sequence) -> None:
        """The engine could not copy seq's blocks out: it will recompute them instead."""
        seq.swapped_tokens, seq.swap_keys = 0, []
        self.preemptions_by_mode["swap"] -= 1
        self.preemptions_by_mode["recompute"] += 1

    # -- one step

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_size)

    def schedule(self) -> ScheduledBatch:
        if self.held:
            self._release_held()
        step = _Step(self.config.max_num_batched_tokens)
        pol = self.policy
        pol.refresh(any(s.priority == NORMAL for s in self.running) or any(s.priority == NORMAL for s in self.waiting))
        by_rank = sorted(self.running, key=pol.rank)  # stable: in order within a rank
        # Running decodes first, so a long prefill never stalls them; then the prompts, within a
        # smaller budget while decodes run (it bounds the step, hence the inter-token latency).
        for seq in [s for s in by_rank if s.num_tokens - s.num_computed_tokens <= 1]:
            self._run(step, seq)
        if step.scheduled:
            step.budget = min(step.budget, self.config.max_prefill_tokens_with_decodes)
        if not pol.fcfs and self._interactive_near():
            step.guard = self.config.max_prefill_tokens_near_interactive
        for seq in [s for s in by_rank if s.num_tokens - s.num_computed_tokens > 1]:
            self._admit(step, before=seq)  # waiting prompts that outrank it go first
            self._run(step, seq)
        self._admit(step)
        produced = [0] * len(PRIORITIES)  # a sequence whose chunk reaches its end samples a token
        for seq, n in step.scheduled.values():
            if seq.num_computed_tokens + n >= seq.num_tokens:
                produced[seq.priority] += 1
        pol.shares.record(produced)
        return step.batch()

    def step_ended_early(self) -> None:
        """The last scheduled step was interrupted before sampling: it produced no output tokens,
        so the classes' output shares forget it (it is scheduled again)."""
        self.policy.shares.take_back()

    def saw_interactive(self) -> None:
        """An interactive request came elsewhere on this node (another worker claims the cores for
        its prompt): the next one may come here, so prompts of the other classes keep to small
        chunks here too (the guard), as if it had come here."""
        self.last_interactive = self.clock()

    def _interactive_near(self) -> bool:
        return (self.clock() - self.last_interactive < self.config.interactive_guard_s
                or any(s.priority == INTERACTIVE for s in self.running))

    def _victim(self, others: list[Sequence]) -> Sequence:
        """Out of blocks: fcfs preempts the newest; priority the best-scored, unprotected if it can."""
        if self.policy.fcfs:
            return others[-1]
        pool = [s for s in others if not self.policy.protected(s)] or others
        return max(pool, key=lambda s: self.policy.victim_score(s, self.kv.pool.num_blocks))

    def _run(self, step: _Step, seq: Sequence) -> None:
        """Schedules a running sequence, preempting others while blocks are short."""
        if step.room(seq) <= 0 or seq.status is not SequenceStatus.RUNNING or id(seq) in step.scheduled:
            return
        n = self._chunk(seq, step.room(seq))
        if seq.draft is not None and not self._verify(step, seq):
            seq.draft = None
        if seq.draft is not None:  # blocks for the proposed tokens too: they are computed in this step
            step.add(seq, 1 + len(seq.draft.tokens))
            return
        while not self.kv.allocate(seq, n):
            victim = self._victim([s for s in self.running if id(s) not in step.scheduled])
            self._preempt(victim, step)
            step.preempted = True
            if victim is seq:
                return
        step.add(seq, n)

    def _verify(self, step: _Step, seq: Sequence) -> bool:
        """A decoding sequence with a proposal: it verifies what of it fits the step's budget and the
        free blocks (without preempting anyone for it); False: it decodes one token as usual."""
        k = min(len(seq.draft.tokens), step.room(seq) - 1)
        if k <= 0 or seq.num_tokens - seq.num_computed_tokens != 1:
            return False
        seq.draft = seq.draft.truncate(k)
        return self.kv.allocate(seq, 1, lookahead=k)

    def _admit(self, step: _Step, before: Sequence | None = None) -> None:
        """Admits waiting sequences in the policy's order while the step has room (with `before`, a
        running prompt, only those that outrank it), making room by priority preemption."""
        while not step.preempted and step.budget > 0 and self.waiting:
            seq = self.waiting.peek()
            if (id(seq) in step.evicted or step.room(seq) <= 0
                    or (before is not None and not self.policy.outranks(seq, before))):
                return
            k = seq.swapped_tokens  # swapped out: k computed tokens wait in host memory
            n, cached = min(seq.num_tokens - k, step.room(seq), self.config.prefill_chunk_size), seq.num_cached_tokens
            with self._prefix_hits(seq):
                if len(self.running) >= self.config.max_num_seqs or not self.kv.allocate(seq, k + n):
                    if not self._make_room(seq, k + n, step):
                        return
            if k:
                seq.num_cached_tokens = cached  # what its prompt found cached the first time
                self._plan_swap_in(seq, step)
            n = min(n, self._chunk(seq, step.room(seq)))  # allocate() may have found a cached prefix
            self.waiting.pop(seq)
            self.policy.overtook(seq, list(self.waiting) + ([before] if before is not None else []))
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            if seq.num_preemptions:
                seq.resumed_at = self.clock()
            seq.status = SequenceStatus.RUNNING
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

    def _plan_swap_in(self, seq: Sequence, step: _Step) -> None:
        """seq's blocks are allocated: the leading ones the prefix cache still had are used as they
        are, the rest are copied back from host memory before the step."""
        k, keys, bs = seq.swapped_tokens, seq.swap_keys, self.kv.block_size
        hit = min(seq.num_computed_tokens // bs, len(keys))
        self.swapper.discard(keys[:hit])
        if seq.num_computed_tokens < k:
            step.swap_in.append(SwapOp(seq, seq.block_table[hit:len(keys)], keys[hit:], hit * bs))
            seq.num_computed_tokens = k
        seq.swapped_tokens, seq.swap_keys = 0, []

    def _make_room(self, seq: Sequence, n: int, step: _Step) -> bool:
        """Preempts running sequences the policy lets seq preempt (best victims first) until seq
        gets a seat and its blocks; preempts nobody when that cannot be enough."""
        cands = [s for s in self.running if self.policy.may_preempt(s, seq)]
        cands.sort(key=lambda s: -self.policy.victim_score(s, self.kv.pool.num_blocks))
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
            if seq.swap_keys and self.swapper is not None:  # swapped out, never to resume
                self.swapper.discard(seq.swap_keys)
            seq.swapped_tokens, seq.swap_keys = 0, []
        self.kv.free(seq)
