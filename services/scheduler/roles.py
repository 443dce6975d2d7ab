"""Elastic prefill/decode roles: which worker of a node should change role, and when.

The demand on a node's workers is two numbers their heartbeats report: prompt tokens still to
prefill (P) and output tokens still to generate (D). A remaining output token costs more time than
a prompt token (prompt tokens are computed many to a step, output tokens one per sequence per
step), so D is weighed by the cost of an output token in prompt tokens: the ratio of the rates the
workers measured (prompt tokens per second in their prefill steps over output tokens per second in
their decode steps, `token_cost`), so the weight is this machine's and this batch size's (on a
GPU, prompt tokens are far cheaper next to output tokens than on a CPU); `decode_token_cost` (8,
measured on a CPU) until both rates are known.

Decode workers prefill too when the node has no prefill worker, so a node of N workers can run
in two ways: every worker does both (k = 0: the work is shared, it drains in (P + cost x D) / N),
or k workers prefill only and N - k decode only (it drains in max(P / k, cost x D / (N - k))).
Sharing never drains slower (it is work-conserving; a split idles one side once its work is
done), and the two are equal only when the split matches the demands' proportion. What a split
buys is latency: decode steps free of long prompt chunks (the disaggregation of DistServe and
Dynamo), worth something in proportion to how much decoding runs beside the prompts. So a
split's drain time is credited by `split_worth` x min(P, cost x D) / max(P, cost x D), and the
best of sharing and the splits is the target: one-sided traffic (a batch of long prompts, or a
crowd of short chats with long answers) runs on every worker; traffic with both in proportion
gets dedicated prefill workers. Measured (docs/benchmarks, bench-roles): on one node with both
workers prefilling and decoding, traffic-shift ran 1.42x faster than with a fixed 1:1 split.

Interactive requests change the answer: sharing puts a batch's long prompt chunks into every
worker's steps, so an interactive prompt waits for one wherever it goes. While the node has seen
interactive requests within `interactive_window_s` and has `min_work` prompt tokens to prefill, it keeps at
least one prefill worker: the batch's prompts go there and the decode workers, whose steps stay
short, take the interactive prompts (measured: interactive TTFT p99 under a background batch
1.03x its value alone with a split, 2.6x with sharing; the batch took 1.3x longer).

A worker changes role only when that improves the estimate by more than `hysteresis`, when that
has held for `hold_s`, at least `cooldown_s` after the node's last switch, and only while the node
has `min_work` to do: light traffic never moves roles, and roles do not flap on noise. A node
always keeps a decode worker.

`wanted` is the pure decision from one observation; `ElasticRoles` adds time (hold, cooldown)
and the switches in flight, which the scheduler's loop drives. `Held` (a wish acted on once it has
stood for a while) is also what holds the model moves of models.py.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

log = logging.getLogger("meshserve.scheduler")


@dataclass(frozen=True)
class RolePolicy:
    decode_token_cost: float = 8.0  # one output token still to generate weighs this many prompt tokens, until measured
    measured: bool = True  # weigh output tokens by the workers' measured rates (False: always decode_token_cost)
    min_decode_token_cost: float = 1.0  # the measured weight is kept within these bounds
    max_decode_token_cost: float = 64.0
    min_work: float = 1024.0  # token-equivalents (P + cost x D) below which roles stay as they are
    split_worth: float = 0.5  # with prompts and outputs in proportion, a split may drain this much slower than sharing
    hysteresis: float = 0.15  # a switch must cut the estimate (drain time, split_worth counted) by this share
    hold_s: float = 0.5  # a wish must hold this long (two heartbeats) before it becomes a switch
    smooth_s: float = 1.0  # the pending tokens the policy weighs: a moving average over about this long
    cooldown_s: float = 2.0  # between two switches on one node
    interactive_window_s: float = 10.0  # interactive requests seen this recently keep a prefill worker
    switch_timeout_s: float = 10.0  # a switch not confirmed by then is given up (the worker may be old or gone)


@dataclass(frozen=True)
class Load:
    """What one worker's heartbeat said, as the policy needs it."""

    worker_id: str
    role: str  # prefill | decode (mixed workers are left alone)
    pending_prefill_tokens: int
    pending_decode_tokens: int
    num_running: int = 0
    interactive: int = 0  # interactive requests running or waiting there
    prefill_tokens_per_s: float = 0.0  # its measured rates (0: not measured yet)
    decode_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Switch:
    worker_id: str
    from_role: str
    to_role: str
    reason: str


def work(prefill_tokens: float, decode_tokens: float, decode_token_cost: float) -> float:
    """Pending work in token-equivalents: prompt tokens, plus output tokens weighed by their cost."""
    return prefill_tokens + decode_token_cost * decode_tokens


