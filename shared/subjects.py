"""Every NATS subject in the mesh, built from one scheme (Dynamo's namespace > component > endpoint):

    <namespace>.<component>[.<instance>].<endpoint>

A component is one kind of service; components with one process per node or per worker put that
instance (the node, the worker id) in the subject, so a message reaches exactly that one. Each
component's endpoints are a closed set (the Literal types below): asking for any other raises, so
a typo is an error where the subject is built, not a message nobody hears.

    <ns>.v1.completions, <ns>.v1.chat.completions   public request/reply API (gateway); a contract
    <ns>.scheduler.{submit,handoff,abort,done,status} gateway/workers -> scheduler
    <ns>.scheduler.usage                             gateway -> scheduler (a tenant's request ended)
    <ns>.scheduler.hello                             scheduler -> gateways (its id, every second)
    <ns>.scheduler.abort                             gateway -> scheduler, and workers (aborts of a superseded attempt)
    <ns>.worker.<id>.{prefill,adopt,abort,role}      scheduler -> one worker (role: elastic roles); the id
                                                     `<name>.<role>-<node>-<pid>` is two tokens, its NATS
                                                     user's name first (shared/nats_auth.py)
    <ns>.workers.heartbeat                           workers -> scheduler, kv-pools
    <ns>.kv.<node>.{arena,lease,release,retain,transfer,status}  workers, scheduler <-> the node's kv-pool
    <ns>.kv.<node>.swap                              workers -> kv-pool (arena <-> host swap tier, by block ids)
    <ns>.kv.<node>.import                            a decode worker -> its kv-pool (pull blocks from another node)
    <ns>.kv.<node>.{fetch,chunk,close}               kv-pool -> kv-pool (KV bytes between nodes, in chunks)
    <ns>.kv.<node>.events                            workers, kv-pool -> scheduler, kv-pools (blocks stored/removed)
    <ns>.kv.<node>.pressure                          kv-pool -> the node's workers (a lease it could not fill)
    <ns>.kv.<node>.host_events                       kv-pool -> its workers (keys stored/removed in the host swap tier)
    <ns>.kv.<node>.hello                             kv-pool -> its workers (its arena epoch, every second)
    <ns>.models.<node>.{load,list}                   workers, kv-pool -> the node's model-loader
    <ns>.models.<node>.{status,reload,prewarm}       scheduler -> the node's model-loader
    <ns>.compute.<node>.claim                        a worker -> the other workers of its node (it computes
                                                     interactive prompts: lower classes wait; compute_claims.py)
    <ns>.tokens.<gateway id>                         workers -> the gateway that owns the request (the
                                                     instance is the whole address: one stream per gateway)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

DEFAULT_NAMESPACE = "meshserve"

ApiEndpoint = Literal["completions", "chat.completions"]
SchedulerEndpoint = Literal["submit", "handoff", "abort", "done", "status", "usage", "hello", "reload"]
WorkerEndpoint = Literal["prefill", "adopt", "abort", "role", "model"]
WorkersEndpoint = Literal["heartbeat"]
KVEndpoint = Literal["arena", "lease", "release", "retain", "transfer", "status", "swap", "import", "fetch",
                     "chunk", "close", "events", "pressure", "host_events", "hello", "retired",
                     "resized"]
ModelsEndpoint = Literal["load", "list", "status", "reload", "prewarm"]
ComputeEndpoint = Literal["claim"]


@dataclass(frozen=True)
class Component:
    name: str  # the subject token after the namespace
    endpoints: tuple[str, ...]
    per_instance: bool  # its subjects name one instance (a node, a worker) after the component


API = Component("v1", get_args(ApiEndpoint), per_instance=False)
SCHEDULER = Component("scheduler", get_args(SchedulerEndpoint), per_instance=False)
WORKER = Component("worker", get_args(WorkerEndpoint), per_instance=True)
WORKERS = Component("workers", get_args(WorkersEndpoint), per_instance=False)  # all workers at once
KV = Component("kv", get_args(KVEndpoint), per_instance=True)  # the node's kv-pool
MODELS = Component("models", get_args(ModelsEndpoint), per_instance=True)  # the node's model-loader
COMPUTE = Component("compute", get_args(ComputeEndpoint), per_instance=True)  # the node's cores, among its workers
TOKENS = "tokens"  # <ns>.tokens.<gateway id>: no endpoint


def node_token(node: str) -> str:
    """An instance id as one subject token (Kubernetes node names may hold dots); "*" stays a
    wildcard (a subscription to every instance)."""
    return node if node == "*" else re.sub(r"[.*>\s]", "_", node)


def instance_token(worker_id: str) -> str:
    """A worker id as subject tokens: `<name>.<rest>` stays two tokens (each made one token), so
    that a permission can name every worker of one NATS user (`worker.<name>.*.adopt`) and nothing
    else; an id without a dot is one token."""
    return ".".join(node_token(part) for part in worker_id.split(".", 1))


@dataclass(frozen=True)
class Subjects:
    ns: str = DEFAULT_NAMESPACE

    def subject(self, component: Component, endpoint: str, instance: str | None = None) -> str:
        """The one builder: raises ValueError for an endpoint the component does not have, or an
        instance given to a component without instances (or missing from one with them)."""
        if endpoint not in component.endpoints:
            raise ValueError(f"{endpoint!r} is not an endpoint of {component.name!r} "
                             f"(one of {', '.join(component.endpoints)})")
        if component.per_instance != (instance is not None):
            raise ValueError(f"{component.name!r} subjects {'need' if component.per_instance else 'take no'} "
                             "instance")
        if instance is not None:
            instance = instance_token(instance) if component is WORKER else node_token(instance)
        parts = [self.ns, component.name] + ([instance] if instance is not None else []) + [endpoint]
        return ".".join(parts)

    # public API
    @property
    def completions(self) -> str:
        return self.subject(API, "completions")

    @property
    def chat_completions(self) -> str:
        return self.subject(API, "chat.completions")

    # scheduler
    def scheduler(self, endpoint: SchedulerEndpoint) -> str:
        return self.subject(SCHEDULER, endpoint)

    @property
    def submit(self) -> str:
        return self.scheduler("submit")

    @property
    def handoff(self) -> str:
        return self.scheduler("handoff")

    @property
    def abort(self) -> str:
        return self.scheduler("abort")

    @property
    def done(self) -> str:
        return self.scheduler("done")

    @property
    def scheduler_status(self) -> str:
        return self.scheduler("status")

    @property
    def scheduler_hello(self) -> str:
        return self.scheduler("hello")

    @property
    def usage(self) -> str:
        return self.scheduler("usage")

    @property
    def heartbeat(self) -> str:
        return self.subject(WORKERS, "heartbeat")

    # workers: one subject set per worker
    def worker(self, worker_id: str, endpoint: WorkerEndpoint) -> str:
        return self.subject(WORKER, endpoint, worker_id)

    # kv-pool: one per node, so its subjects name the node ("*" in a subscription: every node)
    def kv(self, endpoint: KVEndpoint, node: str) -> str:
        return self.subject(KV, endpoint, node)

    # model-loader: one per node too (its descriptors name memory on that node)
    def models(self, endpoint: ModelsEndpoint, node: str) -> str:
        return self.subject(MODELS, endpoint, node)

    # compute claims: among the workers of one node (they share its cores)
    def compute(self, endpoint: ComputeEndpoint, node: str) -> str:
        return self.subject(COMPUTE, endpoint, node)

    # token streams: one per gateway
    def tokens(self, gateway_id: str) -> str:
        return f"{self.ns}.{TOKENS}.{node_token(gateway_id)}"
