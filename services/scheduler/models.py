"""Which model each worker serves (many models on one mesh, docs/models.md).

Workers are generic; the scheduler tells one to switch model (`<ns>.worker.<id>.model`) for one of
three reasons, each switch in its status with it ("removed": its model left the manifest, main.py):

- "no worker": a model of the manifest has requests queued here and no worker serving it
  (`pick_worker`). The worker it picks has nothing assigned or running, serves a model with
  nothing queued, and among those one on a node whose loader holds the model in the hottest tier
  (mapped, then host, then disk: prewarm.py brings models up ahead of their requests), then the one
  whose model has other workers, then the least recently used model. When every worker is busy, a
  busy one of a model that keeps another worker is told instead: it takes nothing new and switches
  once its sequences are done.
- "traffic": a model's worker count follows its traffic (`rebalance`, `pick_donor`, `ModelTraffic`).
  A model's load is the work its requests in the mesh still hold (queued here, on a worker, or in
  a handoff), in the token-equivalents of the elastic roles (prompt tokens to compute, plus output
  tokens still to generate weighed by what they cost next to a prompt token, as its workers
  measured: `model_work`), averaged over `window_s`:
  three long prompts outweigh thirty short chats, which a count of requests would not see. When a
  model's load per worker exceeds another's by `margin` and the move would not be undone by the
  same rule right after (see `rebalance`), one worker of the over-served model moves to the
  under-served one, if the receiving model's workers would still have `min_per_worker` requests
  each (light traffic moves nothing, and a worker is never moved to a model with fewer requests
  than workers: one sequence runs on one worker). A model keeps at least one
  worker while it has requests, had one lately (prewarm's rate: about 35 s), or is pinned. The
  wish must hold for `hold_s`; one traffic move runs at a time, `cooldown_s` after the last one
  ended; a worker that changed model stays before traffic moves it again, `amortize` times as long
  as its switch took (its measured cost: the switch then takes at most 1/amortize of its time), at
  least `min_stay_s` (`failed_stay_s` after a switch that failed). The
  worker moved is the idle one, else the least busy, not a model's last decode-capable worker while
  a choice remains, on a node that holds the receiving model in the hottest tier. These are the
  ideas of the elastic roles (roles.py, whose `Held` this uses), which go on within each model.

While a switch runs the worker is routed nothing (it finishes what it runs, then switches); a
"no worker" switch that fails is remembered for `retry_s`, during which the model's requests are
refused with the reason (the queued ones fail with it at once). A "traffic" switch that fails only
leaves the worker where it was: the model is served elsewhere.

`pick_worker`, `rebalance` and `pick_donor` are pure; `Placement` keeps the switches in flight, the
failures and the last use, `ModelTraffic` the demand and the timing of traffic moves.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from meshserve.shared.schemas import GenerateRequest

from .roles import Held, RolePolicy, token_cost, work
from .routing import WorkerView

NO_WORKER, TRAFFIC, REMOVED = "no worker", "traffic", "removed"  # why a worker switches model


def idle(w: WorkerView) -> bool:
    """Nothing assigned or running, and not draining (about to exit)."""
    return not w.assigned and w.hb.num_running == 0 and w.hb.num_waiting == 0 and not w.hb.draining


def serving_counts(workers: list[WorkerView], switching) -> dict[str, int]:
    """Workers serving each model: neither switching to another nor draining."""
    out: dict[str, int] = {}
    for w in workers:
        if w.hb.worker_id not in switching and not w.hb.draining:
            out[w.hb.model] = out.get(w.hb.model, 0) + 1
    return out


def pick_worker(workers: list[WorkerView], queued: dict[str, int], last_used: dict[str, float],
                switching: set[str], tier_on: dict[str, str] | None = None) -> WorkerView | None:
    """The worker to switch to a model that has none, or None (every worker is busy and the only one
    of its model: it waits). `tier_on`: the model's tier on each node (its loader's status): a node
    holding it hotter first."""
    per_model = serving_counts(workers, switching)
    tier = lambda w: TIER_ORDER.index((tier_on or {}).get(w.hb.node_id, "disk"))  # noqa: E731
    free = [w for w in workers if w.hb.worker_id not in switching and idle(w) and not queued.get(w.hb.model)]
    if free:
        return min(free, key=lambda w: (tier(w), per_model.get(w.hb.model, 0) <= 1, last_used.get(w.hb.model, 0.0),
                                        w.hb.worker_id))
    # Every worker is busy: one of a model that keeps another worker finishes what it runs, then switches.
    busy = [w for w in workers if w.hb.worker_id not in switching and not w.hb.draining
            and per_model.get(w.hb.model, 0) >= 2]
    return min(busy, key=lambda w: (tier(w), _busy(w), last_used.get(w.hb.model, 0.0), w.hb.worker_id), default=None)


def _busy(w: WorkerView) -> int:
    """What a worker must finish before it can switch: its sequences and those sent to it."""
    return max(len(w.assigned), w.hb.num_running + w.hb.num_waiting)


@dataclass(frozen=True)
class TrafficPolicy:
    margin: float = 1.5  # a model's requests per worker must exceed another's this many times (hysteresis)
    min_per_worker: float = 1.0  # the receiving model's requests per worker after the move, at least
    window_s: float = 5.0  # the demand: requests in the mesh, averaged over about this long
    hold_s: float = 2.0  # a wish must hold this long before it becomes a move
    cooldown_s: float = 5.0  # between two traffic moves (the next one sees what the last one did)
    amortize: float = 10.0  # a worker that changed model stays this many times as long as its switch took
    min_stay_s: float = 2.0  # ... and at least this long (the hold: a wish outlives a heartbeat or two)
    failed_stay_s: float = 30.0  # ... and this long after a switch that failed (its cost is not known)

    def stay_s(self, switch_s: float | None) -> float:
        """How long a worker whose last switch took switch_s (None: it failed) stays before traffic moves it."""
        return self.failed_stay_s if switch_s is None else max(self.min_stay_s, self.amortize * switch_s)

    @classmethod
    def parse(cls, text: str) -> "TrafficPolicy":
        """`key=value,...` over the defaults (`--model-traffic-policy`); ValueError saying which key
        or value is wrong. The margin must be above 1 (else two models could trade a worker back and
        forth), the rest at least 0."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for item in filter(None, (i.strip() for i in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"{item!r}: expected key=value with key one of {', '.join(names)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"{key}={value!r}: not a number") from None
            if values[key] < 0 or (key == "margin" and values[key] <= 1.0) or not math.isfinite(values[key]):
                raise ValueError(f"{key}={value}: must be {'above 1' if key == 'margin' else 'a number >= 0'}")
        return cls(**values)


