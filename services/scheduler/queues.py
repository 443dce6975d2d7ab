"""The scheduler's own queues: requests accepted but not yet sent to a worker, one queue per class
per model, in the engine's order (meshserve.shared.engine.policy): arrival order within a size
bucket, shorter prompts first, a request overtaken by later ones of its class whose prompts add
up to OVERTAKE_FACTOR times its own ranked as the shortest (`overtaken_enough`). Before that
order comes the tenants' fair share, when the caller gives one (admission.FairShare): the request
of the tenant served least so far goes first, so a tenant that queued a thousand requests does not
hold back another's one. With fcfs, one first-come-first-served queue per model.

Pure bookkeeping: the scheduler decides what leaves (routing.py says where it may go).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from meshserve.shared.engine.policy import PRIORITIES, overtaken_enough, size_bucket
from meshserve.shared.schemas import GenerateRequest

@dataclass
class Queued:
    req: GenerateRequest
    order: int
    since: float = field(default_factory=time.monotonic)
    overtaken_tokens: float = 0.0  # prompt tokens of later requests of its class that left before it

    @property
    def priority(self) -> str:
        return self.req.priority

    @property
    def tokens(self) -> int:
        return len(self.req.prompt_token_ids) + len(self.req.output_token_ids)

    def key(self, short_first: bool) -> tuple[int, int]:
        if not short_first or overtaken_enough(self.overtaken_tokens, self.tokens):
            return 0, self.order
        return size_bucket(self.tokens), self.order


class ClassQueues:
    """One model's waiting requests."""

    def __init__(self, fcfs: bool = False):
        self.fcfs = fcfs
        self.queues: dict[str, list[Queued]] = {p: [] for p in PRIORITIES}
        self._next = 0
        self.tenants: dict[str | None, int] = {}  # tenant -> its requests waiting here

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __iter__(self):
        """Every waiting request (a copy: safe to remove while iterating)."""
        return iter([x for q in self.queues.values() for x in q])

    def count(self, priority: str) -> int:
        """Requests of that class waiting here (with fcfs too, though they share one queue)."""
        return len(self.queues[priority]) if not self.fcfs else sum(
            1 for q in self.queues.values() for x in q if x.priority == priority)

    def counts(self) -> dict[str, int]:
        return {p: self.count(p) for p in PRIORITIES}

    def push(self, req: GenerateRequest, first: bool = False) -> None:
        """first: ahead of every request of its class (one that a worker did not take)."""
        q = self.queues["normal" if self.fcfs else req.priority]
        q.append(Queued(req, -self._next if first else self._next, overtaken_tokens=math.inf if first else 0.0))
        self._next += 1
        self.tenants[req.tenant] = self.tenants.get(req.tenant, 0) + 1

    def _left(self, req: GenerateRequest) -> None:
        n = self.tenants.get(req.tenant, 0) - 1
        if n > 0:
            self.tenants[req.tenant] = n
        else:
            self.tenants.pop(req.tenant, None)

    def heads(self, share: Callable[[str | None], float] | None = None) -> list[Queued]:
        """The next request of each class, best class first (fcfs: the oldest request). `share`: how
        much a tenant (None: no tenant) was served; the least goes first (not with fcfs)."""
        def key(x: Queued) -> tuple:
            return (share(x.req.tenant) if share is not None and not self.fcfs else 0, *x.key(not self.fcfs))

        return [min(q, key=key) for q in self.queues.values() if q]

    def pop(self, item: Queued) -> None:
        q = self.queues["normal" if self.fcfs else item.priority]
        q.remove(item)
        self._left(item.req)
        for x in q:
            if x.order < item.order:
                x.overtaken_tokens += item.tokens

    def remove(self, request_id: str) -> bool:
        for q in self.queues.values():
            for x in q:
                if x.req.request_id == request_id:
                    q.remove(x)
                    self._left(x.req)
                    return True
        return False
