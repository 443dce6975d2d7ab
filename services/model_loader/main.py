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
- disk: the prepared form of a GGUF (prepared.py: copied back without torch), or the model's own
  files (prepared again: read, dequantized, fused).
Beyond a budget the least recently used model goes down a tier, except a pinned one (manifest) and
one a worker maps now (each LoadRequest names its worker; a worker's next load moves it off the
model it had: that is how a model switch lets go of the old one). In-use and pinned models alone
may exceed the budget (logged). Each load's tier and time are logged and kept in the status
(`<ns>.models.<node>.status`). An evicted shared file is unlinked: a worker that still maps it
keeps its mapping until it unmaps it. GPU memory is kept until the loader stops (nothing tells it
when the workers have closed their handles), so on CUDA the host tier is not used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
import time
from pathlib import Path

from meshserve.shared import node_memory, shm
from meshserve.shared.bus import Bus
from meshserve.shared.models_repo import load_model_files, resolve
from meshserve.shared.manifest import Manifest, load_manifest
from meshserve.shared.schemas import Heartbeat, LoadRequest, TensorSpec, WeightsDescriptor
from meshserve.shared.service import run_service

from . import prepared
from .tiers import GB, Entry, Tiers

log = logging.getLogger("meshserve.model_loader")

WORKER_TIMEOUT_S = 10.0  # a worker silent this long no longer holds the model it mapped


def write_weights(name: str, weights: dict, device: str = "cpu") -> tuple["torch.Tensor", str, dict | None,
                                                                         list[TensorSpec]]:
    """All tensors of a model into one buffer the node's workers open (a shared file named `name`, or
    one GPU allocation), each 64-byte aligned. Returns (buffer, path, CUDA IPC descriptor, specs)."""
    import torch

    specs, offset = [], 0
    for key, t in weights.items():
        specs.append(TensorSpec(name=key, dtype=shm.dtype_name(t.dtype), shape=list(t.shape), offset=offset))
        offset = shm.aligned(offset + t.numel() * t.element_size())
    buf, path, ipc = node_memory.create(name, max(offset, 1), device)
    for spec, t in zip(specs, weights.values()):
        shm.view(buf, spec.offset, spec.dtype, spec.shape).copy_(t)
    if buf.is_cuda:  # written before any worker hears of it
        torch.cuda.synchronize(buf.device)
    return buf, path, ipc, specs


