"""Which model each worker serves (many models on one mesh, docs/models.md).

Workers are generic: the scheduler tells an idle one to switch model (`<ns>.worker.<id>.model`)
when a model of the manifest has requests queued here and no worker serving it. The worker it
picks has nothing assigned or running, serves a model with nothing queued, and among those one on a
node whose loader holds the model in the hottest tier (mapped, then host, then disk: prewarm.py
brings models up ahead of their requests), then the one whose model has other workers, then the
least recently used model. While the switch runs the
worker is routed nothing; a switch that fails is remembered for `retry_s`, during which the
model's requests are refused with the reason (the queued ones fail with it at once).

`pick_worker` is pure; `Placement` keeps the switches in flight, the failures and the last use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .routing import WorkerView


def idle(w: WorkerView) -> bool:
    """Nothing assigned or running, and not draining (about to exit)."""
    return not w.assigned and w.hb.num_running == 0 and w.hb.num_waiting == 0 and not w.hb.draining


def pick_worker(workers: list[WorkerView], queued: dict[str, int], last_used: dict[str, float],
                switching: set[str], tier_on: dict[str, str] | None = None) -> WorkerView | None:
    """The worker to switch to a model that has none, or None (every worker is busy: it waits).
    `tier_on`: the model's tier on each node (its loader's status): a node holding it hotter first."""
    per_model: dict[str, int] = {}
    for w in workers:
        per_model[w.hb.model] = per_model.get(w.hb.model, 0) + 1
    free = [w for w in workers if w.hb.worker_id not in switching and idle(w) and not queued.get(w.hb.model)]
    tier = lambda w: TIER_ORDER.index((tier_on or {}).get(w.hb.node_id, "disk"))  # noqa: E731
    return min(free, key=lambda w: (tier(w), per_model[w.hb.model] <= 1, last_used.get(w.hb.model, 0.0),
                                    w.hb.worker_id), default=None)


def tiers_by_node(loaders: dict[str, dict], name: str) -> dict[str, str]:
    """The model's tier on each node whose loader reported it."""
    return {node: m["tier"] for node, st in loaders.items() for m in st.get("models", []) if m["name"] == name}


@dataclass
class Placement:
    retry_s: float = 10.0
    switching: dict[str, str] = field(default_factory=dict)  # worker id -> the model it is switching to
    failed: dict[str, tuple[str, float]] = field(default_factory=dict)  # model -> (why, when)
    last_used: dict[str, float] = field(default_factory=dict)  # model -> last request sent to a worker
    switches: int = 0
    history: list[dict] = field(default_factory=list)  # the last switches, for status

    def used(self, model: str) -> None:
        self.last_used[model] = time.monotonic()

    def failure(self, model: str) -> str | None:
        f = self.failed.get(model)
        if f is None or time.monotonic() - f[1] > self.retry_s:
            return None
        return f[0]

    def finished(self, worker: str, model: str, from_model: str, ok: bool, seconds: float, tier: str | None,
                 error: str | None) -> None:
        self.switching.pop(worker, None)
        if ok:
            self.failed.pop(model, None)
            self.switches += 1
        else:
            self.failed[model] = (error or "unknown error", time.monotonic())
        self.history = (self.history + [{"worker": worker, "from": from_model, "to": model, "ok": ok,
                                         "seconds": round(seconds, 3), "tier": tier, "error": error}])[-16:]


TIER_ORDER = ("mapped", "loading", "host", "disk", "failed")


def model_states(names: list[str], workers: list[WorkerView], placement: Placement,
                 loaders: dict[str, dict]) -> dict[str, dict]:
    """Each model's state for /v1/models: failed (and why) > loading > the hottest loader tier of
    any node (mapped, host, disk); a model no loader has seen is on disk."""
    out = {}
    for name in names:
        tiers, load_s = [], {}
        for st in loaders.values():
            for m in st.get("models", []):
                if m["name"] == name:
                    tiers.append(m["tier"])
                    load_s.update(m.get("load_s", {}))
                    if m["tier"] == "failed" and m.get("error"):
                        err = m["error"]
        serving = sum(1 for w in workers if w.hb.model == name and w.hb.worker_id not in placement.switching)
        why = placement.failure(name)
        if why is not None:
            state = "failed"
        elif name in placement.switching.values():
            state = "loading"
        else:
            state = min(tiers, key=TIER_ORDER.index) if tiers else "disk"
            if state == "failed":
                why = err
            if serving and state in ("host", "disk"):
                state = "mapped"  # a worker still maps it (the loader evicts no model in use)
        out[name] = {"state": state, "error": why, "workers": serving, "load_times_s": load_s}
    return out
