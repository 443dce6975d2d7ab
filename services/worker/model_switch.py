"""A worker changing model, the way it changes role: no process restart.

The scheduler sends `ModelSwitch` to a worker it has stopped routing to; the worker applies it at an
iteration boundary once its engine has nothing left to run (its sequences finish first), then:
asks its node's loader for the model's weights (the loader counts it off the model it mapped
before), maps the node's arena of the model's KV shape (the kv-pool makes it when this is its first
model of that shape; one already mapped, e.g. the arena it has, is reused unless the pool retired
it and made it again: docs/models.md "KV arenas"), builds the model and a
new engine on it, gives the old engine's blocks back to the kv-pool (to the old arena) and leases
new ones (from the new one). A switch
that fails leaves the worker on the model it had (mapped again: the loader keeps it in use) and the
reply says why; the scheduler then fails that model's queued requests with the reason.

A layered load (docs/models.md) is answered while the loader still writes the weights: the model is
built over them with their `LayerGate`, which its forward pass waits on per layer, so the switch
ends, and the first prompt computes, before the last layers are in.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshserve.kernels.linear import converts_on_load
from meshserve.shared import node_memory, shm
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.speculative import SpeculativeConfig, config_from_args
from meshserve.shared.kv_layout import kv_arena_dtype, kv_row
from meshserve.shared.model.config import ModelConfig
from meshserve.shared.model.layer_gate import LayerGate, open_gate
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.schemas import (ArenaDescriptor, KVShape, LoadRequest, ModelSwitch, ModelSwitchReply,
                                      WeightsDescriptor)

log = logging.getLogger("meshserve.worker")


def kv_shape(cfg: ModelConfig, dtype: str, kv_cache_dtype: str = "auto") -> KVShape:
    """The KV shape the model's arena has: its layers, KV heads and head dim, in the model's dtype or,
    with an int8 KV cache, int8 (an int8 arena holds any model's KV as int8 rows, whatever its dtype)."""
    return KVShape(num_hidden_layers=cfg.num_hidden_layers, num_key_value_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, dtype=kv_arena_dtype(kv_cache_dtype, dtype))


def kv_mismatch(cfg: ModelConfig, dtype: str, arena, kv_cache_dtype: str = "auto") -> str | None:
    """Why the model cannot keep its KV in this arena (a descriptor the pool answered), or None."""
    layers, _, _, heads, dim = arena.shape
    want = kv_arena_dtype(kv_cache_dtype, dtype)  # an int8 arena holds any model's KV as int8 rows
    if want != arena.dtype:
        return (f"its KV dtype {want} (dtype {dtype}, --kv-cache-dtype {kv_cache_dtype}) differs from the "
                f"KV arena's ({arena.dtype})")
    if (cfg.num_hidden_layers, cfg.num_key_value_heads, kv_row(cfg, want)) != (layers, heads, dim):
        return (f"its KV shape ({cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x "
                f"{cfg.head_dim}) differs from the KV arena {arena.key} ({layers} x {heads} x {dim})")
    return None


def manifest_entry(worker, load: LoadRequest):
    """The manifest's entry of the model a load is for (None without a manifest, or for a model it
    does not list)."""
    manifest = worker.manifest.current() if worker.manifest is not None else None
    return manifest.get(load.name) if manifest is not None and load.name else None


def kv_cache_dtype(worker, load: LoadRequest) -> str:
    """The model's KV cache: its manifest entry's `kv_cache_dtype`, else the worker's flag."""
    entry = manifest_entry(worker, load)
    return (entry and entry.kv_cache_dtype) or getattr(worker.args, "kv_cache_dtype", "auto")


async def map_arena(worker, cfg: ModelConfig, dtype: str, served: str,
                    kv_cache_dtype: str = "auto") -> tuple[ArenaDescriptor, object]:
    """The node's arena for this model's KV shape and its tensor over the same memory (no copy). The
    worker keeps every arena it mapped (`worker.kv_arenas`, by key) until the pool retires it: a switch
    back maps nothing again (and a CUDA IPC handle is opened once per process). The pool is asked
    each time: an arena retired and made again under the same key is new memory (its `arena_id`)."""
    a = worker.args
    shape = kv_shape(cfg, dtype, kv_cache_dtype)
    arena = await worker.pool.arena_of(shape, served)
    mapped = worker.kv_arenas.get(shape.key)
    if mapped is not None and mapped[0].arena_id == arena.arena_id:
        return mapped
    node_memory.check_backend("KV arena", arena.backend, getattr(a, "device", "cpu"))
    problem = kv_mismatch(cfg, dtype, arena, kv_cache_dtype)  # the pool answered another shape: a bug
    if problem:
        raise ValueError(problem)
    kv = shm.view(node_memory.open_buffer(arena.backend, arena.path, arena.ipc), 0, arena.dtype, arena.shape)
    worker.kv_arenas[shape.key] = arena, kv
    return arena, kv


def forget_arena(worker, key: str, arena_id: str) -> bool:
    """The pool retired an arena: drop the worker's mapping of it (its memory goes back to the node
    once every process lets go), unless it is the one the worker serves from."""
    mapped = worker.kv_arenas.get(key)
    if mapped is None or mapped[0].arena_id != arena_id or worker.arena.arena_id == arena_id:
        return False
    del worker.kv_arenas[key]
    return True


def close_dropped(worker) -> None:
    """On CUDA, closes the mappings of what the worker just dropped (an old model's weights, a
    retired arena) now rather than at some later collection: the creator frees the GPU memory only
    once no heartbeat lists its handle (node_memory.RetiredBuffers). A full collection takes about
    60 ms with SmolLM2's engine loaded; on the CPU reference counting already unmaps an old model's
    shared file at the switch (tests/test_models.py checks the worker's maps), so it is not run there."""
    if getattr(worker.args, "device", "cpu") == "cuda":
        import gc

        gc.collect()


async def open_weights(w: WeightsDescriptor) -> tuple[dict, LayerGate | None]:
    """The descriptor's tensors over the loader's memory (no copy), and the gate of a layered load
    still being written (None once complete). Weights that building the model would read (a blocked
    layout without its kernel here) are waited for whole."""
    buf = node_memory.open_buffer(w.backend, w.path, w.ipc)
    weights = {t.name: shm.view(buf, t.offset, t.dtype, t.shape) for t in w.tensors}
    gate = open_gate(w.ready_path, int(w.config["num_hidden_layers"]))
    if gate is not None and converts_on_load(weights):
        await asyncio.to_thread(gate.wait, gate.total - 1)
        gate = None
    return weights, gate


def speculation(worker, load: LoadRequest, cfg: ModelConfig) -> SpeculativeConfig | None:
    """A model's speculative decoding: its manifest entry's `speculative` (false: none); without one,
    the worker's flags, for every model it serves (a draft model of the flags only for models of its
    vocabulary: the others run without)."""
    entry = manifest_entry(worker, load)
    if entry is not None and entry.speculative is not None:
        if entry.speculative is False:
            return None
        spec = SpeculativeConfig(**entry.speculative.model_dump(exclude_none=True))
        spec.validate()
        return spec  # a draft of another vocabulary fails the load, saying so (LLMEngine)
    spec = config_from_args(worker.args)
    if spec is not None and spec.method == "draft" and load.model != worker.args.model:
        from meshserve.shared.models_repo import model_config

        vocab = model_config(spec.model).vocab_size
        if vocab != cfg.vocab_size:
            log.info("worker %s: %s runs without speculation: the draft model %s has another vocabulary (%d, not "
                     "%d)", worker.id, load.name or load.model, spec.model, vocab, cfg.vocab_size)
            return None
    return spec


def draft_load(worker, load: LoadRequest, spec) -> LoadRequest | None:
    """The load of `load`'s draft model, mapped beside it (the loader keeps both in use by the
    worker); None without a draft model."""
    if spec is None or spec.method != "draft":
        return None
    return LoadRequest(model=spec.model, dtype=load.dtype, worker_id=worker.id, beside=True)


async def register_again(worker) -> None:
    """After a failed switch: the loader counted the worker off what it maps, and it still maps its
    model (and its draft, if it has one), so it says so again; else they could be evicted under it."""
    draft = draft_load(worker, worker.load, worker.engine.config.speculative)
    for load in [worker.load] + ([draft] if draft is not None else []):
        try:
            await worker.bus.request(worker.bus.subjects.models("load", worker.args.node_id), load,
                                     WeightsDescriptor, timeout=900)
        except Exception as e:  # noqa: BLE001
            log.warning("worker %s: could not re-register %s with the loader: %s", worker.id, load.model, e)


async def build_engine(worker, load: LoadRequest,
                       served: str) -> tuple[LLMEngine, WeightsDescriptor, ArenaDescriptor]:
    """The model's weights mapped from the loader and an engine over them on the node's arena of its
    KV shape (its descriptor is the third result)."""
    a, bus = worker.args, worker.bus
    w = await bus.request(bus.subjects.models("load", a.node_id), load, WeightsDescriptor, timeout=900)
    node_memory.check_backend("weights", w.backend, getattr(a, "device", "cpu"))
    cfg = ModelConfig(**w.config)
    kv_dtype = kv_cache_dtype(worker, load)
    arena, kv = await map_arena(worker, cfg, load.dtype, served, kv_dtype)
    weights, gate = await open_weights(w)
    # Built on the step thread, like everything that runs torch ops in parallel: OpenMP keeps a
    # thread team per thread that opens parallel regions, and once the main thread had one
    # (from building the model) the step thread's ran on ~1.6 of 2 cores (bench-mesh: the
    # decode worker's CPU over the run's wall time, 1.55 before and 1.91 after this change).
    loop = asyncio.get_running_loop()
    model = await loop.run_in_executor(worker.stepper, lambda: LlamaModel(cfg, weights, gate=gate))
    from meshserve.shared.models_repo import load_tokenizer

    tokenizer = load_tokenizer(w.tokenizer_path)  # for structured output's grammars
    sched = SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                            prefill_chunk_size=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                            policy=a.scheduling, preemption_mode=a.preemption_mode)
    spec = speculation(worker, load, cfg)
    draft, dload = None, draft_load(worker, load, spec)
    if dload is not None:  # the draft's weights from the node's loader too
        dw = await bus.request(bus.subjects.models("load", a.node_id), dload, WeightsDescriptor, timeout=900)
        dweights, dgate = await open_weights(dw)
        draft = await loop.run_in_executor(worker.stepper, lambda: LlamaModel(ModelConfig(**dw.config), dweights,
                                                                              gate=dgate))
    config = EngineConfig(block_size=arena.block_size, max_model_len=a.max_model_len, scheduler=sched,
                          speculative=spec, kv_cache_dtype=kv_dtype)
    engine = await loop.run_in_executor(worker.stepper, lambda: LLMEngine(
        model, config, model_name=served, kv_cache=kv, tokenizer=tokenizer, draft_model=draft))
    engine.urgent = worker.urgent
    return engine, w, arena


