"""Prometheus metrics under vLLM's names (prefix `meshserve:`), so vLLM dashboards work unchanged.

Latencies are measured here, where the client's experience is. The mesh's numbers of each model
(running, waiting, KV usage, prefix cache, preemptions, speculative decoding) are asked of the
scheduler at scrape time; the scheduler sums what the workers' heartbeats say, per served model.

`request_queue_time_seconds` is an approximation: the time from arrival until the scheduler
accepted the submission. The gateway cannot see when a worker actually starts the request.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

# scheduler status key -> gauge name
STATUS_GAUGES = {
    "num_running": ("meshserve:num_requests_running", "Requests running on the workers."),
    "num_waiting": ("meshserve:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_usage": ("meshserve:kv_cache_usage_perc", "KV-cache usage, 0 to 1."),
    "prefix_queries": ("meshserve:prefix_cache_queries", "Prefix-cache queries (tokens), all workers."),
    "prefix_hits": ("meshserve:prefix_cache_hits", "Prefix-cache hits (tokens), all workers."),
    "num_preemptions": ("meshserve:num_preemptions", "Preemptions, all workers."),
}


ROLES = ("prefill", "decode", "mixed")


class WorkerRoles:
    """`meshserve:worker_role` (1 for each worker's current role, 0 for the others) and
    `meshserve:role_switches_total`, from the scheduler's last status: workers come and go, so the
    series are built at each scrape rather than kept."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.status: dict = {}

    def collect(self):
        role = GaugeMetricFamily("meshserve:worker_role", "Each worker's current role (1) among prefill, decode, "
                                 "mixed.", labels=["model_name", "worker", "role"])
        for w in self.status.get("workers") or []:
            if not isinstance(w, dict):  # a status of another shape (an older scheduler): no series
                continue
            for r in ROLES:
                role.add_metric([self.model, str(w.get("id")), r], float(w.get("role") == r))
        switches = CounterMetricFamily("meshserve:role_switches", "Worker role switches (elastic roles).",
                                       labels=["model_name"])
        switches.add_metric([self.model], float(self.status.get("role_switches") or 0))
        return [role, switches]


class ComputeYields:
    """`meshserve:compute_yields_total` and `meshserve:compute_yield_seconds_total` by worker: the
    steps a worker held back for another worker's compute claim on its node (runs of waits, and
    seconds; services/worker/compute_claims.py); `meshserve:interrupted_steps_total`: the steps it
    ended early for an interactive request or a role switch that arrived (LLMEngine.urgent). From the scheduler's
    last status."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.status: dict = {}

    def collect(self):
        labels = ["model_name", "worker"]
        yields = CounterMetricFamily("meshserve:compute_yields", "Times a worker held its steps back for an "
                                     "interactive prompt another worker of its node computes.", labels=labels)
        seconds = CounterMetricFamily("meshserve:compute_yield_seconds", "Seconds a worker held its steps back for "
                                      "another worker's compute claim.", labels=labels)
        interrupted = CounterMetricFamily("meshserve:interrupted_steps", "Steps a worker ended early (computing "
                                          "nothing) for an interactive request that arrived.", labels=labels)
        for w in self.status.get("workers") or []:
            if isinstance(w, dict) and isinstance(w.get("compute_yields"), int):
                yields.add_metric([self.model, str(w.get("id"))], float(w["compute_yields"]))
                seconds.add_metric([self.model, str(w.get("id"))], float(w.get("compute_yield_s") or 0))
                interrupted.add_metric([self.model, str(w.get("id"))], float(w.get("interrupted_steps") or 0))
        return [yields, seconds, interrupted]


class ModelWorkers:
    """`meshserve:model_workers{model}` (workers serving each model now) and
    `meshserve:model_switches_total{reason}` (workers that changed model: "no worker", "traffic",
    "removed"), from the scheduler's last status (docs/models.md)."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.status: dict = {}

    def collect(self):
        workers = GaugeMetricFamily("meshserve:model_workers", "Workers serving each model.",
                                    labels=["model_name", "model"])
        for name, m in (self.status.get("models") or {}).items():
            if isinstance(m, dict) and isinstance(m.get("workers"), int):
                workers.add_metric([self.model, str(name)], float(m["workers"]))
        switches = CounterMetricFamily("meshserve:model_switches", "Workers that changed model, by reason.",
                                       labels=["model_name", "reason"])
        for reason, n in (self.status.get("model_switches_by_reason") or {}).items():
            if isinstance(n, (int, float)):
                switches.add_metric([self.model, str(reason)], float(n))
        return [workers, switches]


class ModelKV:
    """`meshserve:model_kv_blocks` and `meshserve:model_kv_quota_blocks`, per node and `model`: the KV
    blocks each model's workers hold on the node and its memory quota's share for them (the
    kv-pools' counts, in the scheduler's status as `kv_by_model`)."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.status: dict = {}

    def collect(self):
        used = GaugeMetricFamily("meshserve:model_kv_blocks", "KV blocks held by a model's workers on a node.",
                                 labels=["model_name", "node", "model"])
        quota = GaugeMetricFamily("meshserve:model_kv_quota_blocks", "The most KV blocks a model may hold on a node "
                                  "(its memory_quota_gb less its weights).", labels=["model_name", "node", "model"])
        for node, models in (self.status.get("kv_by_model") or {}).items():
            for name, m in (models or {}).items():
                if not isinstance(m, dict):
                    continue
                used.add_metric([self.model, str(node), str(name)], float(m.get("blocks") or 0))
                if isinstance(m.get("quota_blocks"), int):
                    quota.add_metric([self.model, str(node), str(name)], float(m["quota_blocks"]))
        return [used, quota]


# scheduler status "spec_decode" key -> counter name (vLLM's, without _total, which the client adds)
SPEC_DECODE_COUNTERS = {
    "num_accepted_tokens": ("meshserve:spec_decode_num_accepted_tokens",
                            "Proposed tokens the target accepted (speculative decoding)."),
    "num_draft_tokens": ("meshserve:spec_decode_num_draft_tokens", "Tokens proposed and verified."),
    "num_verification_steps": ("meshserve:spec_decode_num_verification_steps",
                               "Verifications: one per speculating sequence per step."),
}


class ModelStatus:
    """The scheduler's numbers of each served model (its status's `by_model`), as gauges named by
    STATUS_GAUGES and counters: `meshserve:preemptions_total{mode="swap"|"recompute"}` and
    speculative decoding's `meshserve:spec_decode_*_total`. The workers keep the counters and the
    scheduler sums them from their heartbeats; each is the largest sum seen, since a worker gone
    must not make it drop. A model's gauges go with it from the status; its counters stay."""

    def __init__(self):
        self.gauges: dict[str, dict] = {}  # served name -> its STATUS_GAUGES values
        self.by_mode: dict[str, dict[str, float]] = {}  # served name -> mode -> preemptions
        self.spec: dict[str, dict[str, float]] = {}  # served name -> SPEC_DECODE_COUNTERS key -> count

    def update(self, status: dict) -> None:
        by_model = status.get("by_model") or {}
        self.gauges = {name: m for name, m in by_model.items() if isinstance(m, dict)}
        for name, m in self.gauges.items():
            by_mode = self.by_mode.setdefault(name, {"swap": 0, "recompute": 0})
            for mode, n in (m.get("preemptions_by_mode") or {}).items():
                if isinstance(n, (int, float)):
                    by_mode[mode] = max(by_mode.get(mode, 0), n)
            spec = self.spec.setdefault(name, dict.fromkeys(SPEC_DECODE_COUNTERS, 0))
            for key, n in (m.get("spec_decode") or {}).items():
                if key in spec and isinstance(n, (int, float)):
                    spec[key] = max(spec[key], n)

    def collect(self):
        for key, (name, doc) in STATUS_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            for model, m in self.gauges.items():
                if isinstance(m.get(key), (int, float)):
                    g.add_metric([model], float(m[key]))
            yield g
        c = CounterMetricFamily("meshserve:preemptions", "Preemptions on the workers, by how the KV was kept "
                                "(swap: to host memory and back; recompute: prefilled again).",
                                labels=["model_name", "mode"])
        for model, by_mode in self.by_mode.items():
            for mode, n in by_mode.items():
                c.add_metric([model, mode], n)
        yield c
        for key, (name, doc) in SPEC_DECODE_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            for model, spec in self.spec.items():
                c.add_metric([model], spec[key])
            yield c
        rate = GaugeMetricFamily("meshserve:spec_decode_acceptance_rate", "Proposed tokens accepted, of those "
                                 "verified, since the start (accepted / draft tokens).", labels=["model_name"])
        per_step = GaugeMetricFamily("meshserve:spec_decode_tokens_per_verification_step", "Output tokens each "
                                     "verification yielded since the start: the accepted ones and the target's own "
                                     "next token ((accepted + verifications) / verifications).", labels=["model_name"])
        for model, spec in self.spec.items():
            if spec["num_verification_steps"]:
                rate.add_metric([model], spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1))
                per_step.add_metric([model], (spec["num_accepted_tokens"] + spec["num_verification_steps"])
                                    / spec["num_verification_steps"])
        yield rate
        yield per_step


