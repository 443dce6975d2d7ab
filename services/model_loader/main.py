"""`meshserve serve model-loader`: loads each model once, into memory every worker on the node maps,
and answers `models.load` with where each tensor lives. Workers of one model on a node therefore
hold one copy of the weights between them.

With `--device cpu` (the default) that memory is a shared-memory file; with `--device cuda` it is
one allocation on the GPU whose CUDA IPC handle travels in the descriptor (shared/node_memory.py):
the workers open it and run on the GPU without copying the weights.

A model is loaded in the format asked for: dtype and, with `quantization: "int8"`, int8 projections
quantized at load (kernels/int8_linear.py; on a CPU in the int8 kernel's blocked layout). Each
(model, dtype, quantization) is its own entry, so one source can be served both ways at once.

Tiers (tiers.py keeps the books; docs/models.md):
- mapped: in the node's shared memory, where workers map it (a shared file; on CUDA the GPU
  allocation), within `--weights-memory-gb` (and at most `--max-models` models);
- host: a copy in this process's memory, within `--host-cache-gb`: back to mapped by one copy;
- disk: the prepared form of a GGUF or a Hugging Face directory (prepared.py: copied back without
  torch), kept after its first load from the model's own files (read, dequantized, fused); the
  first load is answered before the prepared copy is written.
Beyond a budget the least recently used model goes down a tier, except a pinned one (manifest) and
one a worker maps now (each LoadRequest names its worker; a worker's next load moves it off the
model it had: that is how a model switch lets go of the old one). In-use and pinned models alone
may exceed the budget (logged). Each load's tier and time are logged and kept in the status
(`<ns>.models.<node>.status`). An evicted shared file is unlinked: a worker that still maps it
keeps its mapping until it unmaps it. An evicted GPU allocation is freed once no worker of the node
lists its CUDA IPC handle as open in a heartbeat sent after the eviction (node_memory.RetiredBuffers);
the host tier on CUDA is a copy in this process's memory, copied back into a new allocation, and a
prepared form is the GPU allocation's bytes.

Layered loading (`--layered-loading`, on by default; a manifest's `layered_loading` per model; both
backends): a load is answered as soon as its buffer exists, and its parts are written afterwards in
the order a forward pass reads them, with a readiness word workers wait on per layer
(loads.py, shared/model/layer_gate.py). Prewarm (`<ns>.models.<node>.prewarm`): the scheduler
asks for a model ahead of its requests, up to the host or the mapped tier.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import threading
import time
from typing import TYPE_CHECKING

from meshserve.shared import node_memory, shm
from meshserve.shared.bus import Bus
from meshserve.shared.models_repo import resolve
from meshserve.shared.manifest import Manifest, load_manifest
from meshserve.shared.schemas import Heartbeat, LoadRequest, PrewarmRequest, WeightsDescriptor
from meshserve.shared.service import run_service

from . import loads, prepared
from .tiers import GB, Entry, Tiers

if TYPE_CHECKING:
    import torch

log = logging.getLogger("meshserve.model_loader")

WORKER_TIMEOUT_S = 10.0  # a worker silent this long no longer holds the model it mapped


class ModelLoader:
    def __init__(self, bus: Bus, node_id: str, max_models: int, device: str = "cpu",
                 weights_memory_gb: float | None = None, host_cache_gb: float = 0.0, manifest: Manifest | None = None,
                 default_dtype: str = "bfloat16", layered: bool = True):
        self.bus, self.node_id, self.max_models, self.device = bus, node_id, max_models, device
        self.default_dtype = default_dtype
        self.tiers = Tiers(weights_budget=None if weights_memory_gb is None else int(weights_memory_gb * GB),
                           host_budget=int(host_cache_gb * GB), max_mapped=max_models)
        self.manifest = manifest
        self.gpu_buffers: dict[tuple[str, str, str | None], torch.Tensor] = {}  # cuda: kept alive for the workers
        self.freeing = node_memory.RetiredBuffers(WORKER_TIMEOUT_S)  # cuda: evicted, freed once no worker has them open
        self.seen: dict[str, float] = {}  # worker id -> its last heartbeat
        self.tasks: list[asyncio.Task] = []
        self.loads: set[asyncio.Task] = set()  # loads in progress
        self.layered = layered
        self.stop_keeping = threading.Event()  # set on close: a prepared form being written is given up

    # -- one load: opened (the buffer made, its layout known), then written part by part (loads.py)

    def open_load(self, model: str, dtype: str, quantization: str | None = None, host: bytes | None = None,
                  meta: tuple | None = None, source: bool = False, name_suffix: str = "") -> loads.Load:
        """The buffer made for one load from the hottest tier holding the model (the host copy given,
        the prepared form, else the model's files; `source`: the files even when prepared)."""
        variant = f"{dtype}-{quantization}" if quantization else dtype
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model}-{variant}")[-120:]
        prefix = shm.mesh_prefix(self.bus.subjects.ns, self.node_id, getattr(self.bus, "url", ""))
        name = f"{prefix}-weights-{safe}{name_suffix}"
        if host is not None:  # the host tier: one copy into a new shared file
            specs, config = meta
            return loads.open_host(name, host, specs, config, self.device)
        kept = prepared.entry(resolve(model), variant, self.device)
        found = prepared.load(kept) if kept is not None and not source else None
        if found is not None:
            return loads.open_prepared(name, *found, how=f"from {kept}", device=self.device)
        load = loads.open_source(model, dtype, quantization, name, self.device)
        load.keep_to = kept
        return load

    def finish_load(self, load: loads.Load) -> None:
        """Writes every part, then keeps a prepared form (a mesh's load answers between the two)."""
        load.run()
        self.keep_prepared(load)

    @staticmethod
    def keep_prepared(load: loads.Load) -> None:
        """A load from the model's files: its bytes kept on disk for the next load (prepared.py)."""
        if load.keep_to is not None:
            prepared.keep(load.keep_to, load.path, load.specs, load.config, load.buffer)

    def _descriptor(self, model: str, quantization: str | None, load: loads.Load, took: float,
                    layered: bool = False) -> WeightsDescriptor:
        return WeightsDescriptor(model=model, path=load.path, backend=self.device, ipc=load.ipc, config=load.config,
                                 tensors=load.specs, tokenizer_path=str(resolve(model)), quantization=quantization,
                                 tier=load.tier, load_s=took, ready_path=load.ready_path if layered else None)

    def load_now(self, model: str, dtype: str, quantization: str | None = None, host: bytes | None = None,
                 meta: tuple | None = None) -> WeightsDescriptor:
        """One whole load, not layered, in the calling thread (the prepared-form tests and the tier
        load times of bench-models)."""
        t0 = time.monotonic()
        load = self.open_load(model, dtype, quantization, host, meta)
        try:
            self.finish_load(load)
        except BaseException:
            load.failed()
            raise
        return self._descriptor(model, quantization, load, time.monotonic() - t0)

    # -- asks

    def _spec(self, key):
        return self.manifest.by_weights(self.default_dtype).get(key) if self.manifest else None

    def _layered(self, spec) -> bool:
        """Layered loading for this model: its manifest key, else --layered-loading (either backend:
        loads.py `Load.layered`)."""
        return spec.layered_loading if spec is not None and spec.layered_loading is not None else self.layered

    async def get(self, req: LoadRequest) -> WeightsDescriptor:
        key = (req.model, req.dtype, req.quantization)
        spec = self._spec(key)
        e = self.tiers.entry(key, req.name or (spec.id if spec else req.model))
        e.pinned = bool(spec and spec.pinned)
        if req.worker_id:
            self.seen[req.worker_id] = time.monotonic()
            self.freeing.asked(req.worker_id)
            self.tiers.use(req.worker_id, e, beside=req.beside)
        else:
            self.tiers.touch(e)
        return await self._mapped(e, spec, self._layered(spec))

    async def _mapped(self, e: Entry, spec, layered: bool) -> WeightsDescriptor:
        """`e`'s descriptor once in the mapped tier (a layered load's: once its buffer exists)."""
        if e.tier == "mapped":
            e.hits += 1
            return e.desc
        if e.loading is None:
            e.loading = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(self._bring_in(e, spec.memory_quota_gb if spec else None, layered))
            self.loads.add(task)
            task.add_done_callback(self.loads.discard)
        return await asyncio.shield(e.loading)

    async def _bring_in(self, e: Entry, quota_gb: float | None, layered: bool) -> None:
        """Brings `e` into the mapped tier and resolves `e.loading` with its descriptor: a layered load
        as soon as its buffer exists (workers map it and wait per part), else once it is written."""
        model, dtype, quantization = e.key
        was, t0, load = e.tier, time.monotonic(), None
        e.tier = "loading"
        try:
            load = await asyncio.to_thread(self.open_load, model, dtype, quantization, e.host, e.meta)
            if quota_gb is not None and load.nbytes > quota_gb * GB:
                raise RuntimeError(f"its weights take {load.nbytes / GB:.3f} GiB, over its memory_quota_gb of "
                                   f"{quota_gb:g}")
            if layered:
                load.layered()
                e.loading.set_result(self._descriptor(model, quantization, load, time.monotonic() - t0, True))
                log.info("layered load of %s (%s): %s mapped by workers while its parts are written", e.name, dtype,
                         load.path)
            await asyncio.to_thread(load.run)
        except asyncio.CancelledError:  # the loader stops (close): the load's files go, its writer stops
            if load is not None:
                load.failed()
            raise
        except Exception as err:  # noqa: BLE001 - the askers hear why (a layered load's workers by its word)
            log.error("loading %s failed: %s: %s", e.name, type(err).__name__, err)
            if load is not None:
                load.failed()
            e.tier, e.error = ("host", None) if was == "host" else ("failed", f"{type(err).__name__}: {err}")
            if not e.loading.done():
                e.loading.set_exception(err)
                e.loading.exception()  # retrieved: no warning when nobody was waiting
            e.loading = None
            return
        took = time.monotonic() - t0
        desc = self._descriptor(model, quantization, load, took)
        log.info("loaded %s (%s) into %s in %.3fs (%s; tier %s%s)", model, dtype, load.path, took, load.how,
                 load.tier, "; layered" if layered else "")
        self.tiers.mapped(e, desc, load.nbytes, load.ready_path)
        if load.buffer is not None:
            self.gpu_buffers[e.key] = load.buffer
        if not e.loading.done():
            e.loading.set_result(desc)
        e.loading = None
        for victim, to in self.tiers.evictions():
            self._evict(victim, to)
        if load.keep_to is not None:  # after the answer: its askers do not wait for it
            await prepared.keep_quietly(load.keep_to, load.path, load.specs, load.config, load.buffer,
                                        self.stop_keeping)

    # -- prewarm (the scheduler predicts a model from its request rate, services/scheduler/prewarm.py)

    async def prewarm(self, req: PrewarmRequest) -> dict:
        """Moves the models named in `evict` down a tier (unless in use or pinned), then brings the model
        up to `req.to`: mapped (a load no worker asked for yet) or host (its bytes in this process)."""
        for name in req.evict:
            v = next((x for x in self.tiers.entries.values() if x.name == name), None)
            if v is None or v.users or v.pinned or v.loading is not None or v.tier not in ("mapped", "host"):
                continue
            room = self.tiers.host_budget - self.tiers.used_bytes("host")
            self._evict(v, "host" if v.tier == "mapped" and v.nbytes <= room else "disk")
        spec = self._spec((req.model, req.dtype, req.quantization))
        if self.manifest is not None and spec is None:  # removed from it meanwhile
            return {"ok": False, "error": f"{req.name or req.model} is not in the manifest"}
        e = self.tiers.entry((req.model, req.dtype, req.quantization), req.name or (spec.id if spec else req.model))
        e.pinned = bool(spec and spec.pinned)
        self.tiers.touch(e)  # about to be used, as its rate says
        if req.to == "mapped":  # not layered: nobody waits for its first layers
            if e.tier != "mapped" and e.loading is None:
                e.prewarms += 1  # this load is the prewarm's (not one a request started)
            await self._mapped(e, spec, layered=False)
        elif e.tier == "disk" and e.loading is None and self.tiers.host_budget > 0:
            t0 = time.monotonic()
            data, meta = await asyncio.to_thread(self._host_copy, *e.key)
            if e.tier == "disk" and e.loading is None:  # not loaded meanwhile
                e.host, e.meta, e.nbytes, e.tier, e.error = data, meta, len(data), "host", None
                e.prewarms += 1
                self.tiers.touch(e)
                log.info("prewarmed %s (%s) into host memory in %.3fs", e.name, e.key[1], time.monotonic() - t0)
        for victim, to in self.tiers.evictions():
            self._evict(victim, to)
        return {"ok": True, "name": e.name, "tier": e.tier}

    def _host_copy(self, model: str, dtype: str, quantization: str | None) -> tuple[bytes, tuple]:
        """The model's mapped bytes, made through a shared file that is removed again."""
        load = self.open_load(model, dtype, quantization, name_suffix="-prewarm")  # not a mapped load's file
        try:
            self.finish_load(load)
            return loads.read_back(load.path, load.buffer), (load.specs, load.config)
        finally:
            load.release()

    def _evict(self, e: Entry, to: str) -> None:
        """Moves a model down to `to` (host: a copy in this process; disk: nothing kept here)."""
        desc = e.desc
        t0 = time.monotonic()
        if desc is not None:
            gpu = self.gpu_buffers.pop(e.key, None)
            if to == "host":
                e.host = loads.read_back(desc.path, gpu)
                e.meta = (desc.tensors, desc.config)
            node_memory.release(desc.backend, desc.path)
            if e.ready_path:
                shm.unlink(e.ready_path)
            if gpu is not None:  # freed once no worker has it open
                self.freeing.retire(desc.ipc["handle"], gpu, gpu.numel(), f"{e.name} ({e.key[1]})")
        if to != "host":
            e.host = e.meta = None
        self.tiers.moved(e, to if e.host is not None or to != "host" else "disk")
        log.info("evicted %s (%s) from %s to %s in %.3fs (%s)", e.name, e.key[1], "mapped" if desc else "host",
                 e.tier, time.monotonic() - t0, self.tiers.describe())

    # -- manifest and workers

    def reload(self, path: str | None) -> None:
        """Re-reads the manifest: pinning follows it, and a model no longer in it is unloaded once
        no worker maps it."""
        if path is None:
            return
        self.manifest = load_manifest(path)
        keys = set(self.manifest.by_weights(self.default_dtype))
        for e in self.tiers.entries.values():
            spec = self._spec(e.key)
            e.pinned = bool(spec and spec.pinned)
            e.removed = e.key not in keys
        self._sweep()
        log.info("manifest reloaded from %s: %s", path, ", ".join(self.manifest.names))

    def _sweep(self) -> None:
        """Workers silent for WORKER_TIMEOUT_S no longer hold their models; removed models with no
        worker left are unloaded."""
        now, since = time.monotonic(), self.bus.heard_since()  # the loader's own time off the bus is no one's silence
        for wid in [w for w, t in self.seen.items() if self.bus.silent_for(t, now) > WORKER_TIMEOUT_S]:
            del self.seen[wid]
            self.tiers.release(wid)
        for what in self.freeing.collect(now, since):
            log.info("freed the GPU memory of %s: no worker has it open", what)
        for e in list(self.tiers.entries.values()):
            if e.removed and not e.users and e.loading is None:
                if e.tier in ("mapped", "host"):
                    self._evict(e, "disk")
                self.tiers.drop(e)
                log.info("unloaded %s: no longer in the manifest", e.name)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._sweep()

    def status(self) -> dict:
        return {"node_id": self.node_id, **self.tiers.status(), "gpu_retired": self.freeing.status()}

    async def serve(self) -> None:
        async def on_load(msg):
            what = repr(msg.data[:200])
            try:
                req = LoadRequest.decode(msg.data)
                what = f"{req.model} ({req.dtype}{', ' + req.quantization if req.quantization else ''})"
                desc = await self.get(req)
                await msg.respond(desc.encode())
            except Exception as e:  # noqa: BLE001 - the asker must hear why
                log.exception("load failed")
                await self.bus.respond_error(msg, f"cannot load {what}: {type(e).__name__}: {e}")

        async def on_list(msg):
            import orjson
            await msg.respond(orjson.dumps([{"model": m, "dtype": d, "quantization": q, "ready": e.tier == "mapped"}
                                            for (m, d, q), e in self.tiers.entries.items()
                                            if e.tier in ("mapped", "loading")]))

        async def on_status(msg):
            import orjson
            await msg.respond(orjson.dumps(self.status()))

        async def on_reload(msg):
            import orjson
            try:
                self.reload(self.manifest_path)
                await msg.respond(orjson.dumps({"ok": True}))
            except Exception as e:  # noqa: BLE001 - the asker must hear why
                await msg.respond(orjson.dumps({"ok": False, "error": str(e)}))

        async def on_prewarm(msg):
            import orjson
            try:
                reply = await self.prewarm(PrewarmRequest.decode(msg.data))
            except Exception as e:  # noqa: BLE001 - the scheduler logs why
                log.warning("prewarm failed: %s: %s", type(e).__name__, e)
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            await msg.respond(orjson.dumps(reply))

        async def on_heartbeat(msg):
            hb = Heartbeat.decode(msg.data)
            self.seen[hb.worker_id] = time.monotonic()
            if hb.node_id == self.node_id:
                self.freeing.heard(hb.worker_id, hb.ipc_open)

        s = self.bus.subjects
        for verb, cb in (("load", on_load), ("list", on_list), ("status", on_status), ("reload", on_reload),
                        ("prewarm", on_prewarm)):
            await self.bus.nc.subscribe(s.models(verb, self.node_id), cb=cb)
        await self.bus.nc.subscribe(s.heartbeat, cb=on_heartbeat)
        self.tasks.append(asyncio.ensure_future(self._sweeper()))

    manifest_path: str | None = None

    def close(self) -> None:
        self.stop_keeping.set()
        for t in [*self.tasks, *self.loads]:
            t.cancel()
        for e in self.tiers.entries.values():
            if e.desc is not None:
                node_memory.release(e.desc.backend, e.desc.path)
            if e.ready_path:
                shm.unlink(e.ready_path)


