"""Every NATS subject in the mesh, named in one place under one namespace.

    <ns>.v1.completions, <ns>.v1.chat.completions   public request/reply API (gateway)
    <ns>.scheduler.{submit,handoff,abort,done,status} gateway/workers -> scheduler
    <ns>.scheduler.usage                             gateway -> scheduler (a tenant's request ended)
    <ns>.worker.<id>.{prefill,adopt,abort}           scheduler -> one worker
    <ns>.workers.heartbeat                           workers -> scheduler
    <ns>.kv.<node>.{arena,lease,release,retain,transfer,status}  workers, scheduler <-> the node's kv-pool
    <ns>.kv.<node>.swap                              workers -> kv-pool (arena <-> host swap tier, by block ids)
    <ns>.kv.<node>.import                            a decode worker -> its kv-pool (pull blocks from another node)
    <ns>.kv.<node>.{fetch,chunk,close}               kv-pool -> kv-pool (KV bytes between nodes, in chunks)
    <ns>.kv.<node>.events                            workers, kv-pool -> scheduler, kv-pools (blocks stored/removed)
    <ns>.kv.<node>.host_events                       kv-pool -> its workers (keys stored/removed in the host swap tier)
    <ns>.models.{load,list}                          workers -> model-loader
    <ns>.tokens.<gateway id>                         workers -> the gateway that owns the request
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "meshserve"


def node_token(node: str) -> str:
    """A node id as one subject token (Kubernetes node names may hold dots)."""
    return node if node == "*" else re.sub(r"[.*>\s]", "_", node)


@dataclass(frozen=True)
class Subjects:
    ns: str = DEFAULT_NAMESPACE

    # public API
    @property
    def completions(self) -> str:
        return f"{self.ns}.v1.completions"

    @property
    def chat_completions(self) -> str:
        return f"{self.ns}.v1.chat.completions"

    # scheduler
    @property
    def submit(self) -> str:
        return f"{self.ns}.scheduler.submit"

    @property
    def handoff(self) -> str:
        return f"{self.ns}.scheduler.handoff"

    @property
    def abort(self) -> str:
        return f"{self.ns}.scheduler.abort"

    @property
    def done(self) -> str:
        return f"{self.ns}.scheduler.done"

    @property
    def usage(self) -> str:
        return f"{self.ns}.scheduler.usage"

    @property
    def heartbeat(self) -> str:
        return f"{self.ns}.workers.heartbeat"

    @property
    def scheduler_status(self) -> str:
        return f"{self.ns}.scheduler.status"

    # workers
    def worker(self, worker_id: str, verb: str) -> str:
        return f"{self.ns}.worker.{worker_id}.{verb}"

    # kv-pool: one per node, so its subjects name the node ("*" in a subscription: every node)
    def kv(self, verb: str, node: str) -> str:
        return f"{self.ns}.kv.{node_token(node)}.{verb}"

    # model-loader: one per node too (its descriptors name memory on that node)
    def models(self, verb: str, node: str) -> str:
        return f"{self.ns}.models.{node_token(node)}.{verb}"

    # token streams
    def tokens(self, gateway_id: str) -> str:
        return f"{self.ns}.tokens.{gateway_id}"
