"""`meshserve serve prefill|decode`: the engine as a mesh worker.

Roles:
- prefill: computes prompts (chunked) into KV blocks of the node's shared arena, streams the first
  token, then hands the sequence to a decode worker by block ids (no KV bytes move);
- decode: adopts handed-off sequences and runs the continuous-batching loop, streaming tokens
  (a sequence prefilled on another node has its blocks pulled over first);
- mixed: does both for its own requests (a decode worker takes prefills when the scheduler sends
  them, e.g. when no prefill worker is up).

A worker's role may change while it runs (elastic roles, `<ns>.worker.<id>.role`): to decode it
keeps its sequences; to prefill it hands its decoding ones to other decode workers, as it would
after a prefill. The weights and the arena stay mapped: nothing is reloaded.

Everything that changes the engine (new requests, adoptions, aborts, a role) is queued by the NATS
callbacks and applied between steps, at iteration boundaries. The step itself runs in a thread so
heartbeats and messages keep flowing while it computes. Before a step it may wait while another
worker of its node computes interactive prompts (compute_claims.py): only the step loop waits. Which
blocks of the node's KV arena the worker holds (leases, give-back, host-tier spill and restore,
handoffs, imports) is kv_blocks.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time

import nats.errors

from meshserve.shared import nats_auth, node_memory
from meshserve.shared.bus import Bus
from meshserve.shared.engine import wire
from meshserve.shared.engine.llm_engine import (LLMEngine, RequestError, RequestOutput,
                                                SequenceStatus)
from meshserve.shared.engine.policy import INTERACTIVE, PRIORITIES, add_scheduling_arguments
from meshserve.shared.engine.speculative import add_speculative_arguments
from meshserve.shared.manifest import ManifestFile
from meshserve.shared.lora import LoRAError
from meshserve.shared.partitions import (PartitionError, apply_cpus, format_cpus, process_cores, resolve_cpus,
                                         threads_for)
from meshserve.shared.schemas import (KEEPALIVE_S, Abort, ArenaRetired, Done, GenerateRequest, Handoff, Heartbeat,
                                      LoadRequest, LoRARef, ModelSwitch, ModelSwitchReply, RoleSwitch, TokenChunk)
from meshserve.shared.service import run_service
from meshserve.shared import telemetry

from . import model_switch
from .compute_claims import MAX_YIELD_S, ComputeClaims, add_compute_yield_argument
from .kv_blocks import KVBlocks
from .kv_pool_client import KVPoolClient
from .threads import ThreadTuner, idle_seconds

log = logging.getLogger("meshserve.worker")
KEEP_LORAS = 16  # LoRA adapters a worker keeps loaded (the least recently used idle one goes first)


# Engine counters a worker reports over its whole life, per model it served: a model switch builds
# a new engine, whose counters start again at 0, and the scheduler's sums (and /metrics' counters)
# must not go back.
ENGINE_COUNTERS = ("prefix_queries", "prefix_hits", "num_preemptions", "num_priority_preemptions",
                   "interrupted_steps", "preemptions_by_mode", "spec_decode")


def with_past(stats: dict, past: dict) -> dict:
    """Stats with the counters of `past` added (ENGINE_COUNTERS; the by-mode and speculative ones
    are dicts of counts)."""
    out = dict(stats)
    for key, before in past.items():
        now = stats.get(key)
        if isinstance(before, dict):
            now = dict(now or {})
            for k, n in before.items():
                now[k] = now.get(k, 0) + n
            out[key] = now
        else:
            out[key] = (now or 0) + before
    return out


def counters_by_model(stats: dict, served: str, past: dict[str, dict]) -> dict[str, dict]:
    """Each model's ENGINE_COUNTERS over the worker's life: the engines' before (`past`, by model)
    and the running engine's `stats` for `served`."""
    out = dict(past)
    out[served] = {k: v for k, v in with_past(stats, past.get(served, {})).items() if k in ENGINE_COUNTERS}
    return out


def _set_threads(n: int) -> None:
    """torch threads of the calling (step) thread; 0 leaves the default (all cores)."""
    if n:
        import torch

        torch.set_num_threads(n)


