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
  best (a busy core), the interval stays `explore_every`, and a budget (below) gates it;
- a step on all the threads that takes SURPRISE times its count's average (per token) makes the next
  step of its kind explore at once, whatever the interval: a burner taking a core shows on the very
  next step. (A slow step on fewer threads is more contention still: more threads would not help.)

Exploring more threads while a core is taken is the costly direction: one 2-thread decode step
beside a burner took 540 ms where a 1-thread one took 12.5 (measured, 2 cores, SmolLM2 int8), so
exploring it every 32 steps more than halved the stream. While fewer threads are best:

- a scheduled exploration of more threads waits for its budget: each step adds EXPLORE_SHARE of
  its seconds, an exploration spends what it took, so explorations cost at most that share of
  the time however slow they turn out;
- the cheap sign that the core came back is the cores' own idle time (/proc/stat): when at least
  SPARE of a core sat idle over WINDOW seconds of steps, besides the worker's own pauses between
  them, the next step of each such kind explores at once, budget or not. A sign that proves wrong
  (more threads still slower, two steps in a row) doubles the steps before the next one is heeded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

ALPHA = 0.25  # weight of the newest step in the moving averages
MARGIN = 1.25  # an exploration that finds the other count this much slower backs off
MAX_BACKOFF = 8  # the longest interval between explorations: explore_every times this
SURPRISE = 2.0  # a step this many times its count's average makes the next one explore
EXPLORE_SHARE = 0.05  # the most of the stepping time that exploring more threads may cost
SPARE = 0.5  # cores idle (summed) while stepping that say a core is free again
WINDOW = 0.1  # seconds (10 ticks) over which the cores' idle time is judged
LONG_GAP = 1.0  # a pause between steps longer than this starts a new window (shorter ones are subtracted)
MAX_HINT_BACKOFF = 64  # the most steps between heeded idle signs: explore_every times this


