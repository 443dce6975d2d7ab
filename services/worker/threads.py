"""How many threads each engine step runs on, chosen by measured speed.

OpenMP's threads meet at a barrier after every parallel region (a few hundred per decode step).
When another process holds one of the cores, the thread that lost its core reaches each barrier a
scheduler slice late and the others spin waiting for it: a 2-thread decode fell from about 80 to
2-3 tokens/s beside a CPU burner, where one thread on the free core keeps most of its speed. On a
quiet machine all the cores are faster. Neither is right for every machine state, so the worker
measures: per kind of step (by the tokens it computes, in powers of two: the step's own size,
known once the engine has scheduled it), a moving average of the seconds per token of its model
pass with each candidate thread count, and runs the faster one, trying the other now and
then so that a change of load (the burner starting or stopping) is noticed:

- every `explore_every` steps of a kind; while all the threads are the best, each exploration that
  finds one thread still clearly slower (by MARGIN) doubles the interval, up to `explore_every *
  MAX_BACKOFF`, and one that changes the best starts it over. On a quiet machine a 1-thread prefill
  step costs twice a 2-thread one, so exploring one step in 32 cost about 5% of a mixed load's
  throughput (measured, mixed-64 through the mesh); backed off, under 1%. With one thread the
  best (a busy core), the interval stays `explore_every`, so the core's return is seen soon;
- a step that takes SURPRISE times its count's average (per token) makes the next step of its kind
  explore at once, whatever the interval: a burner taking a core shows on the very next step.
  Its leaving is noticed within the longest interval (a few hundred steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable

ALPHA = 0.25  # weight of the newest step in the moving averages
MARGIN = 1.25  # an exploration that finds the other count this much slower backs off
MAX_BACKOFF = 8  # the longest interval between explorations: explore_every times this
SURPRISE = 2.0  # a step this many times its count's average makes the next one explore


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None], explore_every: int = 32,
                 clock: Callable[[], float] = time.perf_counter):
        self.candidates = sorted({1, max(1, max_threads)})
        self.set_threads, self.explore_every, self.clock = set_threads, explore_every, clock
        self.avg: dict[tuple[int, int], float] = {}  # (step bucket, threads) -> seconds per token
        self.count: dict[int, int] = {}  # steps seen per bucket
        self.next_explore: dict[int, int] = {}  # per bucket: the step count at which it explores next
        self.interval: dict[int, int] = {}  # per bucket: steps between explorations now
        self.current = self.candidates[-1]  # what the step thread starts with (set there, not here)
        self.chosen = {n: 0 for n in self.candidates}  # steps run per thread count (stats)

    def limit(self, max_threads: int) -> None:
        """The step thread now runs `max_threads` threads (its owner set that many there): the cores of
        a compute partition (shared/partitions.py). The candidates are 1 and that many, never more,
        and what was measured on other cores is forgotten."""
        self.candidates = sorted({1, max(1, max_threads)})
        self.avg.clear()
        self.count.clear()
        self.next_explore.clear()
        self.interval.clear()
        self.current = self.candidates[-1]
        self.chosen = {n: self.chosen.get(n, 0) for n in self.candidates}

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(0, int(num_tokens).bit_length() - 1)

    def pick(self, num_tokens: int) -> tuple[int, bool]:
        """The thread count for a step computing `num_tokens` tokens (set before it runs), and
        whether the step explores (runs a count other than the best so far)."""
        b = self.bucket(num_tokens)
        k = self.count.get(b, 0)
        self.count[b] = k + 1
        # A size not measured yet runs first on the count running now (what the other sizes found
        # best), the other next: a quiet machine's first step of each size is not a one-thread try.
        untried = sorted((n for n in self.candidates if (b, n) not in self.avg), key=lambda n: n != self.current)
        if untried:
            n, explore = untried[0], False
        else:
            best = self.best(b)
            others = [c for c in self.candidates if c != best]
            explore = bool(others) and k >= self.next_explore.setdefault(b, k + self.explore_every)
            n = others[(k // self.explore_every) % len(others)] if explore else best
        if n != self.current:
            self.set_threads(n)
            self.current = n
        self.chosen[n] += 1
        return n, explore

    def record(self, num_tokens: int, threads: int, seconds: float, explored: bool = False) -> None:
        """An exploring step replaces its count's average outright: that average is old (the
        machine's load may have changed since), and one fresh sample is the best news there is."""
        b = self.bucket(num_tokens)
        key, per_token = (b, threads), seconds / max(1, num_tokens)
        old = self.avg.get(key)  # per token: a bucket spans sizes up to 2x apart
        best_before = self.best(b)
        self.avg[key] = per_token if old is None or explored else (1 - ALPHA) * old + ALPHA * per_token
        if explored:
            self._backoff(b, best_before)
        elif old is not None and per_token > SURPRISE * old:
            self.next_explore[b] = self.count.get(b, 0)  # the machine changed: look again now

    def best(self, b: int) -> int | None:
        known = [c for c in self.candidates if (b, c) in self.avg]
        return min(known, key=lambda c: self.avg[(b, c)]) if known else None

    def _backoff(self, b: int, best_before: int | None) -> None:
        """After an exploration: wait longer before the next while it confirms the best by a margin."""
        best = self.best(b)
        times = sorted(self.avg[(b, c)] for c in self.candidates if (b, c) in self.avg)
        clear = (best == best_before == self.candidates[-1] and len(times) > 1
                 and times[1] >= MARGIN * times[0])
        n = self.interval.get(b, self.explore_every)
        n = min(2 * n, self.explore_every * MAX_BACKOFF) if clear else self.explore_every
        self.interval[b] = n
        self.next_explore[b] = self.count.get(b, 0) + n

    def run(self, num_tokens: int, step: Callable[[], object]):
        """Runs one step on the chosen thread count and measures it."""
        n, explore = self.pick(num_tokens)
        t0 = self.clock()
        out = step()
        self.record(num_tokens, n, self.clock() - t0, explore)
        return out

    def stats(self) -> dict:
        """For the heartbeat (/health): the count now, steps run per count, and the measured milliseconds
        per token by step size ("tokens>=N" buckets) and count."""
        per = {}
        for (b, n), v in sorted(self.avg.items()):
            per.setdefault(f"tokens>={1 << b}", {})[str(n)] = round(v * 1000, 4)
        return {"threads_now": self.current, "steps_by_threads": {str(k): v for k, v in self.chosen.items()},
                "ms_per_token": per}
