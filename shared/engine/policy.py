"""Scheduling policy: which request goes first, which running sequence is preempted, and what a
preemption costs. Pure Python (no torch): the engine's scheduler and the mesh scheduler use the
same rules.

Classes (a request's `priority`):
- L1 `interactive`: time to first token first. A waiting L1 request that lacks a seat or KV blocks
  preempts running L2/L3 sequences at the next iteration boundary.
- L2 `normal`: guaranteed `min_normal_share` of the output tokens (about the last
  `share_window_tokens` of them) while it has work: below that share it ranks ahead of L1, takes
  seats first and may preempt L1/L3 sequences (never an L1 one still waiting for its first token),
  so a steady L1 stream cannot starve it.
- L3 `background`: runs on what L1 and L2 leave idle and is the first victim; it finishes once
  their load drops.
No class ever ages into another (that erased priorities: an old background batch outranked every
new interactive request).

Within a class, shorter remaining prompts go first (FIFO within a size bucket, one bucket per
doubling above 64 tokens): a long prompt does not hold up the short ones behind it. A request
overtaken by later arrivals of its class whose prompts add up to `overtake_factor` times its own
(`overtaken_enough`) ranks as the shortest, so the wait that overtaking adds to it is bounded by
about that many times its own prefill: a stretch bound, not a count. (A count of 16 overtakes
promoted every long prompt within seconds under a steady stream of short ones, and the promoted
ones, FIFO at the head, put the short ones back behind them: first come, first served again.) A
preempted sequence goes back to the head of its class.

Victims: only sequences of a strictly lower rank, never one that resumed from a preemption less
than `min_run_s` ago; among them the highest `victim_score` (class first, then the least progress
and the most blocks held).

`fcfs` is the baseline: one first-come-first-served queue, priorities ignored, no preemption for
priority (out of blocks, the newest running sequence is preempted).
"""

from __future__ import annotations

from meshserve.shared.limits import NORMAL, PRIORITIES  # noqa: F401 - L1, L2, L3; a lower level is served first

INTERACTIVE, BACKGROUND = PRIORITIES.index("interactive"), PRIORITIES.index("background")
POLICIES = ("priority", "fcfs")
PREEMPTION_MODES = ("auto", "swap", "recompute")


