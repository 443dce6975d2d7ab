"""Every NATS subject in the mesh, named in one place under one namespace.

    <ns>.v1.completions, <ns>.v1.chat.completions   public request/reply API (gateway)
    <ns>.scheduler.{submit,handoff,abort,done,status} gateway/workers -> scheduler
    <ns>.worker.<id>.{prefill,adopt,abort}           scheduler -> one worker
    <ns>.workers.heartbeat                           workers -> scheduler
    <ns>.kv.{arena,lease,release,retain,transfer}    workers, scheduler <-> kv-pool
    <ns>.kv.events                                   workers -> scheduler, kv-pool (blocks stored/removed)
    <ns>.models.{load,list}                          workers -> model-loader
    <ns>.tokens.<gateway id>                         workers -> the gateway that owns the request
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "meshserve"


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
    def heartbeat(self) -> str:
        return f"{self.ns}.workers.heartbeat"

    @property
    def scheduler_status(self) -> str:
        return f"{self.ns}.scheduler.status"

    # workers
    def worker(self, worker_id: str, verb: str) -> str:
        return f"{self.ns}.worker.{worker_id}.{verb}"

    # kv-pool
    def kv(self, verb: str) -> str:
        return f"{self.ns}.kv.{verb}"

    # model-loader
    def models(self, verb: str) -> str:
        return f"{self.ns}.models.{verb}"

    # token streams
    def tokens(self, gateway_id: str) -> str:
        return f"{self.ns}.tokens.{gateway_id}"
