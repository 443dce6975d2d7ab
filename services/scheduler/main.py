"""`meshserve serve scheduler`: admits requests, routes them to workers, moves prefilled
sequences to decode workers, and re-dispatches the requests of workers that disappear.

It owns the queues (queues.py: one per class per model) and admits from them into workers as
they have room (routing.py), so a request is never parked behind a busy worker while another
could start it: an interactive request goes at once to the worker that can start it soonest
(its engine preempts normal and background sequences there); a normal one when a worker has
room, or, after `--normal-max-queue-s` here, to a worker with no normal request waiting (its
engine's guaranteed share then admits it); a background one only into room. With
`--scheduling fcfs`, one first-come-first-served queue, every request only into room.

A decode worker on the prefill's node gets the sequence's blocks by id (the kv-pool moves one
reference); one on another node pulls their bytes through its own kv-pool first (cross-node).

With a tenants file (`--tenants`), it admits each new request against its tenant's quotas and
its class's queue bound first (admission.py) and answers a refusal with its status (429, 503).

Elastic roles (roles.py; `--fixed-roles` pins them): with two or more workers of a model on a
node, it switches a worker between prefill and decode when the pending prompt tokens and the output
tokens still to generate call for another split, with hysteresis, telling the worker on
`<ns>.worker.<id>.role`; the worker confirms in a heartbeat.

Many models (models.py, `--models`): a model with requests queued and no worker gets one ("no
worker"), and a model's worker count follows its traffic ("traffic"; `--fixed-model-workers` turns
that off), telling the worker on `<ns>.worker.<id>.model`.

It never sees tokens: the gateway owns each stream. When a worker goes silent, the scheduler
tells the gateway of each of its requests ("worker_lost"); the gateway re-submits with the
tokens the client already has, and a new worker recomputes and continues from there.

Its state is soft: a restarted scheduler rebuilds its view of the workers from their heartbeats
(it takes submissions only once it has heard them, or after --worker-timeout), and announces its
new id every second on `scheduler.hello`; each gateway then re-submits the requests an older
scheduler accepted, as a new attempt (docs/faults.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import signal
import time
import uuid
from dataclasses import dataclass

import nats.errors
import orjson

from meshserve.shared.bus import Bus
from meshserve.shared.engine.policy import add_scheduling_arguments
from meshserve.shared.limits import LimitError, check_context_length
from meshserve.shared.prefix_hash import namespace, prompt_block_hashes
from meshserve.shared.schemas import (KEEPALIVE_S, NOT_READY, Abort, BlockRefs, BlockTransfer, Done, GenerateRequest,
                                      Handoff, Heartbeat, KVEvent, ModelSwitch, ModelSwitchReply, PrewarmRequest,
                                      RoleSwitch, ServiceHello, SubmitReply, TokenChunk, TransferReply, Usage)
from meshserve.shared.service import run_service
from meshserve.shared.telemetry import span
from meshserve.shared.tenants import load_tenants

from meshserve.shared.manifest import Manifest, ServedModel, load_manifest

from .admission import Admission, waiting_by_class
from .models import (NO_WORKER, REMOVED, TRAFFIC, ModelDemand, ModelTraffic, Placement, TrafficPolicy, idle,
                     model_states, model_work, pick_donor, pick_worker, serving_counts, tiers_by_node)
from .prewarm import MIN_RATE, Rates, plan, residents
from .queues import ClassQueues
from .roles import ElasticRoles, Load, RolePolicy
from .routing import (WorkerView, pick_admission, pick_decode, pick_idle_for_short_prompt, pick_soonest,
                      spill_candidates, waiting_there)

log = logging.getLogger("meshserve.scheduler")

HELLO_INTERVAL = 1.0
DELIVERY_TIMEOUT = 3.0  # a worker acknowledges a request or a handoff within this (its event loop is free)


@dataclass
class Tracked:
    req: GenerateRequest
    worker: str | None  # who has it now (None: queued here, or in a handoff between workers)
    aborted: bool = False  # the gateway aborted it while a worker had it: its handoff goes nowhere


def _role_group(node: str, model: str) -> str:
    """The workers whose roles are balanced together: one model's on one node."""
    return f"{node}/{model}"


