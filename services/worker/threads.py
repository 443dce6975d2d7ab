"""How many threads each engine step runs on, chosen by measured speed.

OpenMP's threads meet at a barrier after every parallel region (a few hundred per decode step).
When another process holds one of the cores, the thread that lost its core reaches each barrier a
scheduler slice late and the others spin waiting for it: a 2-thread decode fell from about 80 to
2-3 tokens/s beside a CPU burner, where one thread on the free core keeps most of its speed. On a
quiet machine all the cores are faster. Neither is right for every machine state, so the worker
measures: per kind of step (by the tokens it computes, in powers of two: the step's own size,
known once the engine has scheduled it), a moving average of the seconds per token of its model
pass with each candidate thread count, and runs the faster one, trying the other
on one step in `explore_every` so that a change of load (the burner starting or stopping) is
noticed within a few hundred steps. The quiet-machine cost is that one step in `explore_every`
runs on the slower count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

ALPHA = 0.25  # weight of the newest step in the moving averages


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None], explore_every: int = 32,
                 clock: Callable[[], float] = time.perf_counter):
        self.candidates = sorted({1, max(1, max_threads)})
        self.set_threads, self.explore_every, self.clock = set_threads, explore_every, clock
        self.avg: dict[tuple[int, int], float] = {}  # (step bucket, threads) -> seconds per token
        self.count: dict[int, int] = {}  # steps seen per bucket
        self.current = self.candidates[-1]  # what the step thread starts with (set there, not here)
        self.chosen = {n: 0 for n in self.candidates}  # steps run per thread count (stats)

    def limit(self, max_threads: int) -> None:
        """The step thread now runs `max_threads` threads (its owner set that many there): the cores of
        a compute partition (shared/partitions.py). The candidates are 1 and that many, never more,
        and what was measured on other cores is forgotten."""
        self.candidates = sorted({1, max(1, max_threads)})
        self.avg.clear()
        self.count.clear()
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
        untried = [n for n in self.candidates if (b, n) not in self.avg]
        if untried:
            n, explore = untried[0], False
        else:
            best = min(self.candidates, key=lambda c: self.avg[(b, c)])
            others = [c for c in self.candidates if c != best]
            explore = bool(others) and k % self.explore_every == 0
            n = others[(k // self.explore_every) % len(others)] if explore else best
        if n != self.current:
            self.set_threads(n)
            self.current = n
        self.chosen[n] += 1
        return n, explore

    def record(self, num_tokens: int, threads: int, seconds: float, explored: bool = False) -> None:
        """An exploring step replaces its count's average outright: that average is old (the
        machine's load may have changed since), and one fresh sample is the best news there is."""
        key, per_token = (self.bucket(num_tokens), threads), seconds / max(1, num_tokens)
        old = self.avg.get(key)  # per token: a bucket spans sizes up to 2x apart
        self.avg[key] = per_token if old is None or explored else (1 - ALPHA) * old + ALPHA * per_token

    def run(self, num_tokens: int, step: Callable[[], object]):
        """Runs one step on the chosen thread count and measures it."""
        n, explore = self.pick(num_tokens)
        t0 = self.clock()
        out = step()
        self.record(num_tokens, n, self.clock() - t0, explore)
        return out

    def stats(self) -> dict:
        return {"threads_now": self.current, "steps_by_threads": {str(k): v for k, v in self.chosen.items()}}