@dataclass(frozen=True)
class ModelDemand:
    """One model as `rebalance` sees it."""

    name: str
    demand: float  # requests queued or running, averaged over the policy's window
    workers: int  # serving it (not switching away, not draining)
    movable: int = 0  # of those, workers traffic may move now (not just switched, no role switch in flight)
    keep: bool = False  # it keeps its last worker: it has requests, had one lately, or is pinned
    receives: bool = True  # it may be given a worker (nothing is switching to it, its loads do not fail)
    work: float | None = None  # token-equivalents its requests still hold, averaged (None: compare requests)

    @property
    def load(self) -> float:
        """What `rebalance` divides among the workers: the work, else the requests."""
        return self.demand if self.work is None else self.work


@dataclass(frozen=True)
class Move:
    """A worker of `src` to become one of `dst`."""

    src: str
    dst: str
    reason: str


def rebalance(models: list[ModelDemand], policy: TrafficPolicy) -> Move | None:
    """The model pair whose traffic asks for a worker to move, or None. With L, r and w a model's
    load (its work, or its requests where the work is not known), requests and workers, a worker of
    `src` goes to `dst` when

    - L_dst / w_dst > margin x L_src / w_src (dst is the busier per worker, by the margin),
    - r_dst / (w_dst + 1) >= min_per_worker (dst's workers stay busy after the move), and
    - not L_src / (w_src - 1) > margin x L_dst / (w_dst + 1): the same rule would not move it back
      at once, so a steady load never flaps. A src that keeps its last worker needs two.

    Among the pairs that qualify, the largest gap in load per worker, then names."""
    best = None
    for dst in models:
        if not dst.receives or dst.workers < 1:
            continue  # a model without workers gets one when it has requests queued (pick_worker)
        if dst.demand / (dst.workers + 1) < policy.min_per_worker:
            continue
        after_dst = dst.load / (dst.workers + 1)
        for src in models:
            if src is dst or src.movable < 1 or src.workers < (2 if src.keep else 1):
                continue
            per_src = src.load / src.workers
            if not dst.load / dst.workers > policy.margin * per_src:
                continue
            if src.workers > 1 and src.load / (src.workers - 1) > policy.margin * after_dst:
                continue  # it would come straight back
            gap = dst.load / dst.workers - per_src
            key = (-gap, dst.name, src.name)
            if best is None or key < best[0]:
                best = (key, Move(src.name, dst.name, f"{_said(dst)}, {_said(src, short=True)}"))
    return None if best is None else best[1]