def size_bucket(tokens: int) -> int:
    """0 up to 64 tokens, then one more per doubling: prompts of about the same size stay FIFO."""
    return ((max(1, tokens) - 1) // 64).bit_length()


OVERTAKE_FACTOR = 16.0  # the default of SchedulerConfig.overtake_factor and the mesh scheduler's queues


def overtaken_enough(overtaken_tokens: float, tokens: int, factor: float = OVERTAKE_FACTOR) -> bool:
    """Overtaken by `factor` times its own prompt tokens (plus one bucket, so a tiny prompt is not
    promoted by the first overtake): from now on it ranks as the shortest of its class."""
    return overtaken_tokens >= factor * (max(1, tokens) + 64)


class ClassShares:
    """Each class's share of about the last `window` output tokens (exponentially decayed counts)."""

    def __init__(self, window: int):
        self.decay = 1.0 - 1.0 / max(1, window)
        self.tokens = [0.0] * len(PRIORITIES)
        self._last: tuple[float, list[int]] | None = None

    def record(self, produced: list[int]) -> None:
        f = self.decay ** sum(produced)
        self.tokens = [t * f + p for t, p in zip(self.tokens, produced)]
        self._last = (f, produced)

    def take_back(self) -> None:
        """Undoes the last record: its step ended early (LLMEngine.urgent) and produced nothing."""
        last, self._last = self._last, None
        if last is not None:
            f, produced = last
            self.tokens = [(t - p) / f for t, p in zip(self.tokens, produced)]

    def share(self, level: int) -> float:
        total = sum(self.tokens)
        return self.tokens[level] / total if total > 0 else 0.0


class Policy:
    """The ranks the scheduler compares. A rank is (class rank, size rank); lower goes first.

    Sequences are read through their fields: priority, num_tokens, num_computed_tokens,
    num_prompt_tokens, params.max_tokens, block_table, num_preemptions, resumed_at, overtaken_tokens,
    queue_order and swapped_tokens."""

    def __init__(self, config, clock):
        self.cfg, self.clock = config, clock
        self.fcfs = config.policy == "fcfs"
        self.shares = ClassShares(config.share_window_tokens)
        self.normal_behind = False  # normal has work and is below its share: it ranks first

    def refresh(self, normal_has_work: bool) -> None:
        """Once per step, before ranking anything."""
        self.normal_behind = (not self.fcfs and normal_has_work
                              and self.shares.share(NORMAL) < self.cfg.min_normal_share)

    def class_rank(self, seq) -> int:
        if self.fcfs:
            return 0
        if seq.priority == NORMAL and self.normal_behind:
            return -1
        return seq.priority

    def size_rank(self, seq) -> int:
        if self.fcfs or not self.cfg.short_first:
            return 0
        if seq.num_preemptions:
            return -1  # preempted, waiting or recomputing what it lost: the head of its class
        remaining = seq.num_tokens - max(seq.num_computed_tokens, seq.swapped_tokens)
        if overtaken_enough(seq.overtaken_tokens, remaining, self.cfg.overtake_factor):
            return 0
        return size_bucket(remaining)

    def rank(self, seq) -> tuple[int, int]:
        return self.class_rank(seq), self.size_rank(seq)

    def waiting_key(self, seq) -> tuple[int, int, int]:
        """Order of the waiting queue (queue_order: arrival order, preempted ones before)."""
        return (*self.rank(seq), seq.queue_order) if not self.fcfs else (0, 0, seq.queue_order)

    def outranks(self, waiting_seq, running_seq) -> bool:
        """Whether a waiting prompt gets the step's budget before a running prompt."""
        return self.rank(waiting_seq) < self.rank(running_seq)

    def overtook(self, admitted, others) -> None:
        """`admitted` went ahead of `others` (of any class): those of its class that came first count
        its prompt tokens as overtaking them."""
        if self.fcfs:
            return
        work = max(1, admitted.num_tokens - admitted.num_computed_tokens)
        for s in others:
            if s is not admitted and s.priority == admitted.priority and s.queue_order < admitted.queue_order:
                s.overtaken_tokens += work

    # -- victims

    def protected(self, seq) -> bool:
        """Resumed from a preemption less than min_run_s ago: not preempted again yet."""
        return seq.resumed_at is not None and self.clock() - seq.resumed_at < self.cfg.min_run_s

    def may_preempt(self, victim, for_seq) -> bool:
        """Whether `victim` (running) may be preempted to make room for `for_seq` (waiting)."""
        if self.fcfs or self.protected(victim):
            return False
        if victim.priority == INTERACTIVE and victim.num_tokens == victim.num_prompt_tokens:
            return False  # its first token is what L1 is about
        return self.class_rank(victim) > self.class_rank(for_seq)

    def victim_score(self, seq, num_blocks: int) -> float:
        """Higher: a better victim. The class dominates (4 per rank); within one, the least
        progress (tokens done of prompt + max_tokens) and the most blocks held."""
        expected = seq.num_prompt_tokens + seq.params.max_tokens
        progress = min(1.0, seq.num_computed_tokens / max(1, expected))
        held = len(seq.block_table) / max(1, num_blocks)
        return 4 * self.class_rank(seq) + (1.0 - progress) + held


class StepRates:
    """Tokens per second this engine's steps ran at, by kind (exponential moving averages; 0 until
    a step of that kind ran): prompt tokens in mostly-prefill steps, output tokens in decode-only
    steps. Recompute costs come from the first; the heartbeats carry both, and the mesh's elastic
    roles weigh an output token against a prompt token by their ratio (services/scheduler/roles.py)."""

    def __init__(self, alpha: float = 0.3):
        self.alpha, self.prefill_tokens_per_s, self.decode_tokens_per_s = alpha, 0.0, 0.0

    @staticmethod
    def _ema(old: float, new: float, alpha: float) -> float:
        return new if old == 0.0 else old + alpha * (new - old)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, tokens / seconds, self.alpha)

    def observe_decode(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.decode_tokens_per_s = self._ema(self.decode_tokens_per_s, tokens / seconds, self.alpha)


class PreemptionCosts:
    """What a preemption would cost each way, from measured rates: swap moves the KV bytes to host
    memory and back (bytes over the measured copy bandwidth, twice); recompute prefills the
    computed tokens again (tokens over the measured prefill rate, `rates`; `prefill_tokens_per_s`
    until a prefill step was measured). Exponential moving averages."""

    def __init__(self, copy_bytes_per_s: float = 2e9, prefill_tokens_per_s: float = 2000.0, alpha: float = 0.3):
        self.copy_bytes_per_s, self.alpha = copy_bytes_per_s, alpha
        self.assumed_prefill_tokens_per_s = prefill_tokens_per_s
        self.rates = StepRates(alpha)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.rates.prefill_tokens_per_s or self.assumed_prefill_tokens_per_s

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.copy_bytes_per_s += self.alpha * (nbytes / seconds - self.copy_bytes_per_s)

    def swap_s(self, nbytes: int) -> float:
        return 2 * nbytes / self.copy_bytes_per_s

    def recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def choose(self, mode: str, nbytes: int, tokens: int, can_swap: bool) -> str:
        """"swap" or "recompute" for a victim of `tokens` computed tokens in `nbytes` of KV."""
        if tokens == 0 or not can_swap or mode == "recompute":
            return "recompute"
        if mode == "swap":
            return "swap"
        return "swap" if self.swap_s(nbytes) < self.recompute_s(tokens) else "recompute"

    def as_dict(self) -> dict:
        return {"copy_bytes_per_s": self.copy_bytes_per_s, "prefill_tokens_per_s": self.prefill_tokens_per_s}


def add_scheduling_arguments(p, preemption: bool = False) -> None:
    """--scheduling (scheduler, workers, `meshserve up`) and --preemption-mode (workers, `up`)."""
    p.add_argument("--scheduling", choices=POLICIES, default="priority",
                   help="priority: interactive / normal / background with their guarantees (docs/scheduling.md); "
                        "fcfs: first come, first served, priorities ignored")
    if preemption:
        p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="auto",
                       help="a preempted sequence's KV: swapped to host memory, recomputed, or auto: the cheaper "
                            "by measured copy bandwidth and prefill rate")