def token_cost(prefill_rates: list[float], decode_rates: list[float], policy: RolePolicy) -> float:
    """What an output token weighs in prompt tokens: the mean measured prefill rate over the mean
    measured decode rate (each over the workers that measured one: rates of 0 are left out), kept
    within the policy's bounds; its decode_token_cost until both are measured, or always where
    the policy is not `measured` (`--decode-token-cost`)."""
    pre, dec = [r for r in prefill_rates if r > 0], [r for r in decode_rates if r > 0]
    if not policy.measured or not pre or not dec:
        return policy.decode_token_cost
    ratio = (sum(pre) / len(pre)) / (sum(dec) / len(dec))
    return min(policy.max_decode_token_cost, max(policy.min_decode_token_cost, ratio))


def drain_time(prefill_tokens: float, decode_tokens: float, n: int, k: int, policy: RolePolicy) -> float:
    """How long the pending work takes (in one worker's prompt tokens) with k of n workers
    prefilling only; k = 0: every worker prefills and decodes."""
    cd = policy.decode_token_cost * decode_tokens
    if k == 0:
        return (prefill_tokens + cd) / n
    if k == n:  # no decode worker (started so): nothing decodes
        return prefill_tokens / n if cd == 0 else float("inf")
    return max(prefill_tokens / k, cd / (n - k))


def split_score(prefill_tokens: float, decode_tokens: float, n: int, k: int, policy: RolePolicy) -> float:
    """drain_time with a split's latency counted in its favour (lower is better)."""
    t = drain_time(prefill_tokens, decode_tokens, n, k, policy)
    if k == 0:
        return t
    cd = policy.decode_token_cost * decode_tokens
    balance = min(prefill_tokens, cd) / max(prefill_tokens, cd, 1e-9)
    return t / (1.0 + policy.split_worth * balance)


def target_prefill_workers(prefill_tokens: float, decode_tokens: float, n: int, policy: RolePolicy,
                           keep_split: bool = False) -> int:
    """How many of n workers should prefill only (0: all do both; at most n - 1). keep_split: at
    least one (interactive requests beside prompts to prefill)."""
    return min(range(1 if keep_split and n > 1 else 0, n),
               key=lambda k: (split_score(prefill_tokens, decode_tokens, n, k, policy), k))


def pending(loads: list[Load]) -> tuple[int, int]:
    """The prompt and output tokens pending on the workers whose roles the policy balances."""
    pool = [w for w in loads if w.role in ("prefill", "decode")]
    return sum(w.pending_prefill_tokens for w in pool), sum(w.pending_decode_tokens for w in pool)


def wanted(loads: list[Load], policy: RolePolicy, interactive: bool = False,
           demand: tuple[float, float] | None = None) -> Switch | None:
    """The switch one observation of a node's workers asks for, if any. interactive: the node has
    served interactive requests lately (ElasticRoles keeps that memory). demand: the pending prompt
    and output tokens to weigh (ElasticRoles' moving average; default: this observation's)."""
    pool = [w for w in loads if w.role in ("prefill", "decode")]
    n = len(pool)
    if n < 2:
        return None
    p, d = pending(loads) if demand is None else demand
    cost = token_cost([w.prefill_tokens_per_s for w in pool], [w.decode_tokens_per_s for w in pool], policy)
    policy = replace(policy, decode_token_cost=cost)
    if work(p, d, policy.decode_token_cost) < policy.min_work:
        return None
    prefill = [w for w in pool if w.role == "prefill"]
    decode = [w for w in pool if w.role == "decode"]
    keep_split = interactive and p >= policy.min_work  # a short interactive prompt alone is not a batch
    now, target = len(prefill), target_prefill_workers(p, d, n, policy, keep_split)
    forced = keep_split and now == 0  # sharing is not an option: no score can keep it
    if target == now or (not forced and split_score(p, d, n, now, policy)
                         <= (1.0 + policy.hysteresis) * split_score(p, d, n, target, policy)):
        return None
    why = (f"pending prefill {p:.0f} tokens vs decode {d:.0f} tokens x {policy.decode_token_cost:.3g}: "
           f"{target} of {n} workers should prefill only, {now} do "
           f"(drain {drain_time(p, d, n, target, policy):.0f} vs {drain_time(p, d, n, now, policy):.0f})"
           + ("; interactive requests on the node: long prompts kept off a decode worker" if keep_split else ""))
    if target > now:
        w = min(decode, key=lambda w: (w.num_running, w.pending_decode_tokens, w.worker_id))
        return Switch(w.worker_id, "decode", "prefill", why)
    w = min(prefill, key=lambda w: (w.pending_prefill_tokens, w.num_running, w.worker_id))
    return Switch(w.worker_id, "prefill", "decode", why)


