"""Prewarm: models that their recent request rates predict are brought up a tier before they are asked for.

The scheduler counts each model's requests in an exponentially decayed rate (`Rates`: requests per
second, half-life `HALF_LIFE_S`). After each refresh of the loaders' status (every second) it asks
`plan` what to move on each node and sends that node's loader one `PrewarmRequest` per move
(`<ns>.models.<node>.prewarm`). `plan` is pure, over the rates and one node's tiers:

- a model of the manifest whose rate is at least `MIN_RATE`, in the host or disk tier, goes up one
  tier: host -> mapped; disk -> host, or mapped when the node keeps no host tier;
- it goes if that tier has room for it (its budget less what it holds; a model never loaded counts
  as large as the largest one known);
- else only if its rate is above `MARGIN` times the coldest model resident there (neither pinned nor
  mapped by a worker), which the loader moves down first (`evict`); the margin keeps two models of
  similar rates from trading places back and forth;
- the hottest first, at most one move into each tier per round (the next round sees the new tiers).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

HALF_LIFE_S = 30.0
MIN_RATE = 0.01  # requests per second (a request ~30 s ago, or a few in the last minutes)
MARGIN = 1.5


class Rates:
    """Each model's request rate, exponentially decayed."""

    def __init__(self, half_life_s: float = HALF_LIFE_S):
        self.decay = math.log(2) / half_life_s
        self.level: dict[str, tuple[float, float]] = {}  # model -> (decayed count, when)

    def hit(self, model: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.level[model] = (self._count(model, now) + 1.0, now)

    def _count(self, model: str, now: float) -> float:
        count, at = self.level.get(model, (0.0, now))
        return count * math.exp(-self.decay * (now - at))

    def rate(self, model: str, now: float | None = None) -> float:
        """Requests per second: a steady rate r gives a decayed count of r / decay."""
        return self._count(model, time.monotonic() if now is None else now) * self.decay

    def all(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        return {m: self.rate(m, now) for m in self.level}


@dataclass(frozen=True)
class Resident:
    """One model as one node's loader reports it."""

    name: str
    tier: str  # mapped | host | disk | loading | failed
    nbytes: int = 0
    pinned: bool = False
    in_use: bool = False  # a worker maps it


@dataclass(frozen=True)
class Move:
    name: str
    to: str  # mapped | host
    evict: tuple[str, ...] = ()


def plan(rates: dict[str, float], models: list[Resident], weights_budget: int | None, host_budget: int,
         max_mapped: int) -> list[Move]:
    """The moves for one node this round (see the module docstring)."""
    rate = lambda m: rates.get(m.name, 0.0)  # noqa: E731
    guess = max((m.nbytes for m in models), default=0)
    held = {t: [m for m in models if m.tier == t] for t in ("mapped", "host")}

    def fits(tier: str, size: int, without: Resident | None = None) -> bool:
        there = [m for m in held[tier] if m is not without]
        used = sum(m.nbytes for m in there) + size
        if tier == "mapped":
            return len(there) < max_mapped and (weights_budget is None or used <= weights_budget)
        return used <= host_budget

    moves: list[Move] = []
    for m in sorted((m for m in models if m.tier in ("host", "disk")), key=lambda m: (-rate(m), m.name)):
        if rate(m) < MIN_RATE:
            break
        to = "mapped" if m.tier == "host" or host_budget <= 0 else "host"
        if any(x.to == to for x in moves):
            continue
        size = m.nbytes or guess
        if fits(to, size):
            moves.append(Move(m.name, to))
            continue
        victims = [v for v in held[to] if not v.pinned and not v.in_use]
        coldest = min(victims, key=lambda v: (rate(v), v.name), default=None)
        if coldest is not None and rate(m) > MARGIN * rate(coldest) and fits(to, size, without=coldest):
            moves.append(Move(m.name, to, (coldest.name,)))
    return moves


def residents(status: dict, ids: list[str]) -> list[Resident]:
    """A loader's status as `plan` reads it: the manifest's models (`ids`), those it never saw on disk."""
    seen = {m["name"]: m for m in status.get("models", [])}
    out = []
    for name in ids:
        m = seen.get(name)
        out.append(Resident(name, "disk") if m is None else
                   Resident(name, m["tier"], m.get("bytes", 0), m.get("pinned", False), bool(m.get("users"))))
    return out