def _by_priority(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


COUNTERS = ("prefix_queries", "prefix_hits", "num_preemptions", "preemptions_by_mode", "spec_decode")


def _totals(ws: list[WorkerView], queues, counters: list[dict]) -> dict:
    """What /metrics shows: requests running and waiting (on these workers and in these queues),
    the share of their arenas' blocks they hold, and the sums of the workers' `counters`."""
    arenas = {(w.hb.node_id, w.hb.arena): w.hb.total_blocks for w in ws}
    return {"num_running": sum(w.hb.num_running for w in ws),
            "num_waiting": sum(w.hb.num_waiting for w in ws) + sum(len(q) for q in queues),
            "kv_usage": sum(w.hb.held_blocks - w.hb.free_blocks for w in ws) / max(sum(arenas.values()), 1),
            "prefix_queries": sum(c.get("prefix_queries", 0) for c in counters),
            "prefix_hits": sum(c.get("prefix_hits", 0) for c in counters),
            "num_preemptions": sum(c.get("num_preemptions", 0) for c in counters),
            "preemptions_by_mode": {"swap": 0, "recompute": 0} | _by_priority(c.get("preemptions_by_mode", {})
                                                                                for c in counters),
            "spec_decode": _by_priority(c.get("spec_decode", {}) for c in counters)}


class Scheduler:
    def __init__(self, bus: Bus, args):
        self.bus, self.args = bus, args
        self.workers: dict[str, WorkerView] = {}
        self.requests: dict[str, Tracked] = {}
        self.id = uuid.uuid4().hex  # new at each start: the gateways re-submit what an older one held
        self.tasks: set[asyncio.Task] = set()  # deliveries waiting for their acknowledgement
        tenants = getattr(args, "tenants", None)
        self.admission = Admission(load_tenants(tenants) if tenants else None)
        self.fair_share = self.admission.enabled and getattr(args, "fair_share", True)
        cost = getattr(args, "decode_token_cost", None)
        self.roles = ElasticRoles(RolePolicy() if cost is None else RolePolicy(decode_token_cost=cost, measured=False),
                                  enabled=not getattr(args, "fixed_roles", False))
        self.fcfs = getattr(args, "scheduling", "priority") == "fcfs"
        self.queues: dict[str, ClassQueues] = {}  # model -> its requests waiting for a worker
        self.queue_wait = {"count": 0, "total_s": 0.0, "max_s": 0.0}  # of the requests sent to workers
        self.manifest_path = getattr(args, "models", None)
        self.manifest: Manifest | None = load_manifest(self.manifest_path) if self.manifest_path else None
        self.placement = Placement()  # which worker serves which model (models.py)
        self.traffic = ModelTraffic(getattr(args, "model_traffic_policy", None) or TrafficPolicy(),
                                    enabled=not getattr(args, "fixed_model_workers", False))
        self.loaders: dict[str, dict] = {}  # node -> its model-loader's status (tiers)
        self._loaders_at = 0.0  # when the loaders' status was last asked
        self._kept_alive_at = time.monotonic()  # when the queued requests' gateways last heard of them
        self.rates = Rates()  # each model's decayed request rate, for prewarm (prewarm.py)
        self.prewarming: set[str] = set()  # nodes whose loader is prewarming now
        self.prewarms: list[dict] = []  # the last prewarms, for status
        self.kv_models: dict[str, dict] = {}  # node -> its kv-pool's blocks per model (memory quotas)
        self._kv_at = 0.0
        self._kv_task: asyncio.Task | None = None

    # -- views

    def alive(self, model: str, roles: tuple[str, ...]) -> list[WorkerView]:
        return [w for w in self.workers.values()
                if self.role_of(w) in roles and w.hb.model == model and not w.hb.draining
                and w.hb.worker_id not in self.placement.switching]

    def role_of(self, w: WorkerView) -> str:
        """The role it is routed by: a worker told to switch counts in its new role at once."""
        return self.roles.role_of(w.hb.worker_id, w.hb.role)

    def prefill_candidates(self, model: str) -> list[WorkerView]:
        # Dedicated prefill workers first; with none, decode workers prefill too (mixed role).
        return self.alive(model, ("prefill", "mixed")) or self.alive(model, ("decode",))

    def decode_candidates(self, model: str) -> list[WorkerView]:
        return self.alive(model, ("decode", "mixed"))

    def status(self) -> dict:
        ws = list(self.workers.values())
        models = {w.hb.model for w in ws}
        ready = any(self.prefill_candidates(m) and (self.decode_candidates(m) or self.alive(m, ("prefill",)))
                    for m in models)
        return {"ready": ready,
                "workers": [{"id": w.hb.worker_id, "role": self.role_of(w), "model": w.hb.model,
                             "node_id": w.hb.node_id, "arena": w.hb.arena,
                             "running": w.hb.num_running, "waiting": w.hb.num_waiting,
                             "assigned": len(w.assigned),
                             "free_blocks": w.hb.free_blocks, "io_cpu_s": w.hb.io_cpu_s,
                             "tokens_streamed": w.hb.tokens_streamed,
                             "compute_yields": w.hb.compute_yields, "compute_yield_s": round(w.hb.compute_yield_s, 3),
                             "compute_claim": w.hb.compute_claim,
                             "interrupted_steps": w.hb.interrupted_steps, "threads": w.hb.threads,
                             "prefill_tokens_per_s": w.hb.prefill_tokens_per_s,
                             "decode_tokens_per_s": w.hb.decode_tokens_per_s} for w in ws],
                "scheduling": "fcfs" if self.fcfs else "priority",
                "queue_wait": dict(self.queue_wait),
                "queued_by_priority": {"interactive": 0, "normal": 0, "background": 0}
                | _by_priority(q.counts() for q in self.queues.values()),
                **_totals(ws, self.queues.values(), [w.hb.model_dump(include=set(COUNTERS)) for w in ws]),
                "by_model": self.totals_by_model(ws),
                "num_priority_preemptions": sum(w.hb.num_priority_preemptions for w in ws),
                "running_by_priority": _by_priority(w.hb.running_by_priority for w in ws),
                "waiting_by_priority": _by_priority(w.hb.waiting_by_priority for w in ws),
                "models": model_states(self.manifest.ids if self.manifest else sorted(models), ws, self.placement,
                                       self.loaders),
                "model_switches": self.placement.switches, "recent_model_switches": self.placement.history,
                "model_switches_by_reason": {NO_WORKER: 0, TRAFFIC: 0} | self.placement.by_reason,
                "model_workers_follow_traffic": self.traffic.enabled,
                "model_traffic_policy": dataclasses.asdict(self.traffic.policy),
                "model_demand": {m: round(d, 3) for m, d in sorted(self.traffic.demand.level.items())},
                "model_work": {m: round(d, 1) for m, d in sorted(self.traffic.work.level.items())},
                "settling_workers": sorted(self.placement.settling(self.traffic.policy)),
                "request_rates": {m: round(r, 4) for m, r in self.rates.all().items()},
                "recent_prewarms": self.prewarms,
                "loaders": self.loaders,
                "kv_by_model": self.kv_models,
                "elastic_roles": self.roles.enabled, "role_switches": self.roles.switches,
                "recent_role_switches": self.roles.history,
                **({"admission": {**self.admission.status(), "waiting_by_class": self.waiting_by_class()}}
                   if self.admission.enabled else {})}

    def totals_by_model(self, ws: list[WorkerView]) -> dict[str, dict]:
        """_totals per served name (a canary's versions and a model's variants together), the
        series /metrics labels with that name. A worker counts towards the model it serves now; its
        counters, towards each model it served."""
        def served(model: str) -> str:
            spec = self.spec(model)
            return spec.name if spec is not None else model

        groups: dict[str, tuple[list, list, list]] = {served(m): ([], [], []) for m in
                                                      (self.manifest.ids if self.manifest else ())}
        for w in ws:
            groups.setdefault(served(w.hb.model), ([], [], []))[0].append(w)
            for model, counts in w.hb.counters_by_model.items():
                groups.setdefault(served(model), ([], [], []))[2].append(counts)
        for model, q in self.queues.items():
            groups.setdefault(served(model), ([], [], []))[1].append(q)
        return {name: _totals(*group) for name, group in sorted(groups.items())}

    def waiting_by_class(self) -> dict[str, int]:
        """Requests waiting for a seat, by class: on some worker (admission.waiting_by_class) and in
        this scheduler's own queues."""
        def classes(w: WorkerView) -> list[str]:
            return [self.requests[r].req.priority for r in w.assigned if r in self.requests]

        out = waiting_by_class((classes(w), w.hb.max_num_seqs, w.hb.waiting_by_priority)
                               for w in self.workers.values())
        for q in self.queues.values():
            for c, n in q.counts().items():
                out[c] = out.get(c, 0) + n
        return out

    # -- requests

    async def submit(self, req: GenerateRequest) -> SubmitReply:
        req = self.resolve_model(req)
        cands = self.prefill_candidates(req.model)
        on_demand = not cands and self.spec(req.model) is not None and bool(self.workers)
        if on_demand:  # a model of the manifest no worker serves yet: it waits here while one switches to it
            why = self.placement.failure(req.model)
            if why is not None:
                return self._unavailable(req.model, why)
        elif not cands:
            known = sorted({w.hb.model for w in self.workers.values()} | set(self.manifest.ids if self.manifest
                                                                            else ()))
            if known and req.model not in known:
                return SubmitReply(ok=False, status_code=404, error=f"the model {req.model!r} does not exist; "
                                   f"served: {known}")
            return SubmitReply(ok=False, status_code=503, error="no worker is ready to serve this model yet",
                               error_type="server_error", error_code=NOT_READY)
        else:
            try:
                check_context_length(len(req.prompt_token_ids), req.sampling.max_tokens,
                                     min(w.hb.max_model_len for w in cands))
            except LimitError as e:
                return SubmitReply(ok=False, status_code=400, error=str(e))
        refusal = self.admission.admit(req, self.waiting_by_class)
        if refusal is not None:
            return refusal
        self.requests[req.request_id] = Tracked(req, None)
        if self.spec(req.model) is not None and not req.attempt:
            self.rates.hit(req.model)
        q = self.queues.setdefault(req.model, ClassQueues(self.fcfs))
        q.remove(req.request_id)  # an earlier attempt still queued here: the new one replaces it
        if self.admission.enabled and req.tenant is not None:
            self.admission.fair.waiting(req.tenant, {t for queued in self.queues.values() for t in queued.tenants})
        q.push(req)
        await self.dispatch(req.model)
        if on_demand:
            self.place_models()
        return SubmitReply(ok=True, scheduler_id=self.id)

    # -- many models (models.py): which worker serves which model

    def resolve_model(self, req: GenerateRequest) -> GenerateRequest:
        """A request that names a served name or alias rather than an entry's id (a gateway without
        the manifest) runs on the entry the gateway would have picked: a canary version by the
        shares, a variant by the request's class and tenant (Manifest.pick)."""
        if self.manifest is None or req.model in self.manifest.ids:
            return req
        spec = self.manifest.pick(req.model, random.random(), req.priority, req.tenant)
        return req if spec is None else req.model_copy(update={"model": spec.id})

    def spec(self, model: str) -> ServedModel | None:
        return self.manifest.get(model) if self.manifest is not None and model else None

    @staticmethod
    def _unavailable(model: str, why: str) -> SubmitReply:
        return SubmitReply(ok=False, status_code=503, error=f"the model {model!r} is unavailable: loading it failed: "
                           f"{why}", error_type="server_error", error_code="model_load_failed")

    def place_models(self) -> None:
        """Orders a model switch for each manifest model with requests queued here and no worker."""
        for model, q in list(self.queues.items()):
            spec = self.spec(model)
            if not q or spec is None or self.prefill_candidates(model) or model in self.placement.switching.values():
                continue
            why = self.placement.failure(model)
            if why is not None:
                self._fail_queued(model, why)
                continue
            w = pick_worker(list(self.workers.values()), {m: len(x) for m, x in self.queues.items()},
                            self.placement.last_used, set(self.placement.switching), tiers_by_node(self.loaders, model))
            if w is None:
                break  # every worker is busy: the next that idles is asked (done, reap)
            self.placement.start(w.hb.worker_id, model, NO_WORKER)
            self._spawn(self._switch(w, spec, f"{len(q)} requests queued for it"))
        self._retire_removed()

    def _retire_removed(self) -> None:
        """A worker left on a model the manifest no longer lists, once idle (its requests drained),
        switches to the listed model with the fewest workers, so the loader can unload the old one."""
        if self.manifest is None:
            return
        ids = self.manifest.ids
        for w in list(self.workers.values()):
            if w.hb.model in ids or w.hb.worker_id in self.placement.switching or not idle(w):
                continue
            serving = {m: sum(1 for x in self.workers.values() if x.hb.model == m) for m in ids}
            live = [m for m in self.manifest.models if self.placement.failure(m.id) is None] or list(self.manifest.models)
            spec = min(live, key=lambda m: (serving[m.id] + list(self.placement.switching.values()).count(m.id),
                                            ids.index(m.id)))
            self.placement.start(w.hb.worker_id, spec.id, REMOVED)
            self._spawn(self._switch(w, spec, f"{w.hb.model} is no longer in the manifest"))

    def balance_models(self) -> None:
        """A model's worker count follows its traffic: at most one worker moves at a time, when
        models.py's `rebalance` asks for it (hysteresis, hold, cooldown, a floor of one worker)."""
        if self.manifest is None:
            return
        now = time.monotonic()
        tracked: dict[str, int] = {}  # requests in the mesh: queued here, on a worker, or in a handoff
        for t in self.requests.values():
            tracked[t.req.model] = tracked.get(t.req.model, 0) + 1
        workers = list(self.workers.values())
        self.traffic.demand.observe(tracked, now)
        self.traffic.work.observe(model_work(workers, [t.req for t in self.requests.values() if t.worker is None],
                                             self.roles.policy), now)
        if not self.traffic.enabled or len(workers) < 2:
            return
        switching = self.placement.switching
        serving = serving_counts(workers, switching)
        skip = (set(switching) | self.placement.settling(self.traffic.policy)
                | {w.hb.worker_id for w in workers if self.roles.in_flight(w.hb.worker_id)})
        heading = set(switching.values())
        models = [ModelDemand(
            m.id, self.traffic.demand.get(m.id), serving.get(m.id, 0), work=self.traffic.work.get(m.id),
            movable=sum(1 for w in workers if w.hb.model == m.id and not w.hb.draining and w.hb.worker_id not in skip),
            keep=m.pinned or tracked.get(m.id, 0) > 0 or self.rates.rate(m.id, now) >= MIN_RATE,
            receives=m.id not in heading and self.placement.failure(m.id) is None) for m in self.manifest.models]
        move = self.traffic.observe(models, self.placement.traffic_in_flight(), now)
        if move is None:
            return
        w = pick_donor(workers, move.src, skip, tiers_by_node(self.loaders, move.dst))
        spec = self.spec(move.dst)
        if w is None or spec is None:
            return
        self.placement.start(w.hb.worker_id, move.dst, TRAFFIC)
        self._spawn(self._switch(w, spec, move.reason))

    async def _switch(self, w: WorkerView, spec: ServedModel, detail: str) -> None:
        """Tells the worker (routed nothing from now on) to switch once it has nothing assigned or
        running: a request or handoff still on its way to it would otherwise reach it after it
        switched, and run on the other model."""
        wid, old = w.hb.worker_id, w.hb.model
        reason = self.placement.reasons.get(wid, NO_WORKER)
        dtype = spec.dtype or self.args.dtype
        log.info("switching worker %s from model %s to %s (%s: %s)", wid, old, spec.id, reason, detail)
        if not await self._drained(wid):  # it left the mesh meanwhile
            self.placement.cancel(wid)
            self.place_models()
            return
        t0 = time.monotonic()
        try:
            reply = await self.bus.request(self.bus.subjects.worker(wid, "model"), ModelSwitch(
                name=spec.id, path=spec.path, dtype=dtype, quantization=spec.quantization,
                reason=f"{reason}: {detail}"), ModelSwitchReply, timeout=900)
        except Exception as e:  # noqa: BLE001 - the worker is gone or did not answer
            reply = ModelSwitchReply(ok=False, error=f"worker {wid} did not switch: {e}")
        if reply.refused:  # not the model's failure: another worker is asked
            self.placement.cancel(wid)
            self.place_models()
            return
        self.placement.finished(wid, spec.id, old, reply.ok, time.monotonic() - t0, reply.tier, reply.error, detail)
        await self.refresh_loaders()  # the tiers just changed: the models' states say so at once
        if reply.ok:
            if wid in self.workers:
                self.workers[wid].hb = self.workers[wid].hb.model_copy(update={"model": spec.id})
            log.info("worker %s now serves %s (%.3f s, weights from %s; %s: %s)", wid, spec.id, reply.seconds,
                     reply.tier, reason, detail)
            await self.dispatch(spec.id)
        else:
            log.warning("model %s failed to load on worker %s (%s): %s", spec.id, wid, reason, reply.error)
            if reason != TRAFFIC:  # a traffic move's model is still served where it was
                self._fail_queued(spec.id, reply.error or "unknown error")
            await self.dispatch(old)
        self.place_models()

    async def _drained(self, wid: str, limit_s: float = 900.0) -> bool:
        """Waits until the worker has nothing assigned, running or waiting (its sequences finish or
        are handed on; it gets nothing new meanwhile); False when it left the mesh."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            w = self.workers.get(wid)
            if w is None:
                return False
            if not w.assigned and w.hb.num_running == 0 and w.hb.num_waiting == 0:
                return True
            await asyncio.sleep(0.05)
        return True  # the worker itself still waits for its engine to be empty

    def _fail_queued(self, model: str, why: str) -> None:
        """The model cannot load: its queued requests end now, with the reason."""
        q = self.queues.get(model)
        if not q:
            return
        err = self._unavailable(model, why).error
        for item in q:
            if q.remove(item.req.request_id):
                self.requests.pop(item.req.request_id, None)
                req = item.req
                self._spawn(self.bus.publish(req.stream_subject, TokenChunk(
                    request_id=req.request_id, seq=0, index=len(req.output_token_ids), token_ids=[], finished=True,
                    finish_reason="error", error=err, attempt=req.attempt)))

    async def refresh_loaders(self) -> None:
        """The tiers of every node's model-loader, for the models' states."""
        for node in {w.hb.node_id for w in self.workers.values()}:
            try:
                msg = await self.bus.nc.request(self.bus.subjects.models("status", node), b"{}", timeout=0.5)
                self.loaders[node] = orjson.loads(msg.data)
            except Exception as e:  # noqa: BLE001 - an old loader, or a restarting one: keep what we had
                log.debug("loader of %s did not answer: %s", node, e)

    async def prewarm(self) -> None:
        """Asks each node's loader to bring up the models their request rates predict (prewarm.py)."""
        if self.manifest is None or not getattr(self.args, "prewarm", True):
            return
        rates = self.rates.all()
        for node, st in list(self.loaders.items()):
            if node in self.prewarming or "models" not in st:
                continue
            moves = plan(rates, residents(st, self.manifest.ids), st.get("weights_memory_bytes"),
                         st.get("host_cache_bytes") or 0, st.get("max_mapped") or 1)
            moves = [(mv, self.spec(mv.name)) for mv in moves if self.placement.failure(mv.name) is None]
            if moves:
                self.prewarming.add(node)
                self._spawn(self._prewarm(node, moves, rates))

    async def _prewarm(self, node: str, moves: list, rates: dict[str, float]) -> None:
        try:
            for mv, spec in moves:
                t0 = time.monotonic()
                req = PrewarmRequest(model=spec.path, dtype=spec.dtype or self.args.dtype,
                                     quantization=spec.quantization, name=spec.id, to=mv.to, evict=list(mv.evict))
                try:
                    msg = await self.bus.nc.request(self.bus.subjects.models("prewarm", node), req.encode(),
                                                    timeout=900)
                    reply = orjson.loads(msg.data)
                except Exception as e:  # noqa: BLE001 - an old loader, or a restarting one: the next round asks again
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                log.info("prewarm on %s: %s -> %s (rate %.3f/s%s) in %.3f s: %s", node, spec.id, mv.to,
                         rates.get(spec.id, 0.0), f", evicting {', '.join(mv.evict)}" if mv.evict else "",
                         time.monotonic() - t0, reply)
                self.prewarms = (self.prewarms + [{"node": node, "model": spec.id, "to": mv.to, "evict": list(mv.evict),
                                                   "ok": reply.get("ok"), "tier": reply.get("tier"),
                                                   "seconds": round(time.monotonic() - t0, 3)}])[-16:]
        finally:
            self.prewarming.discard(node)
        await self.refresh_loaders()
    async def refresh_kv_models(self) -> None:
        """Each node's KV blocks per model, from its kv-pool (for /metrics: `meshserve:model_kv_blocks`)."""
        for node in {w.hb.node_id for w in self.workers.values()}:
            try:
                msg = await self.bus.nc.request(self.bus.subjects.kv("status", node), b"{}", timeout=0.5)
                self.kv_models[node] = orjson.loads(msg.data).get("models", {})
            except Exception as e:  # noqa: BLE001 - a restarting pool: keep what we had
                log.debug("kv-pool of %s did not answer: %s", node, e)

    async def reload(self) -> dict:
        """Re-reads the manifest (SIGHUP, or the gateway's POST /admin/models/reload) and has every
        node's loader do the same; a removed model's queued requests fail, its running ones finish."""
        if self.manifest_path is None:
            return {"ok": False, "error": "the scheduler was started without --models"}
        try:
            m = load_manifest(self.manifest_path)
        except Exception as e:  # noqa: BLE001 - a bad file keeps the old manifest
            return {"ok": False, "error": str(e)}
        removed = [n for n in (self.manifest.ids if self.manifest else []) if n not in m.ids]
        self.manifest = m
        for n in removed:
            self._fail_queued(n, "it was removed from the manifest")
        loaders = {}
        for node in {w.hb.node_id for w in self.workers.values()}:
            try:
                msg = await self.bus.nc.request(self.bus.subjects.models("reload", node), b"{}", timeout=5)
                loaders[node] = orjson.loads(msg.data)
            except Exception as e:  # noqa: BLE001
                loaders[node] = {"ok": False, "error": str(e)}
        log.info("manifest reloaded: %s (removed: %s)", ", ".join(m.ids), ", ".join(removed) or "none")
        self.place_models()
        return {"ok": True, "models": m.ids, "removed": removed, "loaders": loaders}

    async def dispatch(self, model: str) -> None:
        """Sends queued requests of the model to workers while some worker may take one."""
        q = self.queues.get(model)
        while q:
            for item in q.heads(self.admission.fair.share if self.fair_share else None):
                w = self._place(item)
                if w is not None:
                    q.pop(item)
                    await self._send(item.req, w, time.monotonic() - item.since)
                    break
            else:
                return

    def _place(self, item) -> WorkerView | None:
        """The worker a queued request goes to now, or None: it waits here."""
        req = item.req
        cands = self.prefill_candidates(req.model)
        if not cands:
            return None
        block_size = cands[0].hb.block_size
        hashes = prompt_block_hashes(req.prompt_token_ids + req.output_token_ids, block_size,
                                     namespace(req.model, req.lora.key if req.lora else None, req.cache_salt))
        n_prompt = len(req.prompt_token_ids) + len(req.output_token_ids)
        first = self._first_choice_worker(req, cands)
        if first is not None:
            return first
        decoders = self.alive(req.model, ("decode",))
        idle = pick_idle_for_short_prompt(decoders, n_prompt, self.args.short_prefill, hashes, req.priority)
        if idle is not None:
            return idle
        if req.priority == "interactive" and not self.fcfs:  # at once, where it starts soonest
            return pick_soonest(cands, hashes, spill=spill_candidates(decoders, n_prompt))
        w = pick_admission(cands, req.priority, hashes, self.args.queue_depth, self.fcfs)
        if w is not None or self.fcfs:
            return w
        if req.priority == "normal" and time.monotonic() - item.since >= self.args.normal_max_queue_s:
            return pick_soonest([c for c in cands if waiting_there(c, "normal") == 0], hashes, "normal")
        return None

    async def _send(self, req: GenerateRequest, w: WorkerView, queued_s: float = 0.0) -> None:
        qw = self.queue_wait
        qw["count"], qw["total_s"], qw["max_s"] = qw["count"] + 1, qw["total_s"] + queued_s, max(qw["max_s"], queued_s)
        with span("scheduler.route", req.trace, request_id=req.request_id, worker=w.hb.worker_id,
                  queued_s=round(queued_s, 4)):
            self.requests[req.request_id].worker = w.hb.worker_id
            w.assigned.add(req.request_id)
            w.admitted[req.request_id] = (req.priority, len(req.prompt_token_ids) + len(req.output_token_ids))
            w.sent[req.priority] = w.sent.get(req.priority, 0) + 1
            self.placement.used(req.model)
            self.admission.dispatched(req)
        self._spawn(self._deliver(req, w.hb.worker_id))

    async def _deliver(self, req: GenerateRequest, worker: str) -> None:
        """Sends a request to its worker, acknowledged: a worker reconnecting to a restarted
        nats-server misses plain messages. Nobody there: it goes back to the head of its queue;
        no acknowledgement: it may have arrived, so the gateway re-submits it as a new attempt
        (a worker running the old one drops it on seeing the new)."""
        try:
            await self.bus.send(self.bus.subjects.worker(worker, "prefill"), req, timeout=DELIVERY_TIMEOUT)
            return
        except nats.errors.NoRespondersError:
            lost = False
        except (nats.errors.Error, asyncio.TimeoutError):
            lost = True
        t = self.requests.get(req.request_id)
        if t is None or t.req.attempt != req.attempt or t.worker != worker:
            return  # ended or moved on meanwhile
        log.warning("request %s: worker %s did not take it; %s", req.request_id, worker[:8],
                    "re-submitted by its gateway" if lost else "queued again")
        self._unassign(req.request_id, worker)
        if lost:
            await self._lost(self.requests.pop(req.request_id).req)
            return
        t.worker = None
        self.queues.setdefault(req.model, ClassQueues(self.fcfs)).push(req, first=True)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _first_choice_worker(self, req: GenerateRequest, cands: list[WorkerView]) -> WorkerView | None:
        """A later choice (n > 1) goes where its first choice is being prefilled: that worker's
        engine holds it until the shared prompt is cached. Once the first moved on (handed off),
        the cache-aware routing finds the prompt where it was computed."""
        first = self.requests.get(req.after) if req.after else None
        if first is None or first.worker is None:
            return None
        return next((w for w in cands if w.hb.worker_id == first.worker), None)

    async def handoff(self, h: Handoff) -> None:
        rid, src = h.request.request_id, h.from_worker
        self._unassign(rid, src)
        s = self.bus.subjects
        current = self.requests.get(rid)
        if current is not None and current.worker not in (None, src) and current.req.attempt == h.request.attempt:
            return  # a repeat (its acknowledgement was lost): it was handed over already
        superseded = current is not None and current.req.attempt != h.request.attempt
        if current is None or current.aborted or superseded:
            # Nobody wants it any more (or a newer attempt runs): give the blocks back on the
            # prefill worker's behalf.
            await self.bus.publish(s.kv("release", h.node_id), BlockRefs(worker_id=src, block_ids=h.block_ids,
                                                                         arena=h.arena))
            if not superseded:
                self.requests.pop(rid, None)
            return
        # On the prefill's node the blocks are handed over by id: only a worker on the same arena can read them.
        dst = pick_decode([w for w in self.decode_candidates(h.request.model) if w.hb.node_id != h.node_id
                           or not (h.arena and w.hb.arena) or w.hb.arena == h.arena], h.node_id)
        if dst is None:
            dst = self.workers.get(src)  # no decode worker: the prefill worker decodes it itself
            log.info("request %s: no decode worker for %s (workers: %s); %s decodes it", rid, h.request.model,
                     ", ".join(f"{w.hb.worker_id} {self.role_of(w)} {w.hb.model}{' draining' if w.hb.draining else ''}"
                               for w in self.workers.values()), src)
        if dst is None:
            await self._lost(self.requests.pop(rid).req)
            return
        remote = dst.hb.node_id != h.node_id
        with span("scheduler.handoff", h.request.trace, request_id=rid, src=src, dst=dst.hb.worker_id,
                  blocks=len(h.block_ids), cross_node=remote):
            if not remote:  # one node: one reference per block moves; cross-node, the decode worker pulls them
                try:
                    t = await self.bus.request(s.kv("transfer", h.node_id), BlockTransfer(
                        from_worker=src, to_worker=dst.hb.worker_id, block_ids=h.block_ids, arena=h.arena),
                        TransferReply)
                except (nats.errors.Error, asyncio.TimeoutError, RuntimeError) as e:
                    log.warning("request %s: the kv-pool did not transfer its blocks (%s)", rid, e)
                    t = None
                if t is None or not t.ok:  # the prefill worker died and its blocks were reclaimed: start over
                    await self._lost(self.requests.pop(rid).req)
                    return
            self.requests[rid].worker = dst.hb.worker_id
            dst.assigned.add(rid)
            self._spawn(self._deliver_adopt(h, dst.hb.worker_id, remote))
        await self.dispatch(h.request.model)  # a seat on the prefill worker is free

    async def _deliver_adopt(self, h: Handoff, dst: str, remote: bool) -> None:
        """The adopt message, acknowledged (see _deliver). Undelivered, the blocks now dst's go back
        to the pool on its behalf and the gateway re-submits the request."""
        rid = h.request.request_id
        try:
            await self.bus.send(self.bus.subjects.worker(dst, "adopt"), h, timeout=DELIVERY_TIMEOUT)
            return
        except nats.errors.NoRespondersError:
            if not remote:
                await self.bus.publish(self.bus.subjects.kv("release", h.node_id),
                                       BlockRefs(worker_id=dst, block_ids=h.block_ids, arena=h.arena))
        except (nats.errors.Error, asyncio.TimeoutError):
            pass
        t = self.requests.get(rid)
        if t is not None and t.req.attempt == h.request.attempt and t.worker == dst:
            log.warning("request %s: worker %s did not take the handoff; re-submitted by its gateway", rid, dst[:8])
            self._unassign(rid, dst)
            await self._lost(self.requests.pop(rid).req)

    async def done(self, d: Done) -> None:
        t = self.requests.get(d.request_id)
        if t is not None and t.req.attempt != d.attempt:  # a superseded attempt ended; the current one goes on,
            if t.worker != d.worker_id:  # elsewhere: the seat the old one took there is free
                self._unassign(d.request_id, d.worker_id)
            return
        self._unassign(d.request_id, d.worker_id)
        if t is not None and t.worker == d.worker_id:
            del self.requests[d.request_id]
        w = self.workers.get(d.worker_id)
        if w is not None:  # a seat there is free
            await self.dispatch(w.hb.model)
            self.place_models()

    async def abort(self, a: Abort) -> None:
        t = self.requests.get(a.request_id)
        if t is None or (a.attempt is not None and a.attempt < t.req.attempt):
            return  # unknown, or the abort of an attempt the gateway superseded (workers heard it)
        q = self.queues.get(t.req.model)
        if t.worker is None and q is not None and q.remove(a.request_id):  # still queued here
            del self.requests[a.request_id]
            return
        t.aborted = True  # kept with the request, so it goes when the request does
        if t.worker is not None:
            await self.bus.publish(self.bus.subjects.worker(t.worker, "abort"), a)

    def _unassign(self, rid: str, worker: str) -> None:
        w = self.workers.get(worker)
        if w is not None and rid in w.assigned:
            w.assigned.discard(rid)
            w.admitted.pop(rid, None)
            w.left_since_heartbeat += 1

    async def _lost(self, req: GenerateRequest) -> None:
        """Tells the gateway to re-submit; it knows which tokens the client already has."""
        await self.bus.publish(req.stream_subject, TokenChunk(request_id=req.request_id, seq=-1, index=-1,
                                                              token_ids=[], error="worker_lost", attempt=req.attempt))

    # -- workers

    async def heartbeat(self, hb: Heartbeat) -> None:
        w = self.workers.get(hb.worker_id)
        if w is None:
            log.info("worker %s (%s, %s) joined", hb.worker_id, hb.role, hb.model)
            self.workers[hb.worker_id] = WorkerView(hb)
        else:
            w.hb, w.last_seen, w.left_since_heartbeat = hb, time.monotonic(), 0
        self.roles.reported(_role_group(hb.node_id, hb.model), hb.worker_id, hb.role)
        await self.dispatch(hb.model)

    async def balance_roles(self) -> None:
        """Orders at most one role switch per node and model (roles.py decides): the workers of one
        model share its traffic, those of another model do not."""
        nodes: dict[tuple[str, str], list[Load]] = {}
        for w in self.workers.values():
            if w.hb.draining or w.hb.worker_id in self.placement.switching:  # leaving its model: left alone
                continue
            nodes.setdefault((w.hb.model, w.hb.node_id), []).append(Load(
                w.hb.worker_id, w.hb.role, w.hb.pending_prefill_tokens, w.hb.pending_decode_tokens,
                w.hb.num_running, w.hb.running_by_priority.get("interactive", 0)
                + w.hb.waiting_by_priority.get("interactive", 0), w.hb.prefill_tokens_per_s,
                w.hb.decode_tokens_per_s))
        for (model, node), loads in nodes.items():
            s = self.roles.observe(_role_group(node, model), loads)
            if s is not None:
                log.info("switching worker %s %s -> %s: %s", s.worker_id, s.from_role, s.to_role, s.reason)
                await self.bus.publish(self.bus.subjects.worker(s.worker_id, "role"),
                                       RoleSwitch(role=s.to_role, reason=s.reason))

    def kv_event(self, ev: KVEvent) -> None:
        w = self.workers.get(ev.worker_id)
        if w is None:
            return
        if ev.cleared:
            w.cached.clear()
        w.cached.update(ev.stored)
        w.cached.difference_update(ev.removed)

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for model in list(self.queues):  # queued normal requests may be due (--normal-max-queue-s)
                await self.dispatch(model)
            now = time.monotonic()
            for wid, w in list(self.workers.items()):
                if self.bus.silent_for(w.last_seen, now) > self.args.worker_timeout:  # a nats restart is no one's death
                    del self.workers[wid]
                    self.roles.forget(wid)
                    lost = [t for t in self.requests.values() if t.worker == wid]
                    log.warning("worker %s silent for %.1fs: re-dispatching %d requests", wid, now - w.last_seen,
                                len(lost))
                    for t in lost:
                        del self.requests[t.req.request_id]
                        await self._lost(t.req)
            self.admission.sweep(self.requests.__contains__)
            if now - self._kept_alive_at >= KEEPALIVE_S:
                self._kept_alive_at = now
                await self.keep_queued_alive()
            await self.balance_roles()
            self.place_models()
            self.balance_models()
            if self.manifest is not None and time.monotonic() - self._loaders_at > 1.0:
                self._loaders_at = time.monotonic()
                await self.refresh_loaders()
                await self.prewarm()
            if time.monotonic() - self._kv_at > 1.0 and (self._kv_task is None or self._kv_task.done()):
                self._kv_at = time.monotonic()  # in the background: a pool that does not answer delays nothing
                self._kv_task = asyncio.ensure_future(self.refresh_kv_models())

    async def keep_queued_alive(self) -> None:
        """Tells the gateways which of their requests still wait here: a batch prompt may queue
        longer than a gateway waits for a token before it calls a stream lost."""
        for q in self.queues.values():
            for item in q:
                req = item.req
                await self.bus.publish(req.stream_subject, TokenChunk(
                    request_id=req.request_id, seq=0, index=len(req.output_token_ids), token_ids=[], queued=True,
                    attempt=req.attempt))

    async def serve(self) -> None:
        s, nc = self.bus.subjects, self.bus.nc

        async def on_submit(msg):
            try:
                reply = await self.submit(GenerateRequest.decode(msg.data))
            except Exception as e:  # noqa: BLE001 - the gateway must hear why
                log.exception("submit failed")
                reply = SubmitReply(ok=False, status_code=500, error=f"scheduler error: {e}")
            await msg.respond(reply.encode())

        async def on_handoff(msg):
            await self.bus.ack(msg)
            await self.handoff(Handoff.decode(msg.data))

        async def on_done(msg):
            await self.bus.ack(msg)
            await self.done(Done.decode(msg.data))

        async def on_abort(msg):
            await self.abort(Abort.decode(msg.data))

        async def on_heartbeat(msg):
            await self.heartbeat(Heartbeat.decode(msg.data))

        async def on_event(msg):
            self.kv_event(KVEvent.decode(msg.data))

        async def on_usage(msg):
            u = Usage.decode(msg.data)
            self.admission.settle(u.request_id, u.output_tokens)

        async def on_status(msg):
            await msg.respond(orjson.dumps(self.status()))

        async def on_reload(msg):
            await msg.respond(orjson.dumps(await self.reload()))

        await nc.subscribe(s.handoff, cb=on_handoff)
        await nc.subscribe(s.done, cb=on_done)
        await nc.subscribe(s.abort, cb=on_abort)
        await nc.subscribe(s.heartbeat, cb=on_heartbeat)
        await nc.subscribe(s.kv("events", "*"), cb=on_event)
        await nc.subscribe(s.scheduler_status, cb=on_status)
        await nc.subscribe(s.usage, cb=on_usage)
        await nc.subscribe(s.scheduler("reload"), cb=on_reload)
        if self.manifest_path:  # SIGHUP: re-read the manifest
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.reload()))
        self.reaper = asyncio.ensure_future(self.reap())
        self.greeter = asyncio.ensure_future(self.hello(lambda: nc.subscribe(s.submit, cb=on_submit)))

    async def hello(self, take_submissions) -> None:
        """Takes submissions once the workers' heartbeats came in (or after --worker-timeout), so a
        restarted scheduler does not refuse requests for want of workers it has not heard yet;
        then announces its id every second."""
        deadline = time.monotonic() + self.args.worker_timeout
        while not self.status()["ready"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await take_submissions()
        log.info("scheduler %s taking requests (%d workers known)", self.id, len(self.workers))
        while True:
            try:
                await self.bus.publish(self.bus.subjects.scheduler_hello, ServiceHello(service_id=self.id))
            except Exception as e:  # noqa: BLE001 - the bus may be reconnecting; the next one will do
                log.debug("hello not sent: %s", e)
            await asyncio.sleep(HELLO_INTERVAL)


def traffic_policy(text: str) -> TrafficPolicy:
    """--model-traffic-policy's value (argparse: a clear error for a bad one)."""
    try:
        return TrafficPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def traffic_policy_defaults() -> str:
    return ", ".join(f"{f.name}={getattr(TrafficPolicy(), f.name):g}" for f in dataclasses.fields(TrafficPolicy))


def add_arguments(p) -> None:
    p.add_argument("--worker-timeout", type=float, default=3.0,
                   help="seconds without a heartbeat before a worker's requests are re-dispatched")
    p.add_argument("--short-prefill", type=int, default=32,
                   help="prompts up to this many tokens may be prefilled by an idle decode worker (0: never)")
    add_scheduling_arguments(p)
    p.add_argument("--queue-depth", type=float, default=2.0,
                   help="steps of prompt tokens (a worker's --max-num-batched-tokens each) of a class a worker may "
                        "have waiting before the rest of the class waits here")
    p.add_argument("--normal-max-queue-s", type=float, default=1.0,
                   help="a normal request waiting here this long goes to a worker with none waiting, room or not")
    p.add_argument("--fair-share", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tenants: within a class, the request of the tenant served least goes first "
                        "(docs/tenants.md; default: on; off: the class's own order, whoever sent it)")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants file (docs/tenants.md): quotas per tenant and a bound per class queue; give the "
                        "gateway the same file (default: none, everything is admitted)")
    p.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=True,
                   help="with --models: bring models up a tier ahead of their requests, as their recent request "
                        "rates predict (docs/models.md; default: on)")
    p.add_argument("--fixed-roles", action="store_true",
                   help="keep every worker in the role it started with (default: with two or more workers on a "
                        "node, roles follow the traffic)")
    p.add_argument("--fixed-model-workers", action="store_true",
                   help="with --models: move a worker to another model only when that model has requests and no "
                        "worker (default: a model's worker count also follows its traffic, docs/models.md)")
    p.add_argument("--model-traffic-policy", type=traffic_policy, default=None, metavar="KEY=VALUE,...",
                   help="with --models: the numbers by which a model's worker count follows its traffic, over "
                        f"their defaults ({traffic_policy_defaults()}; docs/models.md)")
    p.add_argument("--decode-token-cost", type=float, default=None, metavar="X",
                   help="what an output token still to generate weighs in prompt tokens, for the elastic roles and "
                        "the models' worker counts (default: the ratio of the rates the workers measure, 8 until "
                        "they have)")


async def main(args) -> None:
    async def start(bus: Bus):
        sched = Scheduler(bus, args)
        await sched.serve()
        return None

    await run_service("scheduler", args, start)