@dataclass
class Held:
    """Wishes acted on only once the same one has stood for a while, so noise switches nothing.
    One wish per key (a node's workers of one model; the mesh's models), named by an identity
    that compares equal when two observations want the same thing."""

    _since: dict = field(default_factory=dict)  # key -> (the wish's identity, since when)

    def ready(self, key, wish, now: float, hold_s: float) -> bool:
        """Whether `wish` (None: there is none) has been the key's wish for hold_s; True starts it afresh."""
        held = self._since.get(key)
        if wish is None:
            self._since.pop(key, None)
            return False
        if held is None or held[0] != wish:
            self._since[key] = (wish, now)
            return False
        if now - held[1] < hold_s:
            return False
        del self._since[key]
        return True

    def clear(self, key) -> None:
        self._since.pop(key, None)


@dataclass
class _InFlight:
    switch: Switch
    since: float


@dataclass
class ElasticRoles:
    """Time and state around `wanted`, per node (the scheduler passes the node's workers of one model
    at a time, keyed by node and model): hold, cooldown, one switch in flight at a time.

    `role_of` is the role the scheduler routes by: a worker told to switch counts in its new role
    at once (it takes no new work of the old one), before its heartbeat says it has switched."""

    policy: RolePolicy = field(default_factory=RolePolicy)
    enabled: bool = True
    switches: int = 0  # completed
    history: list[dict] = field(default_factory=list)  # the last switches, for status
    _wish: Held = field(default_factory=Held)  # node -> the switch it wants, since when
    _last: dict[str, float] = field(default_factory=dict)  # node -> time of its last switch
    _in_flight: dict[str, _InFlight] = field(default_factory=dict)  # worker id -> its switch
    _interactive_seen: dict[str, float] = field(default_factory=dict)  # node -> when it last had any
    _pending: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # node -> averaged (p, d, when)

    def _average(self, node: str, loads: list[Load], now: float) -> tuple[float, float]:
        """The node's pending prompt and output tokens, averaged over about smooth_s (from its first
        observation on). Heartbeats sample them many times a second and, with prompts prefilled in
        a step or two, one sample can be far from the next: a decision on single samples would wait
        for a run of lucky ones."""
        p, d = pending(loads)
        last = self._pending.get(node)
        if last is not None:
            a = 1.0 - math.exp(-max(0.0, now - last[2]) / self.policy.smooth_s)
            p, d = last[0] + a * (p - last[0]), last[1] + a * (d - last[1])
        self._pending[node] = p, d, now
        return p, d

    def role_of(self, worker_id: str, reported: str) -> str:
        f = self._in_flight.get(worker_id)
        return f.switch.to_role if f is not None else reported

    def in_flight(self, worker_id: str) -> bool:
        """Told to switch role and not yet confirmed (a model move leaves it alone meanwhile)."""
        return worker_id in self._in_flight

    def observe(self, node: str, loads: list[Load], now: float | None = None) -> Switch | None:
        """A switch to order now on this node, or None."""
        if not self.enabled:
            return None
        now = time.monotonic() if now is None else now
        for wid, f in list(self._in_flight.items()):
            if now - f.since > self.policy.switch_timeout_s:
                log.warning("worker %s did not confirm its switch to %s in %.0f s: given up", wid, f.switch.to_role,
                            self.policy.switch_timeout_s)
                del self._in_flight[wid]
        if any(w.interactive for w in loads):
            self._interactive_seen[node] = now
        interactive = now - self._interactive_seen.get(node, -1e9) < self.policy.interactive_window_s
        ids = {w.worker_id for w in loads}
        loads = [replace(w, role=self.role_of(w.worker_id, w.role)) for w in loads]
        demand = self._average(node, loads, now)
        if any(wid in ids for wid in self._in_flight) or now - self._last.get(node, -1e9) < self.policy.cooldown_s:
            self._wish.clear(node)
            return None
        want = wanted(loads, self.policy, interactive, demand)
        if not self._wish.ready(node, None if want is None else (want.worker_id, want.to_role), now,
                                self.policy.hold_s):
            return None
        self._in_flight[want.worker_id] = _InFlight(want, now)
        self._last[node] = now
        return want

    def reported(self, node: str, worker_id: str, role: str, now: float | None = None) -> Switch | None:
        """A heartbeat's role; returns the switch it completes, if any."""
        f = self._in_flight.get(worker_id)
        if f is None or role != f.switch.to_role:
            return None
        now = time.monotonic() if now is None else now
        del self._in_flight[worker_id]
        self._last[node] = now
        self.switches += 1
        s = f.switch
        self.history = (self.history + [{"worker": s.worker_id, "from": s.from_role, "to": s.to_role,
                                         "seconds": round(now - f.since, 3), "reason": s.reason}])[-16:]
        log.info("worker %s switched %s -> %s in %.3f s: %s", s.worker_id, s.from_role, s.to_role, now - f.since,
                 s.reason)
        return s

    def forget(self, worker_id: str) -> None:
        """The worker left the mesh."""
        self._in_flight.pop(worker_id, None)