def idle_seconds(cores) -> float | None:
    """Seconds these cores have sat idle since boot (/proc/stat's idle and iowait), None where that
    cannot be read (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = {b"cpu%d" % c for c in cores}
    ticks = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        parts = line.split()
        if parts[0] in want:
            ticks += int(parts[4]) + int(parts[5])
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None], explore_every: int = 32,
                 clock: Callable[[], float] = time.perf_counter, idle: Callable[[], float | None] | None = None):
        self.candidates = sorted({1, max(1, max_threads)})
        self.set_threads, self.explore_every, self.clock = set_threads, explore_every, clock
        self.idle = idle  # seconds the cores it may use have sat idle, cumulative (idle_seconds)
        self.avg: dict[tuple[int, int], float] = {}  # (step bucket, threads) -> seconds per token
        self.count: dict[int, int] = {}  # steps seen per bucket
        self.next_explore: dict[int, int] = {}  # per bucket: the step count at which it explores next
        self.interval: dict[int, int] = {}  # per bucket: steps between explorations now
        self.current = self.candidates[-1]  # what the step thread starts with (set there, not here)
        self.chosen = {n: 0 for n in self.candidates}  # steps run per thread count (stats)
        self.explored = {"fewer": 0, "more": 0, "more_on_idle_cores": 0, "idle_signs_wrong": 0}  # (stats)
        self._forget_contention()

    def _forget_contention(self) -> None:
        self.budget: dict[int, float] = {}  # per bucket: seconds it may spend exploring more threads
        self.hinted: set[int] = set()  # buckets whose next step explores more threads: cores sat idle
        self.hint_exploring = False  # the step being run explores because of such a sign
        self.hint_retried: set[int] = set()  # buckets whose sign's first step came out slower
        self.hint_every: dict[int, int] = {}  # per bucket: steps between heeded idle signs now
        self.hint_after: dict[int, int] = {}  # per bucket: the step count from which a sign is heeded
        self.window: tuple[float, float | None] | None = None  # (start, idle seconds then) of the window
        self.paused = 0.0  # seconds between steps in the window (the worker's own core idle)
        self.last_end = float("-inf")

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
        self._forget_contention()

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(0, int(num_tokens).bit_length() - 1)

    def pick(self, num_tokens: int) -> tuple[int, bool]:
        """The thread count for a step computing `num_tokens` tokens (set before it runs), and
        whether the step explores (runs a count other than the best so far)."""
        b = self.bucket(num_tokens)
        k = self.count.get(b, 0)
        self.count[b] = k + 1
        self.hint_exploring = False
        # A size not measured yet runs first on the count running now (what the other sizes found
        # best), the other next: a quiet machine's first step of each size is not a one-thread try.
        untried = sorted((n for n in self.candidates if (b, n) not in self.avg), key=lambda n: n != self.current)
        if untried:
            n, explore = untried[0], False
        else:
            best = self.best(b)
            others = [c for c in self.candidates if c != best]
            explore = bool(others) and k >= self.next_explore.setdefault(b, k + self.explore_every)
            n = others[(k // self.explore_every) % len(others)] if others else best
            if explore and n > best:  # the costly direction: only within its budget
                explore = self.budget.get(b, 0.0) >= self.avg[(b, n)] * num_tokens
            self.hint_exploring = b in self.hinted and best < self.candidates[-1]
            self.hinted.discard(b)
            if self.hint_exploring:  # cores sat idle: a core is free again, most likely
                explore, n = True, self.candidates[-1]
            if not explore:
                n = best
        if n != self.current:
            self.set_threads(n)
            self.current = n
        self.chosen[n] += 1
        if explore:
            self.explored["more_on_idle_cores" if self.hint_exploring else "more" if n > best else "fewer"] += 1
        return n, explore

    def record(self, num_tokens: int, threads: int, seconds: float, explored: bool = False) -> None:
        """An exploring step replaces its count's average outright: that average is old (the
        machine's load may have changed since), and one fresh sample is the best news there is."""
        b = self.bucket(num_tokens)
        key, per_token = (b, threads), seconds / max(1, num_tokens)
        old = self.avg.get(key)  # per token: a bucket spans sizes up to 2x apart
        best_before = self.best(b)
        self.avg[key] = per_token if old is None or explored else (1 - ALPHA) * old + ALPHA * per_token
        more = explored and best_before is not None and threads > best_before
        if more:
            self.budget[b] = self.budget.get(b, 0.0) - seconds
            self._heed_hints(b, found_free=self.best(b) == threads, hinted=self.hint_exploring)
        else:  # saved up to one exploration of the most threads at the bucket's largest size
            cap = self.avg.get((b, self.candidates[-1]), 0.0) * (2 << b)
            self.budget[b] = min(cap, self.budget.get(b, 0.0) + EXPLORE_SHARE * seconds)
        if explored:
            self._backoff(b, best_before)
        elif old is not None and per_token > SURPRISE * old and threads > self.candidates[0]:
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
        self._watch_idle(t0)
        out = step()
        t1 = self.clock()
        self.record(num_tokens, n, t1 - t0, explore)
        self.last_end = t1
        self._judge_idle(t1)
        return out

    def _watch_idle(self, start: float) -> None:
        """Before a step: a window starts here when fewer threads than all run, or after a long pause.
        A short pause (the worker waiting for its next request) stays in the window, its length taken
        off the idle time: the worker's own core sat idle through it."""
        if self.idle is None or self.current == self.candidates[-1]:
            self.window = None
        elif self.window is None or start - self.last_end > LONG_GAP:
            self.window, self.paused = (start, self.idle()), 0.0
        else:
            self.paused += start - self.last_end

    def _judge_idle(self, end: float) -> None:
        """After a step: when the window is long enough, did SPARE of a core sit idle in it, besides
        the worker's own pauses?"""
        if self.window is None or end - self.window[0] < WINDOW:
            return
        (start, before), after, paused = self.window, self.idle(), self.paused
        self.window, self.paused = (end, after), 0.0
        if before is None or after is None or (after - before - paused) / (end - start) < SPARE:
            return
        top = self.candidates[-1]
        for b, k in self.count.items():
            best = self.best(b)
            if best is not None and best < top and k >= self.hint_after.get(b, 0):
                self.hinted.add(b)

    def _heed_hints(self, b: int, found_free: bool, hinted: bool) -> None:
        """After exploring more threads: a sign that proved wrong doubles the wait for the next. Its
        first step is not the last word: the thread team woke from sleep for it (a first 2-thread
        step after a stretch on one came out slower than one thread on a quiet machine, measured),
        so a sign is proved wrong by a second step in a row."""
        if hinted and not found_free and b not in self.hint_retried:
            self.hint_retried.add(b)
            self.hinted.add(b)
            return
        self.hint_retried.discard(b)
        n = self.hint_every.get(b, self.explore_every)
        if found_free:
            n = self.explore_every
        elif hinted:
            n = min(2 * n, self.explore_every * MAX_HINT_BACKOFF)
            self.explored["idle_signs_wrong"] += 1
        self.hint_every[b] = n
        self.hint_after[b] = self.count.get(b, 0) + n

    def stats(self) -> dict:
        """For the heartbeat (/health): the count now, steps run per count, the measured milliseconds
        per token by step size ("tokens>=N" buckets) and count, and the explorations by kind."""
        per = {}
        for (b, n), v in sorted(self.avg.items()):
            per.setdefault(f"tokens>={1 << b}", {})[str(n)] = round(v * 1000, 4)
        return {"threads_now": self.current, "steps_by_threads": {str(k): v for k, v in self.chosen.items()},
                "ms_per_token": per, "explorations": dict(self.explored)}