class Worker:
    def __init__(self, bus: Bus, args, role: str):
        self.bus, self.args, self.role = bus, args, role
        # unique per node, names the process, and starts with its NATS user's name: the user that may
        # read this worker's subjects (shared/nats_auth.py)
        self.id = f"{nats_auth.worker_name(url=args.nats_url)}.{role}-{args.node_id}-{os.getpid()}"
        self.inbox: list[tuple[str, object]] = []
        self.wake = asyncio.Event()
        self.streams: dict[str, GenerateRequest] = {}  # request id -> its request (stream subject)
        self.chunk_seq: dict[str, int] = {}
        self.attempts: dict[str, int] = {}  # request id -> the GenerateRequest.attempt running here
        self.to_hand_off: set[str] = set()  # prefilled here, to pass on after the first token
        self.tasks: list[asyncio.Task] = []
        # Steps always run on this one thread: OpenMP keeps one warm thread team per calling
        # thread, and a pool that hands steps to different threads multiplies the spinning teams.
        threads = args.threads or int(os.environ.get("MESHSERVE_WORKER_THREADS", "0"))
        self.threads = threads
        self.stepper = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step",
                                                             initializer=_set_threads, initargs=(threads,))
        # The cores it may use, before any partition narrows them (shared/partitions.py).
        self.node_cores = process_cores()
        self.cores = self.node_cores
        # The manifest, for the compute partition of each model it serves (re-read when it changes).
        self.manifest = ManifestFile(args.models) if getattr(args, "models", None) else None
        # Each step's thread count by measured speed (threads.py), unless --fixed-threads.
        self.tuner = None if args.fixed_threads else ThreadTuner(threads or len(self.node_cores), _set_threads,
                                                                 idle=lambda: idle_seconds(self.cores))
        # Set when something must not wait for the step in progress: an interactive request (not
        # under fcfs) or a role switch. Cleared when the loop takes its inbox. The step in progress,
        # if it has no interactive sequence, ends early (LLMEngine.urgent).
        self.urgent = threading.Event()
        self.interactive_interrupts = args.scheduling != "fcfs"
        self.received: dict[str, float] = {}  # wall clock, for the queue and prefill spans
        self.decode_start: dict[str, float] = {}
        self.tokens_streamed = 0
        self.step_s = 0.0  # recent mean of its steps' wall time (heartbeats: the scheduler's routing)
        self.deliveries: set[asyncio.Task] = set()  # messages to the scheduler awaiting its acknowledgement
        self.draining = False  # SIGTERM came: taking nothing new (drain)
        self.unpublished: list[RequestOutput] = []  # a decode step's outputs, streamed while the next step runs
        self.received_by_priority = dict.fromkeys(PRIORITIES, 0)  # requests the scheduler sent to prefill
        self.pending_model = None  # (ModelSwitch, its message): applied once the engine is empty
        self.past_counters: dict[str, dict] = {}  # model -> the counters of the engines it ran before
        self.lora_used: dict[str, float] = {}  # the engine's LoRA adapters -> when a request last named one
        # Node-level compute priority among the node's workers (compute_claims.py).
        cpu = getattr(args, "device", "cpu") == "cpu"
        self.compute = ComputeClaims(bus, self.id, args.node_id, cores=self.cores if cpu else (),
                                     enabled=args.compute_yield, scheduling=args.scheduling,
                                     max_yield_s=args.max_yield_s)
        self.kv_arenas: dict[str, tuple] = {}  # the node's KV arenas it mapped: key -> (descriptor, tensor)

    # -- start-up: map the weights and the KV arena of their shape, lease blocks

    async def start(self) -> None:
        a, s = self.args, self.bus.subjects
        self.pool = pool = KVPoolClient(self.bus, a.node_id, self.id)
        self.served = a.served_model_name or a.model
        self.load = LoadRequest(model=a.model, dtype=a.dtype, quantization=a.quantization, worker_id=self.id,
                                name=self.served)
        self.engine, w, arena = await model_switch.build_engine(self, self.load, self.served)
        self.arena, kv = arena, self.engine.kv_cache
        pool.model, pool.weights_bytes, pool.arena = self.served, node_memory.weights_nbytes(w), arena.key
        await self.apply_partition()
        if kv.is_cuda:  # what tests/test_cuda_mesh.py reads: one copy of the weights, opened by handle
            import torch

            log.info("worker %s memory: weights=%s weights_handle=%s weights_bytes=%d arena=%s arena_handle=%s "
                     "own_gpu_bytes=%d", self.id, w.path, w.ipc["handle"][:16], w.ipc["alloc_bytes"], arena.path,
                     arena.ipc["handle"][:16], torch.cuda.memory_allocated(kv.device))
        self.blocks = KVBlocks(self.engine, pool, a.lease_blocks, arena.swap_blocks, report=self._post,
                               arena_blocks=arena.num_blocks)
        await self.blocks.start()
        await self.compute.start()
        for verb, cb in (("prefill", self._on_request), ("adopt", self._on_adopt), ("abort", self._on_abort),
                        ("role", self._on_role), ("model", self._on_model)):
            await self.bus.nc.subscribe(s.worker(self.id, verb), cb=cb)
        await self.bus.nc.subscribe(s.abort, cb=self._on_superseded)
        await pool.watch_epoch(arena.epoch, self._pool_restarted)
        await pool.subscribe("retired", self._on_arena_retired)
        self.tasks = [asyncio.ensure_future(self._heartbeats()), asyncio.ensure_future(self._run())]
        log.info("worker %s ready: %s, %d KV blocks of the arena leased", self.id, self.role,
                 self.engine.block_pool.num_free)

    def _step(self) -> list[RequestOutput]:
        """One engine step, on the step thread, on the thread count the tuner picks (not measured while
        the model may still wait for its layers: layered loading)."""
        if self.tuner is None or self.engine.model.gate is not None:
            return self.engine.step()
        return self.engine.step(self.tuner.run)

    async def drain(self, timeout: float) -> None:
        """SIGTERM: take nothing new (the heartbeat says so), hand every sequence on as a prefill
        worker does (after its first token, for those still prefilling), or finish it where no
        other worker can take it; return once none is left, or after `timeout` (what is left
        then is re-dispatched by the scheduler as for a lost worker)."""
        if getattr(self, "engine", None) is None:  # still starting: nothing to hand on
            return
        self.draining = True
        self._post_role(RoleSwitch(role="prefill", reason="draining"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self.streams or self.inbox) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        log.info("worker %s drained%s", self.id,
                 "" if not self.streams else f"; {len(self.streams)} sequences left to be re-dispatched")

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.deliveries:
            await asyncio.wait(self.deliveries, timeout=2.0)
        await self.blocks.close()
        await self.compute.close()
        await self.bus.nc.flush()

    # -- messages in (applied between steps)

    def _post(self, kind: str, m) -> None:
        """Queues something that changes the engine, applied at the next iteration boundary."""
        self.inbox.append((kind, m))
        self.wake.set()

    async def _on_request(self, msg) -> None:
        await self.bus.ack(msg)
        req = GenerateRequest.decode(msg.data)
        self.received_by_priority[req.priority] += 1
        self._post("request", req)
        if req.priority == "interactive":  # claimed now, not after the step in progress
            if self.interactive_interrupts:
                self.urgent.set()
            await self.compute.hold(INTERACTIVE)

    async def _on_adopt(self, msg) -> None:
        await self.bus.ack(msg)
        h = Handoff.decode(msg.data)
        if h.node_id != self.args.node_id:  # prefilled on another node: its blocks come over first
            self.blocks.import_remote(h)
        else:
            self._post("adopt", h)

    async def _on_abort(self, msg) -> None:
        self._post("abort", Abort.decode(msg.data))

    async def _on_role(self, msg) -> None:
        self._post_role(RoleSwitch.decode(msg.data))

    def _post_role(self, m: RoleSwitch) -> None:
        """A switch waits for no long step (it ends the one in progress): a prefill step of
        thousands of tokens takes seconds on a CPU, and the scheduler already routes by the new role."""
        self._post("role", m)
        self.urgent.set()

    async def _on_arena_retired(self, msg) -> None:
        r = ArenaRetired.decode(msg.data)
        if model_switch.forget_arena(self, r.key, r.arena_id):
            model_switch.close_dropped(self)
            log.info("worker %s let go of KV arena %s (retired: %s)", self.id, r.key, r.reason)

    async def _on_model(self, msg) -> None:
        self._post("model", (ModelSwitch.decode(msg.data), msg))

    async def _switch_model_when_idle(self) -> None:
        """A model switch waits until the engine has finished what it runs (model_switch.py)."""
        if self.pending_model is None or self.engine.has_unfinished() or self.unpublished:
            return
        m, msg = self.pending_model
        self.pending_model = None
        if self.draining:  # about to exit: it serves nothing new
            await msg.respond(ModelSwitchReply(ok=False, refused=True, error=f"worker {self.id} is draining").encode())
            return
        reply = await model_switch.switch_model(self, m)
        await self._heartbeat()  # the scheduler routes by the model a heartbeat names
        await msg.respond(reply.encode())

    async def replace_engine(self, engine: LLMEngine, served: str, load: LoadRequest, weights_bytes: int,
                             arena) -> None:
        """At an iteration boundary with nothing running: the old engine's blocks go back to the pool
        (to their arena), the new model's are leased from its arena under its quota, and its compute
        partition applies."""
        await self.blocks.close()
        self.past_counters = counters_by_model(self.engine.stats, self.served, self.past_counters)
        self.engine, self.served, self.load, self.arena = engine, served, load, arena
        self.pool.model, self.pool.weights_bytes, self.pool.arena = served, weights_bytes, arena.key
        self.blocks = KVBlocks(engine, self.pool, self.args.lease_blocks, self.arena.swap_blocks, report=self._post,
                               arena_blocks=self.arena.num_blocks)
        await self.blocks.start()
        await self.apply_partition()

    async def apply_partition(self) -> None:
        """The cores of the model it serves (the manifest's `cpus`, CPU backend): every thread of the
        process moves onto them and steps run at most one torch thread per core; a model without
        `cpus` runs on all the cores the worker started with. A partition this node cannot give
        (a core it lacks) is logged and ignored."""
        if self.manifest is None or getattr(self.args, "device", "cpu") != "cpu":
            return
        m = self.manifest.current()
        if m is None or (all(x.cpus is None for x in m.models) and self.cores == self.node_cores):
            return  # nothing partitioned, now or before: leave the threads as they are
        try:
            cores = resolve_cpus(m.models, self.node_cores).get(self.served, self.node_cores)
        except PartitionError as e:
            log.error("worker %s: the manifest's cpus cannot be applied here: %s; using every core", self.id, e)
            cores = self.node_cores
        apply_cpus(cores)
        self.compute.cores = list(cores)  # its claims and yields concern these cores
        n = threads_for(cores, self.threads)
        await asyncio.get_running_loop().run_in_executor(self.stepper, _set_threads, n)
        if self.tuner is not None:
            self.tuner.limit(n)
        self.cores = cores
        log.info("worker %s runs %s on cores %s (%d torch threads)", self.id, self.served, format_cpus(cores), n)

    async def _on_superseded(self, msg) -> None:
        """A gateway re-submitted a request (its scheduler restarted...): the old attempt stops here,
        even though no scheduler routed this abort."""
        a = Abort.decode(msg.data)
        if a.attempt is not None and self.attempts.get(a.request_id, a.attempt + 1) <= a.attempt:
            self._post("abort", a)

    def _pool_restarted(self, epoch: str) -> None:
        """The node's kv-pool restarted: its ledger no longer knows the blocks this worker holds and
        may lease them to others, so nothing in them can be trusted. The simplest sound recovery is
        the lost-worker one: exit, the launcher restarts the worker on the new arena, and the
        scheduler re-dispatches its requests (the gateways continue them from the tokens sent)."""
        log.error("worker %s: the kv-pool restarted (epoch %s); exiting so that its requests are recomputed",
                  self.id, epoch[:8])
        logging.shutdown()
        os._exit(75)

    async def _apply_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for kind, m in inbox:
            if kind == "request":
                await self._add(m)
            elif kind == "adopt":
                if self.attempts.get(m.request.request_id, m.request.attempt) < m.request.attempt:
                    await self._abort(Abort(request_id=m.request.request_id, reason="superseded",
                                            attempt=m.request.attempt - 1))  # its old attempt still runs here
                await self._adopt(m)
            elif kind == "recompute":  # its blocks could not come over from another node
                self.chunk_seq[m.request.request_id] = m.next_seq
                await self._add(m.request.model_copy(
                    update={"output_token_ids": m.token_ids[len(m.request.prompt_token_ids):]}))
            elif kind == "aborted":  # while its blocks came over
                await self._done(m.request.request_id, "abort", m.request.attempt)
            elif kind == "reclaim":  # another worker of the node is short of blocks
                await self.blocks.reclaim()
            elif kind == "role":
                await self._switch_role(m)
            elif kind == "model":
                self.pending_model = m
            else:
                await self._abort(m)

    async def _abort(self, m: Abort) -> None:
        if m.attempt is not None and self.attempts.get(m.request_id, m.attempt + 1) > m.attempt:
            return  # superseded meanwhile by the attempt now running here
        self.blocks.cancel(m.request_id)
        self.engine.abort(m.request_id, m.reason)
        self._forget(m.request_id)
        # not streamed later as a newer attempt's tokens:
        self.unpublished = [o for o in self.unpublished if o.request_id != m.request_id]
        if self.streams.pop(m.request_id, None) is not None:
            await self._done(m.request_id, m.reason)

    async def _add(self, req: GenerateRequest) -> None:
        if self.attempts.get(req.request_id, req.attempt) < req.attempt:  # its old attempt still runs here
            await self._abort(Abort(request_id=req.request_id, reason="superseded", attempt=req.attempt - 1))
        # its prefix back from the host tier
        await self.blocks.prepare(req.prompt_token_ids + req.output_token_ids, req.lora.key if req.lora else None,
                                  req.cache_salt)
        try:
            lora = await self._lora(req.lora)
            self.engine.add_request(req.request_id, req.prompt_token_ids, wire.sampling_params(req.sampling),
                                    arrival_time=time.monotonic(), output_token_ids=req.output_token_ids,
                                    priority=req.priority, after=req.after, lora=lora, cache_salt=req.cache_salt)
        except RequestError as e:
            await self._refuse(req, str(e), len(req.output_token_ids), status=400)
            return
        self.streams[req.request_id] = req
        self.attempts[req.request_id] = req.attempt
        if req.attempt:
            log.info("worker %s: request %s, attempt %d, from %d tokens", self.id, req.request_id, req.attempt,
                     len(req.output_token_ids))
        self.received[req.request_id] = time.time()
        self.chunk_seq.setdefault(req.request_id, 0)
        if self.role == "prefill":
            self.to_hand_off.add(req.request_id)

    async def _refuse(self, req: GenerateRequest, error: str, index: int, seq: int = 0,
                      status: int | None = None) -> None:
        """Ends a request this worker cannot run, with the reason in its stream (status 400: the
        request's own fault)."""
        await self.bus.publish(req.stream_subject, TokenChunk(
            request_id=req.request_id, seq=seq, index=index, token_ids=[], finished=True,
            finish_reason="error", error=error, error_status=status, worker_id=self.id, attempt=req.attempt))
        await self._done(req.request_id, "error", req.attempt)

    async def _lora(self, ref: LoRARef | None) -> str | None:
        """The engine's name of a request's LoRA adapter, which this worker reads from the adapter's
        files the first time (they are small; the gateway checked them) and keeps, the KEEP_LORAS
        most recently used that no sequence uses; raises RequestError saying why it cannot load."""
        if ref is None:
            return None
        name = ref.engine_name
        if name not in self.engine.loras:
            idle = sorted((t, n) for n, t in self.lora_used.items()
                          if n in self.engine.loras and not self.engine.lora_in_use(n))
            for _, old in idle[:max(0, len(self.engine.loras) + 1 - KEEP_LORAS)]:
                self.engine.remove_lora(old)
            t0 = time.perf_counter()
            try:
                w = await asyncio.get_running_loop().run_in_executor(
                    self.stepper, lambda: self.engine.load_lora(name, ref.path))
            except LoRAError as e:
                raise RequestError(f"the LoRA adapter {ref.name!r} cannot be served: {e}") from None
            except Exception as e:  # noqa: BLE001 - a corrupt file fails its requests, not the worker
                raise RequestError(f"the LoRA adapter {ref.name!r} cannot be served: reading {ref.path} failed: "
                                   f"{type(e).__name__}: {e}") from None
            log.info("worker %s: LoRA adapter %s loaded from %s in %.3f s (%d bytes)", self.id, ref.name, ref.path,
                     time.perf_counter() - t0, w.nbytes)
        self.lora_used[name] = time.monotonic()
        return name

    async def _adopt(self, h: Handoff) -> None:
        req = h.request
        try:
            lora = await self._lora(req.lora)
        except RequestError as e:  # its blocks are this worker's now: adopted, then freed by the abort
            self.blocks.adopt(h)
            self.engine.abort(req.request_id, "error")
            await self._refuse(req, str(e), len(h.token_ids) - len(req.prompt_token_ids), h.next_seq, status=400)
            return
        self.blocks.adopt(h, lora)
        self.streams[req.request_id] = req
        self.attempts[req.request_id] = req.attempt
        self.chunk_seq[req.request_id] = h.next_seq
        self.decode_start[req.request_id] = time.time()

    # -- the loop

    async def _run(self) -> None:
        """The loop, or the process: a worker whose loop died but whose heartbeats went on would
        hold its requests forever; exiting makes them the lost-worker case (re-dispatched)."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("worker %s: the engine loop failed; exiting", self.id)
            logging.shutdown()
            os._exit(70)

    async def _loop(self) -> None:
        # A step's tokens are streamed while the next step computes (the cores would otherwise wait
        # on the messages); a prefill worker streams before its next step, since its hand-offs
        # detach sequences from the engine, which only happens between steps.
        while True:
            self.urgent.clear()  # what came so far is in the inbox, hence in the next step
            await self._apply_inbox()
            await self._claim_compute()
            await self._switch_model_when_idle()
            if not self.engine.has_unfinished():
                if self.unpublished:
                    await self._flush()
                    continue
                self.wake.clear()
                if not self.inbox:
                    await self.wake.wait()
                continue
            if await self._yield_compute():
                continue
            if self.compute.claimed(INTERACTIVE):  # interactive prompts on the node: keep chunks small
                self.engine.scheduler.saw_interactive()
            try:
                await self.blocks.before_step()
            except (nats.errors.Error, asyncio.TimeoutError, ConnectionError) as e:
                # The bus is reconnecting (a restarted nats-server) or the kv-pool is restarting:
                # try again; a new pool epoch makes this worker exit (_pool_restarted).
                log.warning("worker %s: block lease failed (%s); retrying", self.id, e or type(e).__name__)
                await asyncio.sleep(0.2)
                continue
            waited = self.engine.scheduler.num_waiting
            t0, began, interrupted = time.perf_counter(), time.time(), self.engine.interrupted_steps
            step = asyncio.get_running_loop().run_in_executor(self.stepper, self._step)
            await self._flush()
            outputs = await step
            took = time.perf_counter() - t0
            # With tracing on, every step is a span: what a request's way to the worker waited on.
            telemetry.record("worker.step", None, began, worker=self.id, role=self.role,
                             interrupted=self.engine.interrupted_steps > interrupted,
                             owed=self.engine.owes_step, tokens=self.engine.last_step_tokens,
                             running=self.engine.scheduler.num_running,
                             waiting=self.engine.scheduler.num_waiting)
            self.step_s = took if not self.step_s else 0.8 * self.step_s + 0.2 * took
            self.compute.stepped()
            await self._claim_compute()  # an interactive prompt just computed: the claim ends at once
            await self.blocks.after_step()
            if waited and not self.engine.scheduler.num_waiting:  # room now: the scheduler hears it at once
                await self._heartbeat()
            if self.role == "prefill":
                await self._publish(outputs)
            else:
                self.unpublished = outputs

    async def _claim_compute(self) -> None:
        """Between steps: claims the node's cores while interactive prompts are to be computed here
        (queued or in the engine), and ends the claim once none is (compute_claims.py)."""
        prompts = self.engine.scheduler.has_prompt_work(INTERACTIVE) or any(
            kind == "request" and m.priority == "interactive" for kind, m in self.inbox)
        await self.compute.hold(INTERACTIVE if prompts else None)

    async def _yield_compute(self) -> bool:
        """Before a step: while another worker of the node claims the cores for a class above this
        step's best, wait (bounded; compute_claims.py). The last step's tokens go out first. True: it
        waited (the loop applies what came meanwhile and asks again)."""
        level = self.engine.scheduler.top_class()
        if self.compute.wait_until(level) is None:
            return False
        await self._flush()
        self.wake.clear()
        if not self.inbox:
            await self.compute.wait(level, self.wake)
        return True

    async def _flush(self) -> None:
        outputs, self.unpublished = self.unpublished, []
        await self._publish(outputs)

    async def _switch_role(self, m: RoleSwitch) -> None:
        """At an iteration boundary: to decode, keep every sequence here (none is handed off any
        more); to prefill, stream what the last step made, then hand every decoding sequence to
        a decode worker and the ones still prefilling after their first token, as a prefill worker
        does. Heartbeats at once, which is how the scheduler learns the switch is done."""
        t0, old = time.perf_counter(), self.role
        if self.draining and m.reason != "draining":
            return  # leaving: it stays a prefill worker that nobody routes to
        if m.role == old:
            await self._heartbeat()
            return
        await self._flush()
        self.role = m.role
        handed = 0
        if m.role == "decode":
            self.to_hand_off.clear()
        else:
            for rid in list(self.streams):
                seq = self.engine.requests.get(rid)
                if seq is None:
                    continue
                self.to_hand_off.add(rid)
                if seq.status == SequenceStatus.RUNNING and seq.num_output_tokens and \
                        seq.num_tokens - seq.num_computed_tokens == 1:  # decoding: its KV is all computed
                    await self._hand_off(rid)
                    handed += 1
        await self._heartbeat()
        log.info("worker %s role %s -> %s in %.3f s (%d decoding sequences handed off, %d kept): %s", self.id,
                 old, m.role, time.perf_counter() - t0, handed, len(self.streams), m.reason)

    async def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            req = self.streams.get(out.request_id)
            if req is None:
                continue
            seq_no = self.chunk_seq[out.request_id]
            self.chunk_seq[out.request_id] = seq_no + 1
            self.tokens_streamed += len(out.new_token_ids)
            self._trace(req, out)
            lps = None if req.sampling.logprobs is None else [wire.logprob(lp) for lp in out.new_logprobs]
            prompt_lps = None if out.prompt_logprobs is None else [wire.logprob(lp) for lp in out.prompt_logprobs]
            await self.bus.publish(req.stream_subject, TokenChunk(
                request_id=out.request_id, seq=seq_no, index=out.num_output_tokens - len(out.new_token_ids),
                token_ids=out.new_token_ids, logprobs=lps, finished=out.finished, finish_reason=out.finish_reason,
                num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                worker_id=self.id, attempt=req.attempt, prompt_logprobs=prompt_lps, error=out.error,
                error_status=400 if out.error else None))
            if out.finished:
                del self.streams[out.request_id]
                self.to_hand_off.discard(out.request_id)
                await self._done(out.request_id, out.finish_reason)
            elif out.request_id in self.to_hand_off:
                await self._hand_off(out.request_id)

    def _trace(self, req: GenerateRequest, out: RequestOutput) -> None:
        """Spans for the queue wait, the prefill and the decode of a request, once each is over."""
        if not telemetry.enabled():
            return
        rid, now = req.request_id, time.time()
        received = self.received.pop(rid, None)
        if received is not None:  # this step produced the request's first token here
            seq = self.engine.requests.get(rid)
            scheduled = seq.first_scheduled_time if seq is not None and seq.first_scheduled_time else received
            attrs = dict(worker=self.id, request_id=rid)
            telemetry.record("queue", req.trace, received, scheduled, **attrs)
            telemetry.record("prefill", req.trace, scheduled, now, prompt_tokens=out.num_prompt_tokens,
                             cached_tokens=out.num_cached_tokens, **attrs)
            if self.role != "prefill":
                self.decode_start[rid] = now
        if out.finished and rid in self.decode_start:
            telemetry.record("decode", req.trace, self.decode_start.pop(rid), now, worker=self.id, request_id=rid,
                             output_tokens=out.num_output_tokens)

    async def _hand_off(self, request_id: str) -> None:
        """Prefill is done: pass the sequence on by block ids (no KV byte moves)."""
        self._forget(request_id)
        req = self.streams.pop(request_id)
        self.attempts.pop(request_id, None)
        seq, blocks, shared = await self.blocks.detach(request_id)
        with telemetry.span("kv.handoff", req.trace, worker=self.id, request_id=request_id, blocks=len(blocks)):
            self._deliver(self.bus.subjects.handoff, Handoff(
                request=req, token_ids=seq.token_ids, block_ids=blocks, shared_block_ids=shared,
                num_computed_tokens=seq.num_computed_tokens, num_cached_tokens=seq.num_cached_tokens,
                next_seq=self.chunk_seq.pop(request_id), from_worker=self.id, node_id=self.args.node_id,
                arena=self.pool.arena))

    def _forget(self, request_id: str) -> None:
        """Drops what this worker keeps per request, once the request has left it (ended, aborted or
        handed on): nothing per request may outlive it in a long-running worker."""
        self.received.pop(request_id, None)
        self.decode_start.pop(request_id, None)
        self.to_hand_off.discard(request_id)

    async def _done(self, request_id: str, reason: str | None, attempt: int | None = None) -> None:
        self._forget(request_id)
        self.chunk_seq.pop(request_id, None)
        attempt = self.attempts.pop(request_id, 0) if attempt is None else attempt
        self._deliver(self.bus.subjects.done, Done(request_id=request_id, worker_id=self.id,
                                                   finish_reason=reason, attempt=attempt))

    def _deliver(self, subject: str, msg) -> None:
        """Handoffs and ends go to the scheduler acknowledged, in the background: one reconnecting to
        a restarted nats-server would miss them, and the request would hang (or hold a seat)."""
        task = asyncio.ensure_future(self.bus.deliver(subject, msg))
        self.deliveries.add(task)
        task.add_done_callback(self.deliveries.discard)

    def _pending_tokens(self) -> tuple[int, int]:
        """(prompt tokens not yet computed, output tokens not yet generated) of its sequences."""
        prefill = decode = 0
        for seq in list(self.engine.requests.values()):  # one copy: the step thread may end one meanwhile
            if seq.prefilling:
                prefill += seq.num_tokens - seq.num_computed_tokens
            decode += max(0, seq.params.max_tokens - seq.num_output_tokens)
        for kind, m in self.inbox:
            if kind == "request":
                prefill += len(m.prompt_token_ids) + len(m.output_token_ids)
                decode += max(0, m.sampling.max_tokens - len(m.output_token_ids))
        return prefill, decode

    def _waiting_by_priority(self, stats: dict) -> dict[str, int]:
        """The engine's waiting requests and those in the inbox, not yet given to it."""
        out = dict(stats["waiting_by_priority"])
        for kind, m in list(self.inbox):
            if kind == "request":
                out[m.priority] = out.get(m.priority, 0) + 1
        return out

    async def _heartbeats(self) -> None:
        kept_alive_at = time.monotonic()
        while True:
            await self._heartbeat()
            if time.monotonic() - kept_alive_at >= KEEPALIVE_S:
                kept_alive_at = time.monotonic()
                await self._keep_waiting_alive()
            await asyncio.sleep(self.args.heartbeat_interval)

    async def _keep_waiting_alive(self) -> None:
        """Tells the gateways which of their requests this engine holds without streaming tokens
        (waiting: not started or preempted; or still in its prompt's prefill): a background prompt
        may wait longer than a gateway waits for a token, and one not heard of is taken for lost."""
        for seq in list(self.engine.requests.values()):  # one copy: the step thread may end one meanwhile
            req = self.streams.get(seq.request_id)
            if req is not None and (seq.status == SequenceStatus.WAITING or seq.prefilling):
                await self.bus.publish(req.stream_subject, TokenChunk(
                    request_id=req.request_id, seq=0, index=seq.num_output_tokens, token_ids=[], queued=True,
                    worker_id=self.id, attempt=req.attempt))

    async def _heartbeat(self) -> None:
        """What this worker runs and can take (the scheduler admits from it), and its counters."""
        e, pool = self.engine, self.engine.block_pool
        by_model = counters_by_model(e.stats, self.served, self.past_counters)
        lifetime: dict = {}
        for counts in by_model.values():
            lifetime = with_past(lifetime, counts)
        stats = e.stats | lifetime
        pending_prefill, pending_decode = self._pending_tokens()
        rates = e.scheduler.costs.rates
        await self.bus.publish(self.bus.subjects.heartbeat, Heartbeat(
            worker_id=self.id, role=self.role, model=self.served, node_id=self.args.node_id,
            num_running=stats["num_running"], num_waiting=stats["num_waiting"] + len(self.inbox),
            free_blocks=pool.num_free, held_blocks=pool.num_held,
            total_blocks=min(pool.num_blocks, self.blocks.arena_blocks or pool.num_blocks),
            block_size=e.config.block_size, max_model_len=e.max_model_len,
            max_num_seqs=e.config.scheduler.max_num_seqs,
            max_num_batched_tokens=e.config.scheduler.max_num_batched_tokens,
            prefix_queries=stats["prefix_queries"], prefix_hits=stats["prefix_hits"],
            num_preemptions=stats["num_preemptions"], num_priority_preemptions=stats["num_priority_preemptions"],
            running_by_priority=stats["running_by_priority"], waiting_by_priority=self._waiting_by_priority(stats),
            received_by_priority=dict(self.received_by_priority), preemptions_by_mode=stats["preemptions_by_mode"],
            spec_decode=stats["spec_decode"], counters_by_model=by_model, io_cpu_s=time.thread_time(), step_s=round(self.step_s, 4), tokens_streamed=self.tokens_streamed,
            pending_prefill_tokens=pending_prefill, pending_decode_tokens=pending_decode, draining=self.draining,
            prefill_tokens_per_s=round(rates.prefill_tokens_per_s, 1), decode_tokens_per_s=round(rates.decode_tokens_per_s, 1),
            compute_yields=self.compute.yields, compute_yield_s=self.compute.yield_s,
            compute_claim=self.compute.claiming, interrupted_steps=stats["interrupted_steps"],
            threads=self.tuner.stats() if self.tuner is not None else {}, arena=self.pool.arena or "",
            ipc_open=self._ipc_open(), time=time.time()))

    def _ipc_open(self) -> list[str]:
        """The node's GPU allocations this worker has open (none on the CPU backend)."""
        if getattr(self.args, "device", "cpu") != "cuda":
            return []
        from meshserve.shared import cuda_ipc

        return cuda_ipc.open_handles()


def add_arguments(p) -> None:
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--lease-blocks", type=int, default=256, help="blocks leased from the kv-pool at a time")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to hand off or finish its sequences before exiting")
    add_scheduling_arguments(p, preemption=True)
    add_compute_yield_argument(p)
    p.add_argument("--max-yield-s", type=float, default=MAX_YIELD_S,
                   help="the longest a step waits in a row for another worker's compute claim, after which one step "
                        "runs (default: %(default)s)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="every step on --threads threads (default: each kind of step on 1 or --threads threads, "
                        "whichever measures faster; a busy core makes 1 faster)")
    add_speculative_arguments(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, or "
                   "$MESHSERVE_WORKER_THREADS)")


async def main(args, role: str) -> None:
    async def start(bus: Bus):
        worker = Worker(bus, args, role)
        await worker.start()

        async def stop() -> None:
            await worker.drain(args.drain_timeout)
            await worker.stop()

        return stop

    await run_service(role, args, start)
