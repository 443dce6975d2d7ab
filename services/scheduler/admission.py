"""Admission at the scheduler: tenant quotas and the bound on each class's waiting queue.

The scheduler is where these counts are mesh-wide (every gateway submits to it), so they are
kept here; the gateway only finds the tenant by its API key and the class (services/gateway/auth.py).

- `max_concurrent_requests`: a tenant's requests from admission until its gateway reports that the
  request ended (`Usage`: finished, failed or given up by the client). Over it: 429.
- `tokens_per_minute` (prompt + generated tokens): a bucket holding up to tokens_per_minute tokens,
  refilled continuously at tokens_per_minute / 60 per second. Admission reserves prompt + max_tokens
  (at most a full bucket, so any request can eventually run) and needs that much in the bucket; when
  the request ends it is charged what it used (prompt + generated): the unused rest of the
  reservation goes back, and an excess is taken, which may leave the bucket below zero. Over it: 429,
  with Retry-After the time the bucket needs to hold the reservation.
- queues (`max_waiting` per class): 503 when the class already has that many requests waiting for a
  seat (`waiting_by_class`, `queue_bound`).

A re-submission (the gateway re-sends a request whose worker died, with the same request id) was
admitted already: it passes without a check or a charge. A `Usage` that never comes (a gateway
that died) is covered by `sweep`: an admitted request the scheduler no longer tracks is released
after SETTLE_GRACE seconds, charged its whole reservation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshserve.shared.schemas import GenerateRequest, SubmitReply
from meshserve.shared.tenants import CLASSES, QueueLimit, TenantsFile, rank

SETTLE_GRACE = 30.0  # seconds an admitted request may stay untracked before it is released unreported
CONCURRENCY_RETRY_S = 1.0  # Retry-After when a concurrency slot or a queue place is what is missing
QUEUE_RETRY_S = 1.0


def waiting_by_class(workers: Iterable[tuple[list[str], int, dict[str, int]]]) -> dict[str, int]:
    """Requests waiting for a seat, mesh-wide, by class. `workers`: for each worker, the classes of
    the requests assigned to it (sent and not done), its seats (max_num_seqs; 0: unknown) and the
    waiting counts of its last heartbeat. On a worker, the assigned requests beyond its seats are
    waiting (its engine seats the best classes first); its heartbeat may report more (requests
    short of KV blocks): per class, the larger of the two counts. The first is exact as soon as a
    request is dispatched or done, the second lags by up to a heartbeat interval."""
    total = dict.fromkeys(CLASSES, 0)
    for classes, seats, reported in workers:
        beyond = sorted(classes, key=rank)[seats:] if seats > 0 else []
        for c in CLASSES:
            total[c] += max(beyond.count(c), int(reported.get(c, 0)))
    return total


def queue_bound(priority: str, waiting: dict[str, int], queues: dict[str, QueueLimit]) -> SubmitReply | None:
    """The refusal (503, Retry-After) when `priority`'s queue already holds its max_waiting requests;
    None when there is room or the class has no bound."""
    limit = queues.get(priority)
    if limit is None or waiting.get(priority, 0) < limit.max_waiting:
        return None
    return SubmitReply(ok=False, status_code=503, error_type="server_error", error_code="queue_full",
                       retry_after=QUEUE_RETRY_S,
                       error=f"the {priority} queue is full ({waiting.get(priority, 0)} waiting, max_waiting "
                             f"{limit.max_waiting}); retry later")


class TokenBucket:
    """Up to `capacity` tokens, refilled at capacity / 60 per second; the level may go below zero."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._level, self._at = self.capacity, now

    def level(self, now: float) -> float:
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def take(self, n: float, now: float) -> None:
        self.level(now)
        self._level -= n

    def give(self, n: float, now: float) -> None:
        self.level(now)
        self._level = min(self.capacity, self._level + n)

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until the bucket holds `n` (n <= capacity)."""
        return max(0.0, n - self.level(now)) / self.rate


@dataclass
class Admitted:
    tenant: str
    prompt_tokens: int
    reserved: int
    max_tokens: int = 0
    charged: bool = False  # its tenant's fair share counted it (FairShare)
    untracked_since: float | None = None


class FairShare:
    """Tenants' fair share of the workers within a class: virtual token counters (Sheng et al.,
    "Fairness in Serving Large Language Models", OSDI 2024). A tenant's counter is the tokens it
    was served (prompt + max_tokens when sent, less what it did not generate when it ends) per its
    weight; the scheduler's queues send next the request of the waiting tenant with the least.
    A tenant that starts waiting is lifted to the least counter among those already waiting (or,
    with none waiting, to the counter of the last one served), so an idle tenant banks no credit."""

    def __init__(self, weights: dict[str, float]):
        self.weights = weights
        self.counters: dict[str, float] = {}
        self.last = 0.0  # the counter of the tenant served last: the mesh's virtual time

    def share(self, tenant: str | None) -> float:
        return self.counters.get(tenant, 0.0) if tenant is not None else 0.0

    def waiting(self, tenant: str, others: set[str]) -> None:
        """`tenant` queues a request; `others`: the tenants with requests queued already."""
        if tenant in others:
            return
        floor = min((self.share(t) for t in others), default=self.last)
        self.counters[tenant] = max(self.share(tenant), floor)

    def charge(self, tenant: str, tokens: float) -> None:
        """A request of `tenant` is served: `tokens` it may use."""
        self.counters[tenant] = self.share(tenant) + tokens / self.weights.get(tenant, 1.0)
        self.last = self.counters[tenant]

    def refund(self, tenant: str, tokens: float) -> None:
        """Tokens charged that the request did not use."""
        self.counters[tenant] = self.share(tenant) - tokens / self.weights.get(tenant, 1.0)


def _too_many(error: str, type_: str, retry_after: float) -> SubmitReply:
    """429 as OpenAI sends it: code rate_limit_exceeded, type "requests" or "tokens"."""
    return SubmitReply(ok=False, status_code=429, error=error, error_type=type_, error_code="rate_limit_exceeded",
                       retry_after=retry_after)


class Admission:
    """Tenants and queue bounds from the tenants file; with none, everything is admitted."""

    def __init__(self, config: TenantsFile | None, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self.admitted: dict[str, Admitted] = {}
        now = clock()
        self.buckets = {} if config is None else {
            t.name: TokenBucket(t.tokens_per_minute, now) for t in config.tenants if t.tokens_per_minute}
        self.fair = FairShare({} if config is None else {t.name: t.weight for t in config.tenants})

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def in_flight(self, tenant: str) -> int:
        return sum(a.tenant == tenant for a in self.admitted.values())

    def dispatched(self, req: GenerateRequest) -> None:
        """The request went to a worker: its tenant's fair share is charged its reservation (once,
        however often it is sent again); settle gives back what it did not generate."""
        a = self.admitted.get(req.request_id)
        if a is not None and not a.charged:
            a.charged = True
            self.fair.charge(a.tenant, a.prompt_tokens + a.max_tokens)

    def admit(self, req: GenerateRequest, waiting: Callable[[], dict[str, int]]) -> SubmitReply | None:
        """None when `req` may run (and it is then counted); else the refusal to send back.
        `waiting` is called only when the request's class has a bound."""
        if self.config is None or req.request_id in self.admitted:
            return None
        tenant = self.config.tenant(req.tenant) if req.tenant else None
        if tenant is None:  # the gateway has no tenants file, or another one
            return SubmitReply(ok=False, status_code=401, error_type="invalid_request_error",
                               error_code="invalid_api_key",
                               error=f"the scheduler knows no tenant {req.tenant!r}; give the gateway and the "
                                     f"scheduler the same --tenants file")
        now = self.clock()
        if tenant.max_concurrent_requests is not None and self.in_flight(tenant.name) >= tenant.max_concurrent_requests:
            return _too_many(f"rate limit reached for tenant {tenant.name!r}: max_concurrent_requests "
                             f"{tenant.max_concurrent_requests} are in flight; retry when one ends",
                             "requests", CONCURRENCY_RETRY_S)
        prompt = len(req.prompt_token_ids)
        reserve = prompt + req.sampling.max_tokens
        bucket = self.buckets.get(tenant.name)
        if bucket is not None:
            reserve = min(reserve, tenant.tokens_per_minute)
            if bucket.level(now) < reserve:
                wait = bucket.wait_for(reserve, now)
                return _too_many(f"rate limit reached for tenant {tenant.name!r} on tokens per minute: limit "
                                 f"{tenant.tokens_per_minute}, available {max(0, int(bucket.level(now)))}, "
                                 f"requested {reserve} (prompt + max_tokens); retry in {wait:.1f} s",
                                 "tokens", max(1.0, math.ceil(wait)))
        refusal = queue_bound(req.priority, waiting(), self.config.queues) if req.priority in self.config.queues \
            else None
        if refusal is not None:
            return refusal
        if bucket is not None:
            bucket.take(reserve, now)
        self.admitted[req.request_id] = Admitted(tenant.name, prompt, reserve, req.sampling.max_tokens)
        return None

    def settle(self, request_id: str, output_tokens: int) -> None:
        """The request ended, having generated `output_tokens`: free its slot, charge what it used."""
        a = self.admitted.pop(request_id, None)
        if a is None:
            return
        bucket = self.buckets.get(a.tenant)
        if bucket is not None:
            bucket.give(a.reserved - (a.prompt_tokens + max(0, output_tokens)), self.clock())
        if a.charged:
            self.fair.refund(a.tenant, max(0, a.max_tokens - max(0, output_tokens)))

    def sweep(self, tracked: Callable[[str], bool]) -> None:
        """Releases admitted requests that `tracked` has denied for SETTLE_GRACE seconds (their
        Usage was lost), charged their whole reservation."""
        now = self.clock()
        for rid, a in list(self.admitted.items()):
            if tracked(rid):
                a.untracked_since = None
            elif a.untracked_since is None:
                a.untracked_since = now
            elif now - a.untracked_since > SETTLE_GRACE:
                del self.admitted[rid]

    def status(self) -> dict | None:
        if self.config is None:
            return None
        now = self.clock()
        return {"tenants": {t.name: {"in_flight": self.in_flight(t.name),
                                     "tokens_available": (int(self.buckets[t.name].level(now))
                                                          if t.name in self.buckets else None),
                                     "fair_share_counter": round(self.fair.share(t.name), 1)}
                            for t in self.config.tenants},
                "queues": {c: q.max_waiting for c, q in self.config.queues.items()}}
