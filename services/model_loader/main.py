"""`meshserve serve model-loader`: loads each model once, into memory every worker on the node maps,
and answers `models.load` with where each tensor lives. Workers of one model on a node therefore
hold one copy of the weights between them.

With `--device cpu` (the default) that memory is a shared-memory file; with `--device cuda` it is
one allocation on the GPU whose CUDA IPC handle travels in the descriptor (shared/node_memory.py):
the workers open it and run on the GPU without copying the weights.

A model is loaded in the format asked for: dtype and, with `quantization: "int8"`, int8 projections
quantized at load (kernels/int8_linear.py; on a CPU in the int8 kernel's blocked layout). Each
(model, dtype, quantization) is its own entry, so one source can be served both ways at once.

Tiers: disk (the model cache, and the prepared weights of a GGUF: prepared.py) -> host memory (the
shared file) or GPU memory. Torch is imported only to prepare weights: a start that finds them
prepared copies a file. Models stay loaded
until the loader stops; at most --max-models stay resident, the least recently asked-for unloaded
first (its file is unlinked: workers that still map it keep their mapping until they exit; GPU
memory is kept until the loader stops, since nothing tells it when the workers have closed their
handles).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import OrderedDict

from meshserve.shared import node_memory, shm
from meshserve.shared.bus import Bus
from meshserve.shared.models_repo import load_model_files, resolve
from meshserve.shared.schemas import LoadRequest, TensorSpec, WeightsDescriptor
from meshserve.shared.service import run_service

from . import prepared

log = logging.getLogger("meshserve.model_loader")


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
    def __init__(self, bus: Bus, node_id: str, max_models: int, device: str = "cpu"):
        self.bus, self.node_id, self.max_models, self.device = bus, node_id, max_models, device
        self.loaded: OrderedDict[tuple[str, str, str | None], asyncio.Future] = OrderedDict()
        self.gpu_buffers: dict[tuple[str, str, str | None], torch.Tensor] = {}  # cuda: kept alive for the workers
        self.retired: list[torch.Tensor] = []  # cuda: unloaded, still kept (workers may hold handles)

    def _load(self, model: str, dtype: str, quantization: str | None = None) -> WeightsDescriptor:
        t0 = time.monotonic()
        variant = f"{dtype}-{quantization}" if quantization else dtype
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{model}-{variant}")[-120:]
        name = f"meshserve-{self.bus.subjects.ns}-{self.node_id}-weights-{safe}"
        kept = prepared.entry(resolve(model), variant, self.device)
        found = prepared.load(kept, name) if kept is not None else None
        if found is not None:
            path, specs, config = found
            ipc, how = None, f"from {kept}"
        else:
            path, ipc, specs, config = self._prepare(model, dtype, quantization, name)
            if kept is not None:
                prepared.keep(kept, path, specs, config)
            how = "prepared"
        log.info("loaded %s (%s) into %s in %.1fs (%s)", model, variant, path, time.monotonic() - t0, how)
        return WeightsDescriptor(model=model, path=path, backend=self.device, ipc=ipc, config=config,
                                 tensors=specs, tokenizer_path=str(resolve(model)), quantization=quantization)

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

    async def get(self, req: LoadRequest) -> WeightsDescriptor:
        key = (req.model, req.dtype, req.quantization)
        fut = self.loaded.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self._load, req.model, req.dtype, req.quantization))
            self.loaded[key] = fut
            while len(self.loaded) > self.max_models:
                old, old_fut = self.loaded.popitem(last=False)
                if old_fut.done() and not old_fut.exception():
                    node_memory.release(old_fut.result().backend, old_fut.result().path)
                if old in self.gpu_buffers:
                    self.retired.append(self.gpu_buffers.pop(old))
        self.loaded.move_to_end(key)
        try:
            return await fut
        except Exception:
            self.loaded.pop(key, None)
            raise

    async def serve(self) -> None:
        async def on_load(msg):
            try:
                desc = await self.get(LoadRequest.decode(msg.data))
                await msg.respond(desc.encode())
            except Exception as e:  # noqa: BLE001 - the asker must hear why
                log.exception("load failed")
                await self.bus.respond_error(msg, f"cannot load {msg.data[:200]!r}: {e}")

        async def on_list(msg):
            import orjson
            await msg.respond(orjson.dumps([{"model": m, "dtype": d, "quantization": q, "ready": f.done()}
                                            for (m, d, q), f in self.loaded.items()]))

        await self.bus.nc.subscribe(self.bus.subjects.models("load", self.node_id), cb=on_load)
        await self.bus.nc.subscribe(self.bus.subjects.models("list", self.node_id), cb=on_list)

    def close(self) -> None:
        for fut in self.loaded.values():
            if fut.done() and not fut.exception():
                node_memory.release(fut.result().backend, fut.result().path)


def add_arguments(p) -> None:
    p.add_argument("--max-models", type=int, default=4, help="models kept resident (LRU beyond)")
    p.add_argument("--preload", action="store_true", help="load --model at start instead of on first ask")


async def main(args) -> None:
    async def start(bus: Bus):
        loader = ModelLoader(bus, args.node_id, args.max_models, getattr(args, "device", "cpu"))
        await loader.serve()
        if args.preload:
            await loader.get(LoadRequest(model=args.model, dtype=args.dtype, quantization=args.quantization))
        return loader.close

    await run_service("model-loader", args, start)