class GatewayMetrics:
    """A private registry, so several gateways (or tests) in one process do not collide. A request's
    own series (latencies, tokens, outcomes, its tenant's counts) carry the served name of the model
    it ran on (`of(model)`), and so do the scheduler's numbers of each model (ModelStatus); those
    of the whole mesh (worker roles, model switches, compute yields) and refusals before a model is
    known carry the gateway's first model's."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._ttft = Histogram("meshserve:time_to_first_token_seconds", "Time to first token.", labels,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("meshserve:inter_token_latency_seconds", "Time between output tokens.", labels,
                              buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram("meshserve:e2e_request_latency_seconds", "Arrival to last token.", labels,
                              buckets=REQUEST_BUCKETS, registry=r)
        self._queue = Histogram("meshserve:request_queue_time_seconds",
                                "Arrival until the scheduler accepted the request (approximation).", labels,
                                buckets=REQUEST_BUCKETS, registry=r)
        self._prompt_tokens = Counter("meshserve:prompt_tokens", "Prompt tokens submitted.", labels, registry=r)
        self._generation_tokens = Counter("meshserve:generation_tokens", "Tokens generated.", labels, registry=r)
        self._success = Counter("meshserve:request_success", "Finished requests.", labels + ["finished_reason"],
                                registry=r)
        self._model = model_name
        self._models: dict[str, ModelMetrics] = {}
        # Per tenant (the tenants file; tenant="" for requests without a known key).
        tl = labels + ["tenant"]
        self._tenant_requests = Counter("meshserve:tenant_requests", "Requests admitted, by tenant.", tl, registry=r)
        self._tenant_prompt = Counter("meshserve:tenant_prompt_tokens", "Prompt tokens admitted, by tenant.", tl,
                                      registry=r)
        self._tenant_generation = Counter("meshserve:tenant_generation_tokens", "Tokens generated, by tenant.", tl,
                                          registry=r)
        self._tenant_rejections = Counter(
            "meshserve:tenant_rejections", "Requests refused at admission, by tenant and reason (invalid_api_key, "
            "priority_not_allowed, max_concurrent_requests, tokens_per_minute, queue_full).", tl + ["reason"],
            registry=r)
        self._tenant_in_flight = Gauge("meshserve:tenant_requests_in_flight",
                                       "Requests admitted and not yet ended, by tenant (the scheduler's count).", tl,
                                       registry=r)
        self._roles = WorkerRoles(model_name)
        r.register(self._roles)
        self._model_kv = ModelKV(model_name)
        r.register(self._model_kv)
        self._yields = ComputeYields(model_name)
        r.register(self._yields)
        self._model_workers = ModelWorkers(model_name)
        r.register(self._model_workers)
        self._by_model = ModelStatus()
        r.register(self._by_model)

    def of(self, model: str) -> "ModelMetrics":
        """The series of requests that ran on `model` (a served name)."""
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(self, model)
        return m

    @staticmethod
    def _tenant(tenant) -> str:
        return "" if tenant is None else tenant.name

    def tenant_rejected(self, tenant, reason: str | None) -> None:
        """`reason` None: not an admission refusal (a bad request, say), not counted here."""
        if reason is not None:
            self._tenant_rejections.labels(self._model, self._tenant(tenant), reason).inc()

    def refresh(self, status: dict | None) -> None:
        """Sets the scheduler gauges; leaves them as they were when the scheduler did not answer."""
        if not status:
            return
        self._roles.status = status
        self._model_kv.status = status
        self._yields.status = status
        self._model_workers.status = status
        for name, t in ((status.get("admission") or {}).get("tenants") or {}).items():
            if isinstance(t, dict) and isinstance(t.get("in_flight"), int):
                self._tenant_in_flight.labels(self._model, name).set(t["in_flight"])
        self._by_model.update(status)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One served model's request series (GatewayMetrics.of)."""

    def __init__(self, parent: GatewayMetrics, model: str):
        self._p, self.model = parent, model
        self.ttft, self.itl, self.e2e = (parent._ttft.labels(model), parent._itl.labels(model),
                                         parent._e2e.labels(model))
        self.queue = parent._queue.labels(model)
        self.prompt_tokens = parent._prompt_tokens.labels(model)
        self.generation_tokens = parent._generation_tokens.labels(model)

    def observe_itl(self, seconds: float, num_tokens: int) -> None:
        """A chunk of several tokens counts as that many tokens, evenly spaced."""
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def finished(self, reason: str) -> None:
        self._p._success.labels(self.model, reason).inc()

    def tenant_admitted(self, tenant, prompt_tokens: int) -> None:
        if tenant is not None:
            self._p._tenant_requests.labels(self.model, tenant.name).inc()
            self._p._tenant_prompt.labels(self.model, tenant.name).inc(prompt_tokens)

    def tenant_generated(self, tenant, num_tokens: int) -> None:
        if tenant is not None:
            self._p._tenant_generation.labels(self.model, tenant.name).inc(num_tokens)
