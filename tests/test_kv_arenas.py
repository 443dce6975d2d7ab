"""One KV arena per KV shape on each node (services/kv_pool/arenas.py, docs/models.md "KV arenas"):
the budget split, the kv-pool with two shapes over a real nats-server (leases, give-back, handoff,
the host tier and a cross-node pull, each per arena; no block id read against another arena), and
a mesh of real processes serving two differently shaped tiny models with one worker that switches
between them, each model's greedy text equal to the model alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from argparse import Namespace

import numpy as np
import orjson
import pytest
from mesh_util import Mesh
from openai import OpenAI
from test_kv_transfer import small_nats  # noqa: F401 - the fixture: a real nats-server
from tiny_model import make_tiny_llama

from meshserve.services.kv_pool.arenas import ArenaBudgets, model_parts, plan_budgets
from meshserve.services.kv_pool.blocks import ArenaBlocks
from meshserve.services.kv_pool.main import KVPool, create_arena
from meshserve.services.scheduler.routing import uncached_blocks
from meshserve.services.worker.kv_pool_client import KVPoolClient
from meshserve.services.worker.model_switch import kv_shape
from meshserve.shared import node_memory
from meshserve.shared.bus import Bus
from meshserve.shared.model.config import ModelConfig
from meshserve.shared.prefix_hash import namespace, prompt_block_hashes
from meshserve.shared.schemas import (BlockRefs, BlockTransfer, KVImport, KVImportReply, KVShape, LeaseReply,
                                      LeaseRequest, TransferReply)

GB = 1 << 30
NARROW = KVShape(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, dtype="float32")  # 8 KiB blocks
DEEP = KVShape(num_hidden_layers=3, num_key_value_heads=1, head_dim=32, dtype="float32")  # 12 KiB blocks


def _cfg(layers: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim)


# -- the plan and the keys (pure)


def test_budgets_split_by_quota_then_equal_parts_and_keep_a_reserve():
    assert model_parts(100, {"a": None, "b": None}) == {"a": 50, "b": 50}
    # a quota takes its bytes (its KV never needs more); the others share the rest
    assert model_parts(4 * GB, {"q": 1.0, "a": None}) == {"q": GB, "a": 3 * GB}
    # quotas that leave less than an equal part: the others get an equal part of the whole (2 of 4 GiB),
    # and all are scaled down together to fit (3.5 + 2 -> 4)
    parts = model_parts(4 * GB, {"q": 3.5, "a": None})
    assert abs(parts["q"] - 3.5 * GB * 4 / 5.5) <= 1 and abs(parts["a"] - 2 * GB * 4 / 5.5) <= 1
    assert sum(parts.values()) <= 4 * GB
    # models of one shape share one arena: its budget is their parts together
    b = plan_budgets(4 * GB, GB, [("a", "k1", None), ("b", "k2", None), ("c", "k1", None), ("q", "k3", 0.5)])
    assert set(b.planned) == {"k1", "k2", "k3"} and abs(b.planned["k2"] - 3.5 * GB / 3) <= 1
    assert b.planned["k1"] == 2 * b.planned["k2"] and abs(b.planned["k3"] - GB // 2) <= 1
    assert 4 * GB - 3 <= sum(b.planned.values()) <= 4 * GB
    assert abs(b.swap_for(b.planned["k3"]) - GB // 8) <= 1  # the host tier in the same proportions
    # what the quotas leave unused, and the parts of models whose shape was unknown, are the reserve
    r = plan_budgets(4 * GB, 0, [("q", "k1", 1.0), ("u", None, None)])
    assert r.planned == {"k1": GB} and r.for_arena("k1") == GB and r.for_arena("new") == 3 * GB
    r.made["new"] = 3 * GB - 5
    assert r.for_arena("other") == 5  # one unplanned arena took the reserve
    assert ArenaBudgets(10).for_arena("any") == 10  # no manifest: the one arena gets it all


def test_a_new_plan_retires_only_the_arenas_nobody_uses_that_it_wants_the_memory_of():
    # made: k1 and k2 half each; a reload replaces k2's model by one of shape k3
    b = ArenaBudgets(total=100, planned={"k1": 50, "k2": 50}, made={"k1": 50, "k2": 50}, block={"k1": 5, "k2": 5})
    assert b.retirable(set()) == []  # the plan it was made by: nothing to give back
    b.replan({"k1": 50, "k3": 50}, complete=True)
    assert b.for_arena("k3") == 0  # k2 still holds the memory: k3 gets nothing yet
    assert b.retirable({"k2"}) == []  # in use: kept
    assert b.retirable(set()) == ["k2"]  # no model has its shape
    b.retire("k2")
    assert b.for_arena("k3") == 50 and b.describe()["reserve_bytes"] == 0
    # a shape unknown to the plan (a model not pulled yet) may be that arena's: kept until known
    u = ArenaBudgets(total=100, planned={"k1": 50}, made={"k1": 50, "x": 50}, complete=False)
    assert u.retirable(set()) == []
    # growth: the only model left may have the whole budget; its idle arena is made again bigger
    b.replan({"k1": 100}, complete=True)
    assert b.retirable({"k1"}) == [] and b.retirable(set()) == ["k1"]
    # shrink only when another planned arena starves: k1 made with 80 of 100, k3 planned 50
    c = ArenaBudgets(total=100, planned={"k1": 50, "k3": 50}, made={"k1": 80}, block={"k1": 5})
    assert c.for_arena("k3") == 20 and c.retirable(set()) == ["k1"] and c.retirable({"k1"}) == []
    c.retire("k1")
    assert c.for_arena("k3") == 50 and c.for_arena("k1") == 50
    # an arena a block short of its part (rounding) is not made again
    d = ArenaBudgets(total=100, planned={"k1": 100}, made={"k1": 96}, block={"k1": 8})
    assert d.retirable(set()) == []


def test_a_new_plan_resizes_shared_memory_arenas_in_place_in_use_or_not():
    both = {"k1", "k2"}
    b = ArenaBudgets(total=120, planned={"k1": 60, "k2": 60}, made={"k1": 60, "k2": 60}, block={"k1": 5, "k2": 5})
    assert b.resizes(both) == {}
    b.replan({"k1": 40, "k2": 40, "k3": 40}, complete=True)  # a third shape: each part shrinks
    assert b.resizes(both) == {"k1": 40, "k2": 40}
    assert b.retirable(set(), both) == []  # resized in place, not retired (a GPU arena would be)
    assert b.retirable(set()) == ["k1", "k2"]
    assert b.for_arena("k3") == 0  # until the blocks beyond their new sizes are freed
    b.made.update(k1=40, k2=40)
    assert b.for_arena("k3") == 40 and b.resizes(both) == {}
    # growth takes only what no arena made and no unmade planned arena's part takes
    b.replan({"k1": 120}, complete=True)  # k2's model went: retired once unused; k1 grows meanwhile
    assert b.resizes(both) == {"k1": 80} and b.retirable({"k2"}, both) == [] and b.retirable(set(), both) == ["k2"]
    c = ArenaBudgets(total=120, planned={"k1": 60, "k3": 60}, made={"k1": 30}, block={"k1": 5})
    assert c.resizes({"k1"}) == {"k1": 60}
    c.made["x"] = 50  # an arena of a shape the plan does not know took the reserve
    assert c.resizes({"k1"}) == {}
    # within the slack (5%, at least a block) nothing changes
    d = ArenaBudgets(total=100, planned={"k1": 100}, made={"k1": 96}, block={"k1": 8})
    assert d.resizes({"k1"}) == {}


def test_the_ledger_shrinks_while_blocks_are_held_and_grows_back():
    from meshserve.services.kv_pool.main import BlockLedger

    led = BlockLedger(8, capacity=16)
    assert led.lease("w", 8) == list(range(8))
    led.release("w", [1, 6, 7])
    assert led.resize(4) == [6, 7]  # free beyond the new size: their memory can go now
    assert led.outside == {4, 5} and led.num_blocks == 4
    assert led.lease("w", 10) == [1]  # ids below 4 only
    led.release("w", [5])
    assert led.to_punch == [5] and led.outside == {4} and 5 not in led.free
    assert led.resize(12) == [] and led.outside == set()
    assert sorted(led.free) == list(range(5, 12))  # 4 is still held; capacity caps any growth
    led.release("w", [4])
    assert 4 in led.free and led.resize(99) == [] and led.num_blocks == 16


def test_arena_keys_follow_the_kv_shape_and_an_int8_arena_takes_any_model_dtype():
    small, deep = _cfg(2, 2, 16), _cfg(3, 1, 32)
    assert kv_shape(small, "float32").key == "2x2x16-float32" and kv_shape(deep, "float32").key == "3x1x32-float32"
    assert kv_shape(small, "bfloat16").key != kv_shape(small, "float32").key
    # --kv-cache-dtype int8: one int8 arena per shape, whatever the model's dtype
    assert kv_shape(small, "bfloat16", "int8").key == kv_shape(small, "float32", "int8").key == "2x2x16-int8"
    assert kv_shape(small, "float32", "int8").dtype == "int8"


def test_the_kv_pool_reads_each_models_kv_shape_without_weights_or_torch(tmp_path, tiny_llama):
    """The plan at the kv-pool's start: shapes from config.json or a GGUF's metadata, in a process
    that never imports torch (the kv-pool on the CPU backend)."""
    import subprocess
    import sys

    from tiny_model import write_tiny_gguf

    deep = make_tiny_llama(tmp_path / "deep", seed=3, num_hidden_layers=3, num_attention_heads=2,
                           num_key_value_heads=1)
    gguf = write_tiny_gguf(deep, tmp_path / "deep.gguf")
    f = tmp_path / "m.yaml"
    f.write_text(f"- {{name: a, path: '{tiny_llama}'}}\n- {{name: b, path: '{gguf}', dtype: bfloat16}}\n"
                 f"- {{name: c, path: '{tiny_llama}', memory_quota_gb: 0.001}}\n"
                 "- {name: d, path: smollm2-135m-instruct}\n")
    code = ("import sys, json\nfrom meshserve.shared.manifest import load_manifest\n"
            "from meshserve.services.kv_pool.arenas import manifest_shapes\n"
            f"shapes = manifest_shapes(load_manifest({str(f)!r}), 'float32', 'auto')\n"
            "print(json.dumps([(m, s and s.key, q) for m, s, q in shapes]))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MESHSERVE_CACHE": str(tmp_path / "empty-cache")})
    assert r.returncode == 0, r.stderr
    got = orjson.loads(r.stdout.strip().splitlines()[-1])
    # d: a known model name not pulled here: its shape is unknown at start (its part is the reserve)
    assert got == [["a", "2x2x16-float32", None], ["b", "3x1x32-bfloat16", None],
                   ["c", "2x2x16-float32", 0.001], ["d", None, None]]


def test_prefix_routing_never_matches_another_models_blocks():
    tokens = list(range(64))
    a = prompt_block_hashes(tokens, 16, namespace("narrow"))
    b = prompt_block_hashes(tokens, 16, namespace("deep"))
    assert not set(a) & set(b)
    assert uncached_blocks(b, set(a)) == len(b)  # a worker that cached narrow's prompt has no hit for deep


# -- the kv-pool with two shapes, in process, over a real nats-server


def _args(**kw) -> Namespace:
    return Namespace(**{"block_size": 16, "transfer_ttl": 120.0, "transfer_chunk_bytes": 1 << 20,
                        "transfer_timeout": 10.0, "worker_timeout": 60.0, "models": None, "device": "cpu",
                        "kv_cache_dtype": "auto", **kw})


async def _pool(bus: Bus, node: str) -> KVPool:
    """A node whose KV memory holds 60 blocks of NARROW and 40 of DEEP (a part each), and no reserve."""
    budgets = ArenaBudgets(total=60 * 8192 + 40 * 12288, swap=60 * 8192 + 40 * 12288,
                           planned={NARROW.key: 60 * 8192, DEEP.key: 40 * 12288})
    desc, buf = create_arena(bus.subjects.ns, node, NARROW, "float32", 16, budgets.for_arena(NARROW.key),
                             budgets.swap_for(budgets.for_arena(NARROW.key)), "cpu", f"epoch-{node}")
    pool = KVPool(bus, _args(), desc, buf, budgets)
    await pool.serve()
    await bus.nc.flush()
    return pool


def _blocks(desc) -> ArenaBlocks:
    """A worker's view of an arena's bytes (the same shared file)."""
    return ArenaBlocks.of_bytes(node_memory.open_buffer("cpu", desc.path, numpy=True), desc.dtype, desc.shape,
                                desc.block_size)


def _status(pool: KVPool, key: str) -> dict:
    return pool.status()["arenas"][key]


def test_the_kv_pool_keeps_one_arena_per_shape_with_its_own_block_ids(small_nats, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))

    async def go():
        bus = await Bus.connect(small_nats, namespace="arenas")
        other_bus = await Bus.connect(small_nats, namespace="arenas")
        pool = await _pool(bus, "node-a")
        remote = await _pool(other_bus, "node-b")
        heard: list[dict] = []

        async def on_broadcast(msg):
            heard.append({"subject": msg.subject, **orjson.loads(msg.data)})

        for verb in ("pressure", "host_events"):
            await bus.nc.subscribe(bus.subjects.kv(verb, "node-a"), cb=on_broadcast)
        try:
            return await body(bus, pool, remote, heard)
        finally:
            pool.close()
            remote.close()
            await bus.close()
            await other_bus.close()

    async def body(bus, pool, remote, heard):
        a, b, b2 = (KVPoolClient(bus, "node-a", w) for w in ("worker-narrow", "worker-deep", "worker-deep-2"))
        first = await a.arena_of()
        assert first.key == NARROW.key and (await a.arena_of(NARROW, "narrow")).path == first.path
        deep = await b.arena_of(DEEP, "deep")  # made now, on the first ask
        assert deep.key == DEEP.key and deep.path != first.path and deep.epoch == first.epoch
        assert deep.num_blocks == 40 and deep.swap_blocks == 40
        # its file has room for the node's whole KV memory (it can grow in place), costing only what is written
        assert deep.capacity_blocks == 80 and deep.shape == [3, 2, 80 * 16, 1, 32]
        assert os.path.getsize(deep.path) == 80 * 12288 and node_memory.shm.resident_bytes(deep.path) < 12288
        assert (await b2.arena_of(DEEP, "deep")).path == deep.path  # one arena per shape
        with pytest.raises(RuntimeError, match="no room for an arena of KV shape 4x2x16-float32"):
            await a.arena_of(KVShape(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, dtype="float32"), "x")
        with pytest.raises(RuntimeError, match="same --kv-cache-dtype"):
            await a.arena_of(KVShape(num_hidden_layers=5, num_key_value_heads=2, head_dim=16, dtype="int8"), "y")
        a.arena, b.arena, b2.arena = first.key, deep.key, deep.key

        # Leases: each arena has its own ids (both start at 0) and its own free list.
        la, lb = (await a.lease(10)).block_ids, (await b.lease(10)).block_ids
        assert la == lb == list(range(10))
        assert (_status(pool, NARROW.key)["free_blocks"], _status(pool, DEEP.key)["free_blocks"]) == (50, 30)
        # Give-back goes to the arena the client names: deep's ids free deep's blocks only.
        await b.release(lb[5:])
        await bus.nc.flush()
        deadline = time.monotonic() + 5
        while _status(pool, DEEP.key)["free_blocks"] != 35:
            assert time.monotonic() < deadline, pool.status()
            await asyncio.sleep(0.02)
        assert _status(pool, NARROW.key)["free_blocks"] == 50
        # The same ids named against the other arena are not that worker's there: nothing changes.
        await bus.publish(bus.subjects.kv("release", "node-a"), BlockRefs(worker_id="worker-deep", block_ids=lb[:5],
                                                                          arena=NARROW.key))
        await bus.nc.flush()
        await asyncio.sleep(0.1)
        assert (_status(pool, NARROW.key)["free_blocks"], _status(pool, DEEP.key)["free_blocks"]) == (50, 35)
        with pytest.raises(RuntimeError, match="has no KV arena '9x9x9-float32'"):
            await bus.request(bus.subjects.kv("lease", "node-a"), LeaseRequest(
                worker_id="lost", num_blocks=1, arena="9x9x9-float32"), LeaseReply)

        # A handoff on one node moves references within the arena the ids are of.
        t = await bus.request(bus.subjects.kv("transfer", "node-a"), BlockTransfer(
            from_worker="worker-deep", to_worker="worker-deep-2", block_ids=lb[:2], arena=DEEP.key), TransferReply)
        assert t.ok
        t = await bus.request(bus.subjects.kv("transfer", "node-a"), BlockTransfer(
            from_worker="worker-deep", to_worker="worker-deep-2", block_ids=lb[2:4], arena=NARROW.key), TransferReply)
        assert not t.ok  # it holds no narrow blocks
        assert _status(pool, DEEP.key)["holders"] == {"worker-deep": 3, "worker-deep-2": 2}

        # The host tier is per arena: a deep block spilled comes back into deep blocks, never narrow ones.
        view = _blocks(deep)
        pattern = np.random.default_rng(5).integers(0, 256, view.block_bytes, dtype=np.uint8)
        view.write(lb[2], pattern)
        assert (await b.swap([(lb[2], 0xABC)])).stored == 1
        assert (await a.swap([], [(0xABC, la[0])])).restored == 0  # not in narrow's tier
        view.write(lb[2], np.zeros(view.block_bytes, dtype=np.uint8))
        assert (await b.swap([], [(0xABC, lb[3])])).restored == 1
        assert np.array_equal(view.read(lb[3]), pattern) and not _blocks(first).read(la[0]).any()
        # Pressure names the arena that ran short (deep's workers give back, narrow's need not).
        assert len((await b.lease(100)).block_ids) == 35
        deadline = time.monotonic() + 5
        while not any(h["subject"].endswith("pressure") for h in heard):
            assert time.monotonic() < deadline, heard
            await asyncio.sleep(0.02)
        assert [h["arena"] for h in heard if h["subject"].endswith("pressure")] == [DEEP.key]
        assert {h["arena"] for h in heard if h["subject"].endswith("host_events")} == {DEEP.key}

        # Cross-node: node-b pulls node-a's deep blocks into its own deep arena (made on the ask).
        rb = KVPoolClient(remote.bus, "node-b", "worker-deep-b")
        rdeep = await rb.arena_of(DEEP, "deep")
        imp = KVImport(transfer_id="t-deep", worker_id="worker-deep-b", src_node="node-a", src_worker="worker-deep-2",
                       block_ids=lb[:2], num_tokens=32, model="deep", arena=rdeep.key, src_arena=DEEP.key)
        view.write(lb[0], pattern[::-1].copy())
        r = await remote.bus.request(remote.bus.subjects.kv("import", "node-b"), imp, KVImportReply, timeout=30)
        assert r.ok, r.error
        assert np.array_equal(_blocks(rdeep).read(r.block_ids[0]), pattern[::-1])
        assert np.array_equal(_blocks(rdeep).read(r.block_ids[1]), view.read(lb[1]))
        # ... and the same ids named against node-a's narrow arena are refused, not read from there.
        bad = imp.model_copy(update=dict(transfer_id="t-wrong", src_worker="worker-deep", block_ids=lb[2:4],
                                         src_arena=NARROW.key))
        r = await remote.bus.request(remote.bus.subjects.kv("import", "node-b"), bad, KVImportReply, timeout=30)
        assert not r.ok and "KV layouts differ" in r.error, r.error
        r = await remote.bus.request(remote.bus.subjects.kv("import", "node-b"), bad.model_copy(
            update=dict(transfer_id="t-none", src_arena="9x9x9-float32")), KVImportReply, timeout=30)
        assert not r.ok and "has no KV arena '9x9x9-float32'" in r.error, r.error
        return pool.status()

    status = asyncio.run(go())
    assert set(status["arenas"]) == {NARROW.key, DEEP.key}
    assert status["arenas"][DEEP.key]["models"] == ["deep"]
    assert status["swap"]["capacity_blocks"] == 100  # the tiers summed: 60 narrow + 40 deep


def _config_dir(root, name: str, layers: int, heads: int, kv_heads: int):
    """A model directory with only its config.json: all the kv-pool reads of a manifest's model."""
    d = root / name
    d.mkdir()
    d.joinpath("config.json").write_text(orjson.dumps({
        "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads}).decode())
    return d


def _manifest_writer(manifest, dirs: dict):
    """write(*names): the manifest lists those models (float32), with a new mtime whatever the clock."""
    def write(*names):
        manifest.write_text("".join(f"- {{name: {n}, path: '{dirs[n]}', dtype: float32}}\n" for n in names))
        os.utime(manifest, ns=(time.time_ns(), time.time_ns() + 10**9 * len(names)))
    return write


def _reload_args(manifest, total: int, node: str, retire_after: float) -> Namespace:
    return _args(models=str(manifest), dtype="float32", kv_cache_gb=total / GB, swap_space=0.0,
                 arena_retire_after=retire_after, node_id=node, model=None, quantization=None)


async def _until(what, pool, deadline_s: float = 10.0):
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, pool.status()
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _pool_hearing(nats_url: str, args: Namespace, verb: str, message):
    """A kv-pool made as at its start (make_arena) over a real nats-server, and the list of the
    `message`s it publishes on its `verb` subject: (bus, pool, first arena's descriptor, heard)."""
    from meshserve.services.kv_pool.main import make_arena

    bus = await Bus.connect(nats_url, namespace=f"reload-{verb}")
    desc, buf, budgets = await make_arena(bus, args)
    pool = KVPool(bus, args, desc, buf, budgets)
    await pool.serve()
    heard = []

    async def on(msg):
        heard.append(message.decode(msg.data))

    await bus.nc.subscribe(bus.subjects.kv(verb, args.node_id), cb=on)
    try:
        yield bus, pool, desc, heard
    finally:
        pool.close()
        await bus.close()


def test_a_reload_gives_a_removed_shapes_arena_memory_to_the_new_shape_once_nobody_uses_it(small_nats, tmp_path,  # noqa: F811
                                                                                            monkeypatch):
    """narrow (a) and deep (b) have half of the node's KV memory each; a reload replaces b by c, of a
    third shape. While deep's worker holds blocks and serves from it, c gets no room; once it has
    switched away, deep is retired (its workers told) and c's arena is made with the whole half."""
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    from meshserve.shared.schemas import ArenaRetired, Heartbeat

    dirs = {"a": _config_dir(tmp_path, "narrow", 2, 4, 2), "b": _config_dir(tmp_path, "deep", 3, 2, 1),
            "c": _config_dir(tmp_path, "wide", 4, 4, 2)}
    wide = KVShape(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, dtype="float32")  # 16 KiB blocks
    manifest = tmp_path / "models.yaml"
    write = _manifest_writer(manifest, dirs)
    write("a", "b")
    args = _reload_args(manifest, 60 * 8192 + 40 * 12288, "node-r", retire_after=1000.0)

    def heartbeat(worker: str, arena: str) -> Heartbeat:
        return Heartbeat(worker_id=worker, role="mixed", model="b", node_id="node-r", num_running=0, num_waiting=0,
                         free_blocks=0, held_blocks=0, total_blocks=0, block_size=16, max_model_len=64, arena=arena,
                         time=time.time())

    async def go():
        async with _pool_hearing(small_nats, args, "retired", ArenaRetired) as (bus, pool, desc, retired):
            async def until(what):
                await _until(what, pool)

            assert desc.key == NARROW.key and desc.num_blocks == 60
            wb, wc = KVPoolClient(bus, "node-r", "w-b"), KVPoolClient(bus, "node-r", "w-c")
            deep = await wb.arena_of(DEEP, "b")
            assert deep.num_blocks == 40
            wb.arena = deep.key
            held = (await wb.lease(5)).block_ids
            await bus.publish(bus.subjects.heartbeat, heartbeat("w-b", DEEP.key))
            await until(lambda: pool.arena_of.get("w-b") == DEEP.key)

            write("a", "c")
            pool.replan()
            assert set(pool.budgets.planned) == {NARROW.key, wide.key}
            pool.retire_unused()
            assert DEEP.key in pool.arenas  # held, and served from
            with pytest.raises(RuntimeError, match="no room for an arena of KV shape 4x2x16-float32"):
                await wc.arena_of(wide, "c")

            await wb.release(held)
            await until(lambda: not any(pool.arenas[DEEP.key].ledger.held.values()))
            pool.retire_unused()
            assert DEEP.key in pool.arenas  # still served from (its worker's heartbeat)
            await bus.publish(bus.subjects.heartbeat, heartbeat("w-b", NARROW.key))  # it switched to a
            await until(lambda: DEEP.key not in pool.arenas and retired)
            assert [(r.key, r.arena_id) for r in retired] == [(DEEP.key, deep.arena_id)]
            assert not os.path.exists(deep.path)
            made = await wc.arena_of(wide, "c")
            assert made.num_blocks == 30 and made.arena_id not in (deep.arena_id, desc.arena_id)
            return pool.status()

    status = asyncio.run(go())
    assert set(status["arenas"]) == {NARROW.key, wide.key}
    assert [(r["key"], r["reason"]) for r in status["retired"]] == [(DEEP.key, "no model of the manifest has its KV shape")]
    assert status["budgets"]["made_bytes"] == {NARROW.key: 60 * 8192, wide.key: 30 * 16384}


def test_a_reload_shrinks_an_arena_in_use_in_place_and_grows_it_back(small_nats, tmp_path, monkeypatch):  # noqa: F811
    """narrow alone has the node's whole KV memory and its two workers hold (and wrote) every block.
    A reload adds deep: narrow's arena shrinks to half while in use (its workers told); one worker
    switching to deep asks for its arena, which waits for the other's blocks beyond the half to be
    freed (not for the asker's own) and gets its whole half, and their memory leaves narrow's file.
    A reload back to narrow alone retires deep once unused and grows narrow in place."""
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    from meshserve.shared import shm
    from meshserve.shared.schemas import ArenaResized

    manifest = tmp_path / "models.yaml"
    write = _manifest_writer(manifest, {"a": _config_dir(tmp_path, "narrow", 2, 4, 2),
                                        "b": _config_dir(tmp_path, "deep", 3, 2, 1)})
    write("a")
    total = 64 * 8192  # 64 narrow blocks; half: 32 of them, or 21 deep ones (12 KiB)
    args = _reload_args(manifest, total, "node-s", retire_after=0.5)

    async def go():
        async with _pool_hearing(small_nats, args, "resized", ArenaResized) as (bus, pool, desc, resized):
            async def until(what):
                await _until(what, pool)

            assert desc.key == NARROW.key and desc.num_blocks == desc.capacity_blocks == 64
            wa, wb = KVPoolClient(bus, "node-s", "w-a"), KVPoolClient(bus, "node-s", "w-b")
            wa.arena, wa.model, wb.arena, wb.model = NARROW.key, "a", NARROW.key, "a"
            held = (await wa.lease(48)).block_ids + (await wb.lease(16)).block_ids
            assert held == list(range(64))
            blocks = pool.arenas[NARROW.key].blocks
            for b in held:  # KV in every block: the file's memory is all taken
                blocks.write(b, np.full(blocks.block_bytes, b % 250 + 1, dtype=np.uint8))
            assert shm.resident_bytes(desc.path) >= total

            write("a", "b")
            # w-b switches to b: its ask waits for w-a's blocks beyond narrow's new half, not for its
            # own (it gives those back once its new arena is made)
            deep_ask = asyncio.ensure_future(wb.arena_of(DEEP, "b"))
            await until(lambda: resized)
            assert [(r.key, r.num_blocks, r.arena_id) for r in resized] == [(NARROW.key, 32, desc.arena_id)]
            lease = await wa.lease(4)
            assert lease.block_ids == [] and lease.arena_blocks == 32  # nothing free below 32 (all held)
            assert _status(pool, NARROW.key)["outside_blocks"] == 32 and not deep_ask.done()
            await wa.release(held[32:48])  # what its worker does with the free blocks beyond the new size
            deep = await asyncio.wait_for(deep_ask, 10)
            assert deep.num_blocks == total // 2 // 12288 == 21  # its whole half, not a scaled-down part
            assert _status(pool, NARROW.key)["outside_blocks"] == 16  # w-b's, until its switch ends
            await wb.release(held[48:])
            await until(lambda: shm.resident_bytes(desc.path) <= total // 2 + 4096)  # the memory went back
            assert all(blocks.read(b)[0] == b % 250 + 1 for b in range(32))  # the KV in use kept

            write("a")
            await until(lambda: DEEP.key not in pool.arenas and len(resized) == 2)  # deep unused: retired
            assert (resized[1].key, resized[1].num_blocks) == (NARROW.key, 64)
            regrown = (await wa.lease(40)).block_ids
            assert sorted(regrown) == list(range(32, 64))  # the ids beyond the old size, leased again
            return pool.status()

    status = asyncio.run(go())
    narrow = status["arenas"][NARROW.key]
    assert (narrow["num_blocks"], narrow["outside_blocks"], narrow["bytes"]) == (64, 0, total)
    assert [(r["key"], r["from_blocks"], r["to_blocks"]) for r in status["resized"]] == [(NARROW.key, 64, 32),
                                                                                          (NARROW.key, 32, 64)]


# -- the mesh: two differently shaped models, one worker switching between them

PROMPT, TOKENS = "The quick brown fox", 8


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {"narrow": make_tiny_llama(root / "narrow", seed=31),  # 2 layers x 2 KV heads x 16
            "deep": make_tiny_llama(root / "deep", seed=32, num_hidden_layers=3, num_attention_heads=2,
                                    num_key_value_heads=1)}  # 3 layers x 1 KV head x 32


def _oracle(models: dict) -> dict[str, str]:
    """Each model's greedy text alone, in process."""
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return {n: LLM(str(p), "float32").generate([PROMPT], params)[0].text for n, p in models.items()}


def _write_manifest(manifest, models: dict, *names: str) -> None:
    manifest.write_text("".join(f"- {{name: {n}, path: '{models[n]}'}}\n" for n in names))


def _shapes_mesh(first, tmp_path, manifest) -> Mesh:
    """One decode worker, starting on `first`, serving the manifest's models."""
    return Mesh(first, tmp_path, prefill=0, decode=1, extra=["--models", str(manifest)],
                env={"MESHSERVE_CACHE": str(tmp_path / "cache")})


def _completer(mesh: Mesh):
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    return complete


def test_one_worker_serves_two_kv_shapes_switching_arenas(shaped, tmp_path):
    oracle = _oracle(shaped)
    manifest = tmp_path / "models.yaml"
    _write_manifest(manifest, shaped, *shaped)
    with _shapes_mesh(shaped["narrow"], tmp_path, manifest) as mesh:
        complete = _completer(mesh)
        assert [complete(n) for n in ("narrow", "deep", "narrow")] == [oracle["narrow"], oracle["deep"],
                                                                         oracle["narrow"]]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:  # both at once: they wait their turn
            got = list(ex.map(complete, ["deep", "narrow", "deep", "narrow"]))
        assert got == [oracle["deep"], oracle["narrow"]] * 2
        status = mesh.ask("scheduler.status")
        switches = status["recent_model_switches"]
        assert len(switches) >= 2 and all(s["ok"] for s in switches), switches
        kv = mesh.ask("kv.node0.status")
        narrow_key, deep_key = "2x2x16-float32", "3x1x32-float32"
        assert set(kv["arenas"]) == {narrow_key, deep_key}, kv["arenas"]
        assert kv["arenas"][deep_key]["models"] == ["deep"] and "narrow" in kv["arenas"][narrow_key]["models"]
        assert kv["models"]["deep"]["arena"] == deep_key and kv["models"]["narrow"]["arena"] == narrow_key
        worker = status["workers"][0]  # its heartbeat names the arena of the model it serves
        assert worker["arena"] == {"narrow": narrow_key, "deep": deep_key}[worker["model"]], worker
        half = kv["budgets"]["total_bytes"] // 2  # two models, no quotas: half of --kv-cache-gb each
        assert all(abs(a["bytes"] - half) <= a["block_bytes"] for a in kv["arenas"].values()), kv["arenas"]
        # The worker is on one model: the other arena's blocks all went back at its switch.
        deadline = time.monotonic() + 10
        while True:
            kv = mesh.ask("kv.node0.status")["arenas"]
            idle = [k for k, a in kv.items() if not a["holders"]]
            if len(idle) == 1 and kv[idle[0]]["free_blocks"] == kv[idle[0]]["num_blocks"]:
                break
            assert time.monotonic() < deadline, kv
            time.sleep(0.2)


def test_a_reload_that_replaces_a_shape_serves_the_new_one_in_the_removed_ones_memory(shaped, tmp_path):
    """narrow and deep have half the node's KV memory each. A reload replaces deep by wide, a third
    shape: with arenas sized once, wide would find no room; the idle deep arena is retired instead
    and wide's is made with its half. Every model's text equals the model alone."""
    import httpx

    models = {**shaped, "wide": make_tiny_llama(tmp_path / "wide", seed=33, num_hidden_layers=4)}  # 4 x 2 x 16
    oracle = _oracle(models)
    manifest = tmp_path / "models.yaml"
    _write_manifest(manifest, models, "narrow", "deep")
    with _shapes_mesh(shaped["narrow"], tmp_path, manifest) as mesh:
        complete = _completer(mesh)
        assert [complete(n) for n in ("deep", "narrow")] == [oracle["deep"], oracle["narrow"]]
        deep_key, wide_key = "3x1x32-float32", "4x2x16-float32"
        assert deep_key in mesh.ask("kv.node0.status")["arenas"]
        _write_manifest(manifest, models, "narrow", "wide")
        r = httpx.post(mesh.url + "/admin/models/reload", timeout=30)
        assert r.status_code == 200, r.text
        assert [complete(n) for n in ("wide", "narrow", "wide")] == [oracle["wide"], oracle["narrow"], oracle["wide"]]
        kv = mesh.ask("kv.node0.status")
        assert set(kv["arenas"]) == {"2x2x16-float32", wide_key}, kv["arenas"]
        assert [(x["key"], x["models"]) for x in kv["retired"]] == [(deep_key, ["deep"])], kv["retired"]
        half = kv["budgets"]["total_bytes"] // 2
        assert abs(kv["arenas"][wide_key]["bytes"] - half) <= kv["arenas"][wide_key]["block_bytes"], kv["arenas"]
        assert "let go of KV arena 3x1x32-float32" in mesh.log.read_text()


def test_a_reload_that_adds_a_shape_shrinks_the_arena_in_use_and_serves_both(shaped, tmp_path):
    """narrow alone has the node's whole KV memory (256 blocks), and two workers serve it: the
    first leased every block at its start. A reload adds deep: narrow's arena shrinks to half while
    both workers are on it, the first gives back the blocks beyond the half, and a worker that takes
    up deep gets deep's half. With arenas sized once (or resized only when idle) deep's arena would
    find no room and its request a 503. Every model's text equals the model alone."""
    import httpx

    oracle = _oracle(shaped)
    manifest = tmp_path / "models.yaml"
    _write_manifest(manifest, shaped, "narrow")
    with Mesh(shaped["narrow"], tmp_path, prefill=0, decode=2, env={"MESHSERVE_CACHE": str(tmp_path / "cache")},
              extra=["--models", str(manifest), "--kv-cache-gb", str(256 * 8192 / GB)]) as mesh:
        complete = _completer(mesh)
        assert complete("narrow") == oracle["narrow"]
        narrow_key, deep_key = "2x2x16-float32", "3x1x32-float32"
        kv = mesh.ask("kv.node0.status")
        assert kv["arenas"][narrow_key]["num_blocks"] == 256 and max(kv["holders"].values()) > 0, kv
        _write_manifest(manifest, shaped, "narrow", "deep")
        r = httpx.post(mesh.url + "/admin/models/reload", timeout=30)
        assert r.status_code == 200, r.text
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(complete, ["deep", "narrow", "deep", "narrow"]))
        assert got == [oracle["deep"], oracle["narrow"]] * 2
        kv = mesh.ask("kv.node0.status")
        assert [(x["key"], x["from_blocks"], x["to_blocks"]) for x in kv["resized"]] == [(narrow_key, 256, 128)], kv
        assert kv["retired"] == [] and kv["arenas"][narrow_key]["num_blocks"] == 128
        assert kv["arenas"][deep_key]["num_blocks"] == 128 * 8192 // 12288, kv["arenas"]  # its whole half
        deadline = time.monotonic() + 10  # every block beyond the half comes back (the idle workers' too)
        while kv["arenas"][narrow_key]["outside_blocks"]:
            assert time.monotonic() < deadline, kv["arenas"]
            time.sleep(0.1)
            kv = mesh.ask("kv.node0.status")


def test_two_meshes_on_one_host_never_share_an_arena_file():
    """The same namespace, node id and KV shape under two NATS servers (two `meshserve up` on one
    host): two files. A restart of one mesh's kv-pool (the same NATS URL) makes the same name again,
    replacing its own file rather than leaving one behind."""
    made = []
    try:
        for url in ("nats://127.0.0.1:4222", "nats://127.0.0.1:4333", "nats://127.0.0.1:4222"):
            desc, _ = create_arena("meshserve", "node0", NARROW, "float32", 16, 4 * 8192, 0, "cpu", "e", nats_url=url)
            made.append(desc.path)
        assert made[0] != made[1] and made[0] == made[2]
        assert os.path.basename(made[0]).startswith("meshserve-meshserve-node0-") and "-kv-" in made[0]
    finally:
        for p in set(made):
            if os.path.exists(p):
                os.unlink(p)