class ModelLoader:
    def __init__(self, bus: Bus, node_id: str, max_models: int, device: str = "cpu",
                 weights_memory_gb: float | None = None, host_cache_gb: float = 0.0, manifest: Manifest | None = None,
                 default_dtype: str = "bfloat16"):
        self.bus, self.node_id, self.max_models, self.device = bus, node_id, max_models, device
        self.default_dtype = default_dtype
        self.tiers = Tiers(weights_budget=None if weights_memory_gb is None else int(weights_memory_gb * GB),
                           host_budget=int(host_cache_gb * GB) if device == "cpu" else 0, max_mapped=max_models)
        self.manifest = manifest
        self.gpu_buffers: dict[tuple[str, str, str | None], torch.Tensor] = {}  # cuda: kept alive for the workers
        self.retired: list[torch.Tensor] = []  # cuda: unloaded, still kept (workers may hold handles)
        self.seen: dict[str, float] = {}  # worker id -> its last heartbeat
        self.tasks: list[asyncio.Task] = []

    # -- one load, in a thread: from host memory, the prepared form, or the model's files

    def _load(self, model: str, dtype: str, quantization: str | None = None, host: bytes | None = None,
              meta: tuple | None = None) -> WeightsDescriptor:
        t0 = time.monotonic()
        variant = f"{dtype}-{quantization}" if quantization else dtype
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model}-{variant}")[-120:]
        name = f"meshserve-{self.bus.subjects.ns}-{self.node_id}-weights-{safe}"
        if host is not None:  # the host tier: one copy into a new shared file
            specs, config = meta
            path = str(shm.create_from_bytes(name, host))
            ipc, how, tier = None, "from host memory", "host"
        else:
            kept = prepared.entry(resolve(model), variant, self.device)
            found = prepared.load(kept, name) if kept is not None else None
            if found is not None:
                path, specs, config = found
                ipc, how, tier = None, f"from {kept}", "disk"
            else:
                path, ipc, specs, config = self._prepare(model, dtype, quantization, name)
                if kept is not None:
                    prepared.keep(kept, path, specs, config)
                how, tier = "prepared", "source"
        took = time.monotonic() - t0
        log.info("loaded %s (%s) into %s in %.3fs (%s; tier %s)", model, variant, path, took, how, tier)
        return WeightsDescriptor(model=model, path=path, backend=self.device, ipc=ipc, config=config,
                                 tensors=specs, tokenizer_path=str(resolve(model)), quantization=quantization,
                                 tier=tier, load_s=took)

    def _prepare(self, model: str, dtype: str, quantization: str | None, name: str
                 ) -> tuple[str, dict | None, list[TensorSpec], dict]:
        """Reads, dequantizes, fuses (and quantizes) the weights and writes them into the shared buffer `name`."""
        from meshserve.shared.engine.llm import DTYPES
        from meshserve.shared.model.llama import fuse_hf_weights

        cfg, sd, _ = load_model_files(model)
        weights = fuse_hf_weights(cfg, sd, DTYPES[dtype], self.device, quantization)
        del sd
        buf, path, ipc, specs = write_weights(name, weights, self.device)
        if buf.is_cuda:
            self.gpu_buffers[(model, dtype, quantization)] = buf
        return path, ipc, specs, dataclasses.asdict(cfg)

    # -- asks

    def _spec(self, key):
        return self.manifest.by_weights(self.default_dtype).get(key) if self.manifest else None

    async def get(self, req: LoadRequest) -> WeightsDescriptor:
        key = (req.model, req.dtype, req.quantization)
        spec = self._spec(key)
        e = self.tiers.entry(key, req.name or (spec.id if spec else req.model))
        e.pinned = bool(spec and spec.pinned)
        if req.worker_id:
            self.seen[req.worker_id] = time.monotonic()
            self.tiers.use(req.worker_id, e)
        else:
            self.tiers.touch(e)
        if e.tier == "mapped":
            e.hits += 1
            return e.desc
        if e.loading is None:
            e.loading = asyncio.ensure_future(self._bring_in(e, spec.memory_quota_gb if spec else None))
        return await asyncio.shield(e.loading)

    async def _bring_in(self, e: Entry, quota_gb: float | None) -> WeightsDescriptor:
        model, dtype, quantization = e.key
        was = e.tier
        e.tier = "loading"
        try:
            desc = await asyncio.to_thread(self._load, model, dtype, quantization, e.host, e.meta)
            nbytes = node_memory.weights_nbytes(desc)
            if quota_gb is not None and nbytes > quota_gb * GB:
                node_memory.release(desc.backend, desc.path)
                raise RuntimeError(f"its weights take {nbytes / GB:.3f} GiB, over its memory_quota_gb of "
                                   f"{quota_gb:g}")
        except Exception as err:
            e.tier, e.error, e.loading = ("host" if was == "host" else "failed"), str(err), None
            if e.tier == "host":
                e.error = None
            raise
        self.tiers.mapped(e, desc, nbytes)
        e.loading = None
        for victim, to in self.tiers.evictions():
            self._evict(victim, to)
        return desc

    def _evict(self, e: Entry, to: str) -> None:
        """Moves a model down to `to` (host: a copy in this process; disk: nothing kept here)."""
        desc = e.desc
        t0 = time.monotonic()
        if desc is not None:
            if to == "host" and desc.backend == "cpu":
                e.host = Path(desc.path).read_bytes()
                e.meta = (desc.tensors, desc.config)
            node_memory.release(desc.backend, desc.path)
            if e.key in self.gpu_buffers:
                self.retired.append(self.gpu_buffers.pop(e.key))
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
        now = time.monotonic()
        for wid in [w for w, t in self.seen.items() if now - t > WORKER_TIMEOUT_S]:
            del self.seen[wid]
            self.tiers.release(wid)
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
        return {"node_id": self.node_id, **self.tiers.status()}

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

        async def on_heartbeat(msg):
            self.seen[Heartbeat.decode(msg.data).worker_id] = time.monotonic()

        s = self.bus.subjects
        for verb, cb in (("load", on_load), ("list", on_list), ("status", on_status), ("reload", on_reload)):
            await self.bus.nc.subscribe(s.models(verb, self.node_id), cb=cb)
        await self.bus.nc.subscribe(s.heartbeat, cb=on_heartbeat)
        self.tasks.append(asyncio.ensure_future(self._sweeper()))

    manifest_path: str | None = None

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for e in self.tiers.entries.values():
            if e.desc is not None:
                node_memory.release(e.desc.backend, e.desc.path)


def add_arguments(p) -> None:
    p.add_argument("--max-models", type=int, default=4, help="models kept mapped at most (LRU beyond)")
    p.add_argument("--weights-memory-gb", type=float, default=None,
                   help="GiB of the node's shared memory for mapped weights (LRU beyond, pinned and in-use "
                        "models excepted; default: no limit but --max-models)")
    p.add_argument("--host-cache-gb", type=float, default=0.0,
                   help="GiB of this process's memory for weights evicted from the mapped tier, brought back "
                        "by one copy (0: evicted weights go to disk)")
    p.add_argument("--preload", action="store_true", help="load --model (and pinned models of --models) at start "
                                                          "instead of on first ask")


async def main(args) -> None:
    async def start(bus: Bus):
        manifest = load_manifest(args.models) if getattr(args, "models", None) else None
        loader = ModelLoader(bus, args.node_id, args.max_models, getattr(args, "device", "cpu"),
                             args.weights_memory_gb, args.host_cache_gb, manifest, args.dtype)
        loader.manifest_path = getattr(args, "models", None)
        await loader.serve()
        loop = asyncio.get_running_loop()
        if loader.manifest_path:  # SIGHUP: re-read the manifest
            loop.add_signal_handler(signal.SIGHUP, lambda: _logged(loader.reload, loader.manifest_path))
        if args.preload:
            first = [LoadRequest(model=args.model, dtype=args.dtype, quantization=args.quantization)]
            pinned = [LoadRequest(model=m.path, dtype=m.dtype or args.dtype, quantization=m.quantization, name=m.id)
                      for m in (manifest.models if manifest else ()) if m.pinned]
            for req in first + [r for r in pinned if r.model != args.model]:
                try:
                    await loader.get(req)
                except Exception as e:  # noqa: BLE001 - with a manifest, its requests will say why
                    if manifest is None:
                        raise
                    log.error("preloading %s failed: %s", req.name or req.model, e)
        return loader.close

    await run_service("model-loader", args, start)


def _logged(f, *a) -> None:
    try:
        f(*a)
    except Exception as e:  # noqa: BLE001 - a bad manifest keeps the old one
        log.error("manifest not reloaded: %s", e)