def add_arguments(p) -> None:
    p.add_argument("--max-models", type=int, default=4, help="models kept mapped at most (LRU beyond)")
    p.add_argument("--weights-memory-gb", type=float, default=None,
                   help="GiB of the node's shared memory for mapped weights (LRU beyond, pinned and in-use "
                        "models excepted; default: no limit but --max-models)")
    p.add_argument("--host-cache-gb", type=float, default=0.0,
                   help="GiB of this process's memory for weights evicted from the mapped tier, brought back "
                        "by one copy (0: evicted weights go to disk)")
    p.add_argument("--layered-loading", action=argparse.BooleanOptionalAction, default=True,
                   help="answer a load as soon as the weights' buffer exists and write it layer by layer, so workers "
                        "compute a prompt's first layers while the later ones come (docs/models.md; CPU backend; a "
                        "manifest's `layered_loading` overrides it per model)")
    p.add_argument("--preload", action="store_true", help="load --model (and pinned models of --models) at start "
                                                          "instead of on first ask")


async def main(args) -> None:
    async def start(bus: Bus):
        manifest = load_manifest(args.models) if getattr(args, "models", None) else None
        loader = ModelLoader(bus, args.node_id, args.max_models, getattr(args, "device", "cpu"),
                             args.weights_memory_gb, args.host_cache_gb, manifest, args.dtype,
                             getattr(args, "layered_loading", True))
        loader.manifest_path = getattr(args, "models", None)
        await loader.serve()
        loop = asyncio.get_running_loop()
        if loader.manifest_path:  # SIGHUP: re-read the manifest
            loop.add_signal_handler(signal.SIGHUP, lambda: _logged(loader.reload, loader.manifest_path))
        if args.preload:
            first = [LoadRequest(model=args.model, dtype=args.dtype, quantization=args.quantization)]
            pinned = [LoadRequest(model=m.path, dtype=m.dtype or args.dtype, quantization=m.quantization, name=m.id)
                      for m in (manifest.models if manifest else ()) if m.pinned]
            try:
                for req in first + [r for r in pinned if r.model != args.model]:
                    try:
                        await loader.get(req)
                    except Exception as e:  # noqa: BLE001 - with a manifest, its requests will say why
                        if manifest is None:
                            raise
                        log.error("preloading %s failed: %s", req.name or req.model, e)
            except BaseException:  # a failed or cancelled start (shared/service.py) leaves no weights files
                loader.close()
                raise
        return loader.close

    await run_service("model-loader", args, start)


def _logged(f, *a) -> None:
    try:
        f(*a)
    except Exception as e:  # noqa: BLE001 - a bad manifest keeps the old one
        log.error("manifest not reloaded: %s", e)