async def switch_model(worker, m: ModelSwitch) -> ModelSwitchReply:
    """Applied by the worker's loop when its engine is empty (see the module docstring)."""
    t0, old = time.perf_counter(), worker.served
    load = LoadRequest(model=m.path, dtype=m.dtype, quantization=m.quantization, worker_id=worker.id, name=m.name)
    try:
        engine, w, arena = await build_engine(worker, load, m.name)
    except Exception as e:  # noqa: BLE001 - the scheduler must hear why
        log.warning("worker %s: cannot switch %s -> %s: %s", worker.id, old, m.name, e)
        await register_again(worker)
        return ModelSwitchReply(ok=False, error=str(e), seconds=time.perf_counter() - t0)
    was = worker.arena.key
    await worker.replace_engine(engine, m.name, load, node_memory.weights_nbytes(w), arena)
    close_dropped(worker)
    took = time.perf_counter() - t0
    log.info("worker %s model %s -> %s in %.3f s (weights from %s in %.3f s%s; KV arena %s%s): %s", worker.id, old,
             m.name, took, w.tier, w.load_s, ", layered: its layers still loading" if w.ready_path else "", arena.key,
             "" if arena.key == was else f", was {was}", m.reason)
    return ModelSwitchReply(ok=True, seconds=took, tier=w.tier)