def _said(x: ModelDemand, short: bool = False) -> str:
    work = "" if x.work is None else f" ({x.work:.0f} token-equivalents)"
    return f"{x.name}: {x.demand:.1f}{'' if short else ' requests'}{work} on {x.workers}{'' if short else ' workers'}"


def model_work(workers: list[WorkerView], unplaced: list[GenerateRequest], policy: RolePolicy) -> dict[str, float]:
    """The work each model's requests still hold, in token-equivalents (roles.py `work`, an output
    token weighed by the rates the model's workers measured, `token_cost`): what its workers'
    heartbeats report pending (their engines' sequences and inboxes), plus the requests no worker
    holds (queued here, or between a prefill and a decode worker), each at its whole prompt and
    max_tokens."""
    mine: dict[str, list[WorkerView]] = {}
    for w in workers:
        mine.setdefault(w.hb.model, []).append(w)
    cost = {m: token_cost([w.hb.prefill_tokens_per_s for w in ws], [w.hb.decode_tokens_per_s for w in ws], policy)
            for m, ws in mine.items()}
    out: dict[str, float] = {}
    for w in workers:
        out[w.hb.model] = out.get(w.hb.model, 0.0) + work(w.hb.pending_prefill_tokens, w.hb.pending_decode_tokens,
                                                          cost[w.hb.model])
    for r in unplaced:
        out[r.model] = out.get(r.model, 0.0) + work(len(r.prompt_token_ids) + len(r.output_token_ids),
                                                    max(0, r.sampling.max_tokens - len(r.output_token_ids)),
                                                    cost.get(r.model, policy.decode_token_cost))
    return out


def pick_donor(workers: list[WorkerView], model: str, skip: set[str],
               tier_on: dict[str, str] | None = None) -> WorkerView | None:
    """The worker of `model` to move (`skip`: switching, just switched, or changing role): the idle,
    else the least busy; not the model's last decode-capable worker while another would do; then
    one on a node holding the receiving model in the hottest tier (`tier_on`, as in pick_worker)."""
    mine = [w for w in workers if w.hb.model == model and not w.hb.draining]
    decoders = sum(1 for w in mine if w.hb.role in ("decode", "mixed"))
    tier = lambda w: TIER_ORDER.index((tier_on or {}).get(w.hb.node_id, "disk"))  # noqa: E731
    last_decoder = lambda w: w.hb.role in ("decode", "mixed") and decoders == 1 and len(mine) > 1  # noqa: E731
    cands = [w for w in mine if w.hb.worker_id not in skip]
    return min(cands, key=lambda w: (last_decoder(w), not idle(w), _busy(w), tier(w), w.hb.worker_id), default=None)


class Demand:
    """Each model's requests in the mesh, an exponential moving average over about `window_s`
    (sampled at each of the scheduler's rounds; a model starts at 0)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.level: dict[str, float] = {}
        self.at: float | None = None

    def observe(self, counts: dict[str, int], now: float) -> None:
        a = 0.0 if self.at is None else 1.0 - math.exp(-max(0.0, now - self.at) / self.window_s)
        for m in set(counts) | set(self.level):
            x = self.level.get(m, 0.0)
            self.level[m] = x + a * (counts.get(m, 0) - x)
        self.at = now

    def get(self, model: str) -> float:
        return self.level.get(model, 0.0)


@dataclass
class ModelTraffic:
    """Time around `rebalance`: the demand's average, the hold, the cooldown between moves."""

    policy: TrafficPolicy = field(default_factory=TrafficPolicy)
    enabled: bool = True
    demand: Demand = field(init=False)  # requests in the mesh, averaged over the policy's window
    work: Demand = field(init=False)  # the work they hold (model_work), likewise
    _wish: Held = field(default_factory=Held)
    _last: float = -math.inf  # when the last traffic move was ordered

    def __post_init__(self):
        self.demand = Demand(self.policy.window_s)
        self.work = Demand(self.policy.window_s)

    def observe(self, models: list[ModelDemand], in_flight: bool, now: float) -> Move | None:
        """The move to order now, or None. `models` carry this round's demand; `in_flight`: a
        traffic move is still running (none starts meanwhile; the cooldown counts from its end)."""
        if in_flight:
            self._last = now
        if not self.enabled or in_flight or now - self._last < self.policy.cooldown_s:
            self._wish.clear("mesh")
            return None
        want = rebalance(models, self.policy)
        if not self._wish.ready("mesh", None if want is None else (want.src, want.dst), now, self.policy.hold_s):
            return None
        self._last = now
        return want


