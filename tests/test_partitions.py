"""Resource partitions per model (issue 12, shared/partitions.py, docs/models.md): the manifest's
`memory_quota_gb` (weights plus KV blocks), `cpus` and `gpu_percent`.

The mesh test runs one `meshserve up` (real nats-server, real processes) with two decode workers and
two tiny models of one KV shape, one with a memory quota that leaves it a few KV blocks, under more
load than that: the kv-pool's count of its blocks never exceeds the quota, its requests complete
with the model's own greedy output, and the other model's are unaffected.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
import threading
import time

import httpx
import nats
import openai
import orjson
import pytest
from mesh_util import Mesh
from tiny_model import make_tiny_llama

from meshserve.services.kv_pool.main import BlockLedger
from meshserve.services.worker.threads import ThreadTuner
from meshserve.shared.manifest import ManifestError, load_manifest
from meshserve.shared.partitions import (MPS_ENV, MPSDaemon, PartitionError, apply_cpus, format_cpus,
                                         kv_quota_blocks, mps_env, parse_cpus, resolve_cpus, threads_for)

# -- cpus, gpu_percent and the quota's arithmetic


def test_cpus_lists_and_counts_resolve_to_disjoint_cores(tmp_path, tiny_llama):
    assert parse_cpus("0") == [0] and parse_cpus("0-2") == [0, 1, 2] and parse_cpus("3, 0-1") == [0, 1, 3]
    assert parse_cpus(2) == 2 and format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("a", "1-", "3-1", "", 0, -1, True, 1.5):
        with pytest.raises(PartitionError):
            parse_cpus(bad)
    f = tmp_path / "m.yaml"
    f.write_text(f"- {{name: a, path: '{tiny_llama}', cpus: 2, gpu_percent: 30, memory_quota_gb: 0.5}}\n"
                 f"- {{name: b, path: '{tiny_llama}', cpus: '0-1'}}\n- {{name: c, path: '{tiny_llama}', cpus: 1}}\n"
                 f"- {{name: d, path: '{tiny_llama}'}}\n")
    m = load_manifest(f)
    assert m.get("a").gpu_percent == 30 and m.get("b").cpus == "0-1" and m.get("c").cpus == 1
    # lists keep their cores; counts take the others, in manifest order, without overlap
    assert resolve_cpus(m.models, range(6)) == {"a": [2, 3], "b": [0, 1], "c": [4]}
    with pytest.raises(PartitionError, match="more cores than are left"):
        resolve_cpus(m.models, range(4))
    with pytest.raises(PartitionError, match=r"names cores \[1\] that this node does not have"):
        resolve_cpus(m.models, [0, 2, 3, 4, 5])
    for text, words in ((f"- {{name: a, path: '{tiny_llama}', cpus: 'x'}}", "cpus"),
                        (f"- {{name: a, path: '{tiny_llama}', cpus: 0}}", "at least 1"),
                        (f"- {{name: a, path: '{tiny_llama}', gpu_percent: 0}}", "gpu_percent")):
        f.write_text(text)
        with pytest.raises(ManifestError, match=words):
            load_manifest(f)
    assert threads_for([0, 1, 2], None) == 3 and threads_for([0, 1, 2], 2) == 2 and threads_for([4], 8) == 1
    assert kv_quota_blocks(None, 10, 4) is None and kv_quota_blocks(1.0, (1 << 30) - 40, 8) == 5
    assert kv_quota_blocks(0.5, 1 << 30, 8) == 0  # weights above the quota leave no KV


def test_apply_cpus_moves_every_thread_of_the_process():
    before = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()))
    t.start()
    started.wait()
    one = [min(before)]
    try:
        apply_cpus(one)
        tids = [int(x) for x in os.listdir("/proc/self/task")]
        assert t.native_id in tids and all(os.sched_getaffinity(tid) == set(one) for tid in tids)
    finally:
        apply_cpus(sorted(before))
        stop.set()
        t.join()
    assert os.sched_getaffinity(0) == before


def test_the_thread_tuner_never_runs_more_threads_than_its_cores():
    chosen, now = [], [0.0]

    def step():  # a made-up machine where more threads are faster
        now[0] += 1.0 / (chosen[-1] if chosen else 8)

    tuner = ThreadTuner(8, chosen.append, explore_every=2, clock=lambda: now[0])
    for _ in range(10):
        tuner.run(1, step)
    assert 8 in chosen
    tuner.limit(2)  # a model on two cores
    assert tuner.candidates == [1, 2] and tuner.current == 2
    before = len(chosen)
    for _ in range(20):
        tuner.run(1, step)
    assert chosen[before:] and max(chosen[before:]) <= 2 and set(tuner.chosen) == {1, 2}
    tuner.limit(1)
    tuner.run(1, step)
    assert tuner.candidates == [1] and tuner.current == 1


def test_block_ledger_keeps_each_model_within_its_quota():
    led = BlockLedger(32)
    assert len(led.lease("a1", 10, "a", limit=6)) == 6  # capped by a's quota
    assert led.lease("a2", 4, "a", limit=6) == []  # a's other worker too: the quota is the model's
    assert len(led.lease("b1", 20, "b")) == 20  # b has none
    blocks = led.held["a1"]
    first = next(iter(blocks))
    led.retain("a1", [first])
    assert led.transfer("a1", "a2", [first])  # a handoff: one block held twice counts once
    assert led.by_model["a"] == 6 and led.peak["a"] == 6
    led.release("a1", [b for b in list(blocks) if b != first])
    assert led.by_model["a"] == 1  # `first` is still held, by both
    assert len(led.lease("a1", 10, "a", limit=6)) == 5
    led.drop_worker("a1")
    led.drop_worker("a2")
    assert led.by_model["a"] == 0 and led.peak["a"] == 6 and led.by_model["b"] == 20
    assert len(led.free) == 12


def test_the_kv_pool_reads_quotas_from_the_manifest_as_it_changes(tmp_path, tiny_llama):
    from meshserve.services.kv_pool.main import KVQuotas

    f = tmp_path / "m.yaml"
    f.write_text(f"- {{name: a, path: '{tiny_llama}', memory_quota_gb: 1.0}}\n- {{name: b, path: '{tiny_llama}'}}\n")
    q = KVQuotas(str(f), block_bytes=1 << 20)
    q.saw("a", 256 << 20)  # its weights, as its workers report them
    assert q.limit("a") == 768 and q.limit("b") is None and q.limit("unknown") is None
    f.write_text(f"- {{name: a, path: '{tiny_llama}', memory_quota_gb: 0.5}}\n")
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later modification time, however coarse
    assert q.limit("a") == 256
    f.write_text("- {name: a, path: x, memory_quota_gb: -1}\n")  # invalid: the last good manifest stays
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert q.limit("a") == 256
    assert KVQuotas(None, 1 << 20).limit("a") is None


# -- CUDA: MPS (no GPU needed: the environment and the commands are checked)


def test_cuda_workers_get_their_models_mps_share(tmp_path, tiny_llama):
    from argparse import Namespace

    from meshserve.cli.launcher import check_partitions, worker_env

    f = tmp_path / "m.yaml"
    f.write_text(f"- {{name: a, path: '{tiny_llama}', gpu_percent: 30}}\n- {{name: b, path: '{tiny_llama}'}}\n")
    env = worker_env(Namespace(models=str(f), device="cuda"))
    assert env(0) == {MPS_ENV: "30"} and env(1) == {} and env(2) == {MPS_ENV: "30"}  # worker i: model i mod n
    assert worker_env(Namespace(models=str(f), device="cpu"))(0) == {}
    assert mps_env(None) == {} and mps_env(100) == {MPS_ENV: "100"}
    with pytest.raises(ValueError, match="--mps .* needs --device cuda"):
        check_partitions(Namespace(mps=True, device="cpu", models=None))
    f.write_text(f"- {{name: a, path: '{tiny_llama}', cpus: '{max(os.sched_getaffinity(0)) + 1}'}}\n")
    with pytest.raises(ValueError, match="this node does not have"):
        check_partitions(Namespace(mps=False, device="cpu", models=str(f)))


def test_mps_daemon_is_started_when_none_runs_and_stopped_only_then(tmp_path):
    """A stand-in for nvidia-cuda-mps-control (NVIDIA's, not ours): it logs each call and answers
    `get_server_list` as the real one does, 0 while its daemon runs."""
    log, state = tmp_path / "calls.log", tmp_path / "running"
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "-d" ]; then echo "-d" >> {log}; touch {state}; exit 0; fi
read cmd; echo "$cmd" >> {log}
case "$cmd" in
  get_server_list) [ -f {state} ] && exit 0; echo "Cannot find MPS control daemon process" >&2; exit 1;;
  quit) rm -f {state}; exit 0;;
esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    d = MPSDaemon(str(fake))
    assert d.start_command() == [str(fake), "-d"]
    d.start()
    assert state.exists() and d.started
    d.stop()
    assert not state.exists() and log.read_text().split() == ["get_server_list", "-d", "quit"]
    state.touch()  # one already runs (started by hand): used, never stopped
    other = MPSDaemon(str(fake))
    other.start()
    other.stop()
    assert state.exists() and log.read_text().split()[-1] == "get_server_list"
    missing = MPSDaemon(str(fake))
    missing.binary = None  # as when PATH has none
    with pytest.raises(PartitionError, match="not on PATH"):
        missing.start()


def test_up_refuses_cpus_this_machine_lacks_in_one_line(tmp_path, tiny_llama):
    f = tmp_path / "m.yaml"
    f.write_text(f"- {{name: a, path: '{tiny_llama}', cpus: '{max(os.sched_getaffinity(0)) + 1}'}}\n")
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "up", "--models", str(f)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "does not have" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- the memory quota through the mesh

QUOTA_BLOCKS = 12
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 40, 24, 6  # 4 blocks each at the end: 24 in all, twice the quota


def _prompt(i: int) -> list[int]:
    return [3 + (i * 31 + j * 17) % 380 for j in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quota-models")
    return {"small": make_tiny_llama(root / "small", seed=21), "other": make_tiny_llama(root / "other", seed=22,
                                                                                        intermediate_size=96)}


def test_a_model_over_its_memory_quota_stays_within_it_and_still_serves(two_models, tmp_path):
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    oracle = {n: [c.text for c in LLM(str(p), "float32").generate([_prompt(i) for i in range(REQUESTS)], params)]
              for n, p in two_models.items()}
    # The quota: the weights (the loader's shared file is the tensors, a few alignment bytes apart from
    # the safetensors file) plus QUOTA_BLOCKS blocks of 2 layers x K,V x 16 tokens x 2 heads x 16 x fp32.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    weights = os.path.getsize(two_models["small"] / "model.safetensors")
    quota_gb = (weights + (QUOTA_BLOCKS + 0.5) * block_bytes) / (1 << 30)
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- {{name: small, path: '{two_models['small']}', memory_quota_gb: {quota_gb:.12f}}}\n"
                        f"- {{name: other, path: '{two_models['other']}'}}\n")
    with Mesh(two_models["small"], tmp_path, prefill=0, decode=2, extra=["--models", str(manifest)],
              env={"MESHSERVE_CACHE": str(tmp_path / "cache")}) as mesh:
        got, seen, pressure = asyncio.run(_load(mesh))
        kv = mesh.ask("kv.node0.status")["models"]
        small, other = kv["small"], kv["other"]
        assert abs(small["quota_blocks"] - QUOTA_BLOCKS) <= 1, small  # the weights' bytes as the loader counts them
        assert small["peak_blocks"] == small["quota_blocks"], small  # it held its whole quota ...
        assert max(seen) <= small["quota_blocks"], (seen, small)  # ... and never more, under twice that demand
        assert other["quota_blocks"] is None and other["peak_blocks"] > small["quota_blocks"], other
        assert got == oracle  # both models' greedy outputs, each equal to the model alone
        # no node-wide pressure: a shortage of the small model's was its own (its workers' alone)
        assert all(p["model"] == "small" for p in pressure), pressure
        deadline = time.monotonic() + 10  # the scheduler asks the pool every second
        while _gauge(mesh, "meshserve:model_kv_quota_blocks", "small") is None:
            assert time.monotonic() < deadline, httpx.get(mesh.url + "/metrics", timeout=10).text
            time.sleep(0.2)
        assert _gauge(mesh, "meshserve:model_kv_quota_blocks", "small") == small["quota_blocks"]
        assert _gauge(mesh, "meshserve:model_kv_quota_blocks", "other") is None  # no quota, no series
        assert _gauge(mesh, "meshserve:model_kv_blocks", "other") > 0
        # A request that can never fit the quota fails at once, as the request's own fault (a 400).
        client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match=r"tokens of KV cache.*the model's memory quota"):
            client.completions.create(model="small", prompt=_prompt(0), max_tokens=200, extra_body={"ignore_eos": True})


def _gauge(mesh: Mesh, name: str, model: str) -> float | None:
    """The value of the series `name` whose `model` label is `model`, on the gateway's /metrics."""
    for line in httpx.get(mesh.url + "/metrics", timeout=10).text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{") and dict(re.findall(r'(\w+)="([^"]*)"', series)).get("model") == model:
            return float(value)
    return None


async def _load(mesh: Mesh):
    """Both models' requests at once, while the kv-pool's count of the small model's blocks and its
    pressure broadcasts are watched."""
    nc = await nats.connect(mesh.nats_url)
    pressure, seen = [], []

    async def on_pressure(msg):
        pressure.append(orjson.loads(msg.data))

    await nc.subscribe(f"{mesh.namespace}.kv.node0.pressure", cb=on_pressure)
    client = openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    done = asyncio.Event()

    async def watch():
        while not done.is_set():
            st = orjson.loads((await nc.request(f"{mesh.namespace}.kv.node0.status", b"", timeout=5)).data)
            seen.append(st["models"].get("small", {}).get("blocks", 0))
            await asyncio.sleep(0.02)

    async def one(model: str, i: int) -> str:
        r = await client.completions.create(model=model, prompt=_prompt(i), max_tokens=OUTPUT_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    watcher = asyncio.ensure_future(watch())
    try:
        texts = await asyncio.gather(*(one(m, i) for m in ("small", "other") for i in range(REQUESTS)))
    finally:
        done.set()
        await watcher
        await nc.close()
    return {m: list(texts[k * REQUESTS:(k + 1) * REQUESTS]) for k, m in enumerate(("small", "other"))}, seen, pressure