def tiers_by_node(loaders: dict[str, dict], name: str) -> dict[str, str]:
    """The model's tier on each node whose loader reported it."""
    return {node: m["tier"] for node, st in loaders.items() for m in st.get("models", []) if m["name"] == name}


@dataclass
class Placement:
    retry_s: float = 10.0
    switching: dict[str, str] = field(default_factory=dict)  # worker id -> the model it is switching to
    reasons: dict[str, str] = field(default_factory=dict)  # worker id -> why it switches (NO_WORKER, TRAFFIC, ...)
    failed: dict[str, tuple[str, float]] = field(default_factory=dict)  # model -> (why, when)
    last_used: dict[str, float] = field(default_factory=dict)  # model -> last request sent to a worker
    switched_at: dict[str, float] = field(default_factory=dict)  # worker id -> when its last switch ended
    switch_s: dict[str, float | None] = field(default_factory=dict)  # worker id -> its last switch in s (None: failed)
    switches: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)  # completed switches by reason
    history: list[dict] = field(default_factory=list)  # the last switches, for status

    def used(self, model: str) -> None:
        self.last_used[model] = time.monotonic()

    def failure(self, model: str) -> str | None:
        f = self.failed.get(model)
        if f is None or time.monotonic() - f[1] > self.retry_s:
            return None
        return f[0]

    def start(self, worker: str, model: str, reason: str) -> None:
        self.switching[worker], self.reasons[worker] = model, reason

    def cancel(self, worker: str) -> None:
        """The worker did not try (it is draining)."""
        self.switching.pop(worker, None)
        self.reasons.pop(worker, None)

    def traffic_in_flight(self) -> bool:
        return TRAFFIC in self.reasons.values()

    def settling(self, policy: TrafficPolicy) -> set[str]:
        """Workers that changed model too recently for traffic to move them (`TrafficPolicy.stay_s`)."""
        now = time.monotonic()
        return {w for w, t in self.switched_at.items() if now - t < policy.stay_s(self.switch_s.get(w))}

    def finished(self, worker: str, model: str, from_model: str, ok: bool, seconds: float, tier: str | None,
                 error: str | None, detail: str = "") -> None:
        """`detail`: the numbers behind the reason. Only a failed "no worker" switch makes the model
        failed (refused for retry_s): after a failed traffic move it is still served where it was."""
        self.switching.pop(worker, None)
        reason = self.reasons.pop(worker, NO_WORKER)
        self.switched_at[worker] = time.monotonic()
        self.switch_s[worker] = seconds if ok else None
        if ok:
            self.failed.pop(model, None)
            self.switches += 1
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        elif reason != TRAFFIC:
            self.failed[model] = (error or "unknown error", time.monotonic())
        self.history = (self.history + [{"worker": worker, "from": from_model, "to": model, "ok": ok,
                                         "reason": reason, "detail": detail, "seconds": round(seconds, 3),
                                         "tier": tier, "error": error}])[-16:]


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
        elif name in placement.switching.values() and not serving:  # a served model gaining a worker is not
            state = "loading"
        else:
            state = min(tiers, key=TIER_ORDER.index) if tiers else "disk"
            if state == "failed":
                why = err
            if serving and state in ("host", "disk"):
                state = "mapped"  # a worker still maps it (the loader evicts no model in use)
        out[name] = {"state": state, "error": why, "workers": serving, "load_times_s": load_s}
    return out
