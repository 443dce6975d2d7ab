"""The mesh on the CUDA backend (`meshserve up --device cuda`): real nats-server and processes, the
model-loader's weights and the kv-pool's arena in GPU memory shared by CUDA IPC handles.

- one copy of the weights: every worker opens the loader's allocation by its handle and allocates
  next to nothing of its own on the GPU; the test process opens it too and finds the weights there;
- greedy outputs through the mesh (one prefill and two decode workers) equal the in-process engine
  on CUDA, which equals Transformers in fp32;
- a prefill -> decode handoff on one node moves block ids, no tensor bytes, over NATS;
- the kv-pool's copies on a GPU arena: the host swap tier (out and back in) and the cross-node pull
  (source and destination arenas on the GPU), on blocks a stand-in worker leased and wrote;
- many models on the GPU (issue 12): the mapped tier in GPU memory within --weights-memory-gb,
  LRU to the host tier and back by one copy, an evicted allocation and a retired arena freed once
  no worker has them open; layered loading; workers under a real MPS daemon where one is installed.

Skipped, with the reason, where CUDA cannot run (no GPU, or no CuPy): tests/test_device_backend.py
checks the rest everywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time

import httpx
import pytest
import torch

from mesh_util import Mesh, bus_bytes_of_completion
from meshserve.shared import node_memory, shm
from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.sequence import SamplingParams

CUDA_PROBLEM = node_memory.cuda_problem()
pytestmark = pytest.mark.skipif(CUDA_PROBLEM is not None, reason=f"needs CUDA and CuPy: {CUDA_PROBLEM}")

PROMPTS = ["The quick brown fox", "Hello world! Hello there", "def add(a, b):", "Once upon a time there was",
           "Numbers: 0 1 2 3", "Café, naïve, résumé", "What is the capital of France?",
           "Streaming tokens one at a time lets the user read"]
MEMORY_LINE = re.compile(r"worker (\S+) memory: weights=(\S+) weights_handle=(\w+) weights_bytes=(\d+) arena=(\S+) "
                         r"arena_handle=(\w+) own_gpu_bytes=(\d+)")


@pytest.fixture(scope="module")
def mesh(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda-mesh")
    m = Mesh(tiny_llama, tmp, prefill=1, decode=2, extra=["--device", "cuda"])
    try:
        yield m.wait_ready(timeout=120)
    finally:
        m.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The in-process engine on the same GPU: the mesh must produce the same text."""
    return LLM(str(tiny_llama), "float32", device="cuda")


def expected(llm: LLM, prompt, max_tokens: int) -> str:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def complete(mesh: Mesh, prompt, max_tokens: int) -> str:
    r = httpx.post(mesh.url + "/v1/completions", timeout=120, json={
        "model": mesh.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def _connect(mesh: Mesh):
    from meshserve.shared.bus import Bus

    return await Bus.connect(mesh.nats_url, name="test-cuda-mesh", namespace=mesh.namespace)


def test_workers_share_one_copy_of_the_weights_and_the_arena(mesh, tiny_llama):
    from meshserve.shared.model.llama import fuse_hf_weights
    from meshserve.shared.model.weights import load_hf_dir
    from meshserve.shared.schemas import ArenaDescriptor, LeaseRequest, LoadRequest, WeightsDescriptor

    deadline, lines = time.monotonic() + 60, []
    while time.monotonic() < deadline:  # each worker logs what it opened once it is up
        lines = MEMORY_LINE.findall(mesh.log.read_text(errors="replace"))
        if len(lines) >= 3:
            break
        time.sleep(0.5)
    assert len(lines) == 3, f"expected 3 workers' memory lines:\n{mesh.log.read_text()[-4000:]}"

    async def descriptors():
        bus = await _connect(mesh)
        try:
            w = await bus.request(bus.subjects.models("load", "node0"), LoadRequest(model=mesh.model, dtype="float32"),
                                  WeightsDescriptor, timeout=30)
            a = await bus.request(bus.subjects.kv("arena", "node0"), LeaseRequest(worker_id="test", num_blocks=0),
                                  ArenaDescriptor, timeout=30)
            return w, a
        finally:
            await bus.close()

    w, a = asyncio.run(descriptors())
    assert (w.backend, a.backend) == ("cuda", "cuda") and w.path.startswith("cuda:") and a.path.startswith("cuda:")
    assert w.ipc["kind"] == a.ipc["kind"] == "cudaipc" and w.ipc["handle"] != a.ipc["handle"]
    print("workers:", [(wid, int(own)) for wid, *_, own in lines], "weights bytes:", w.ipc["alloc_bytes"])
    for wid, wpath, whandle, wbytes, apath, ahandle, own in lines:
        # The loader's one allocation and the pool's one arena, opened by handle in every worker ...
        assert (wpath, whandle, int(wbytes)) == (w.path, w.ipc["handle"][:16], w.ipc["alloc_bytes"]), wid
        assert (apath, ahandle) == (a.path, a.ipc["handle"][:16]), wid
        # ... and nothing of the weights' size allocated by the worker itself (rope tables only).
        assert int(own) < w.ipc["alloc_bytes"] // 2, (wid, own)

    # The weights are in the loader's GPU memory: this process opens them too and finds them there.
    buf = node_memory.open_buffer(w.backend, w.path, w.ipc)
    assert buf.is_cuda and buf.numel() == w.ipc["alloc_bytes"]
    cfg, sd = load_hf_dir(tiny_llama)
    want = fuse_hf_weights(cfg, sd, torch.float32)
    for t in w.tensors:
        assert torch.equal(shm.view(buf, t.offset, t.dtype, t.shape).cpu(), want[t.name]), t.name
    assert sum(want[t.name].numel() * 4 for t in w.tensors) <= w.ipc["alloc_bytes"]


def test_greedy_through_the_mesh_equals_the_engine_and_transformers(mesh, reference, tiny_llama):
    from transformers import AutoModelForCausalLM

    from oracle import hf_greedy

    jobs = [(p, 8 + 3 * i) for i, p in enumerate(PROMPTS)] + [(p, 6) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:  # batched on the workers
        got = list(ex.map(lambda j: complete(mesh, *j), jobs))
    assert got == [expected(reference, p, n) for p, n in jobs]

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = [reference.tokenizer.encode(p) for p in PROMPTS]
    eos = reference.engine.eos_token_ids
    engine = [c.token_ids for c in reference.generate(ids, SamplingParams(max_tokens=12, temperature=0))]
    assert engine == hf_greedy(hf, ids, 12, sorted(eos))


def test_handoff_on_one_node_moves_no_tensor_bytes_over_nats(mesh, reference, tiny_llama):
    """Every byte on the bus while a long prompt is prefilled and handed to a decode worker (as
    tests/test_mesh.py counts them on the CPU backend)."""
    from meshserve.shared.model.weights import load_hf_dir

    cfg, _ = load_hf_dir(tiny_llama)
    prompt = reference.tokenizer.encode(" ".join(PROMPTS * 3))[:200]
    kv_bytes = len(prompt) * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4

    body = {"model": mesh.model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    r, seen = bus_bytes_of_completion(mesh.nats_url, mesh.namespace, body)
    print("bytes on the bus by subject:", seen)
    assert r["choices"][0]["text"] == expected(reference, prompt, 5)
    handoff = seen.get("scheduler.handoff", 0) + seen.get("worker.adopt", 0)
    assert handoff > 0, f"no handoff seen: {seen}"
    assert handoff < 16 * len(prompt) + 4096 < kv_bytes  # token and block ids, never the KV
    assert not any(k in seen for k in ("kv.fetch", "kv.chunk", "kv.import")), seen  # no transfer on one node
    request_bytes = sum(v for k, v in seen.items() if not k.startswith(("workers.", "kv.events")))
    assert request_bytes < kv_bytes / 2, seen


def test_kv_pool_swaps_and_serves_gpu_blocks(mesh):
    """A stand-in worker leases blocks of the pool's GPU arena, writes them through its own handle,
    has the pool spill two to the host tier and bring them back into each other's place, then pulls
    blocks as another node's kv-pool would, into an arena on this process's GPU."""
    from meshserve.services.kv_pool import transfer
    from meshserve.services.kv_pool.blocks import ArenaBlocks
    from meshserve.shared.schemas import ArenaDescriptor, LeaseReply, LeaseRequest, SwapReply, SwapRequest

    me, k0, k1 = "test-kv-stand-in", 0x5EED0001, 0x5EED0002

    async def go():
        bus = await _connect(mesh)
        s = bus.subjects
        try:
            async def lease(n: int) -> list[int]:  # also what keeps the pool from reaping the stand-in
                r = await bus.request(s.kv("lease", "node0"), LeaseRequest(worker_id=me, num_blocks=n), LeaseReply)
                return r.block_ids

            a = await bus.request(s.kv("arena", "node0"), LeaseRequest(worker_id=me, num_blocks=0), ArenaDescriptor)
            arena = shm.view(node_memory.open_buffer(a.backend, a.path, a.ipc), 0, a.dtype, a.shape)
            assert arena.is_cuda
            blocks = ArenaBlocks(arena, a.block_size)
            b = await lease(3)
            assert len(b) == 3
            g = torch.Generator().manual_seed(7)
            pattern = [torch.randint(0, 256, (blocks.block_bytes,), dtype=torch.uint8, generator=g) for _ in b]
            for blk, p in zip(b, pattern):
                blocks.write(blk, p)
            r = await bus.request(s.kv("swap", "node0"), SwapRequest(worker_id=me, swap_out=[(b[0], k0), (b[1], k1)]),
                                  SwapReply)
            assert r.ok and r.stored == 2, r
            zero = torch.zeros(blocks.block_bytes, dtype=torch.uint8)
            blocks.write(b[0], zero)
            blocks.write(b[1], zero)
            r = await bus.request(s.kv("swap", "node0"), SwapRequest(worker_id=me, swap_in=[(k0, b[1]), (k1, b[0])]),
                                  SwapReply)
            assert r.ok and r.restored == 2, r
            assert torch.equal(blocks.read(b[1]), pattern[0]) and torch.equal(blocks.read(b[0]), pattern[1])

            await lease(0)
            shape = list(a.shape)
            shape[2] = 4 * a.block_size
            local = ArenaBlocks(torch.zeros(shape, dtype=arena.dtype, device=arena.device), a.block_size)
            nbytes, chunks = await transfer.pull(bus, "node0", "test-cuda-pull", me, [b[2], b[0]], [3, 1], local,
                                                 max_chunk_bytes=blocks.block_bytes // 3 + 1, timeout=10,
                                                 also_release=[b[1]])
            assert nbytes == 2 * blocks.block_bytes and chunks > 2
            assert torch.equal(local.read(3), pattern[2]) and torch.equal(local.read(1), pattern[1])
            assert not local.read(0).any() and not local.read(2).any()  # the pull released all three blocks
        finally:
            await bus.close()  # on a failure the pool reclaims the stand-in's blocks when it goes silent

    asyncio.run(go())
    # The mesh still serves after all that.
    assert complete(mesh, PROMPTS[0], 4)


def test_int8_weights_and_int8_kv_through_the_mesh_equal_the_engine(tiny_llama, tmp_path):
    """`meshserve up --device cuda --quantization int8 --kv-cache-dtype int8`: the loader's int8
    weights and scales and the int8 arena (rows with their scales) shared by CUDA IPC handles; greedy
    text through a prefill -> decode handoff equals the in-process engine on the same GPU."""
    llm = LLM(str(tiny_llama), "float32", device="cuda", quantization="int8", kv_cache_dtype="int8")
    assert llm.engine.kv_cache.dtype == torch.int8
    m = Mesh(tiny_llama, tmp_path, prefill=1, decode=1,
             extra=["--device", "cuda", "--quantization", "int8", "--kv-cache-dtype", "int8"])
    try:
        m.wait_ready(timeout=120)
        jobs = [(p, 6 + 2 * i) for i, p in enumerate(PROMPTS)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: complete(m, *j), jobs))
        assert got == [expected(llm, p, n) for p, n in jobs]
    finally:
        m.stop()


def test_layered_loading_on_the_gpu_gives_the_tokens_of_loading_first(tmp_path):
    """A worker switches to a cold model whose load is layered (the loader slowed per part): it
    computes while the later layers are still copied to the GPU, and its greedy text equals the
    same weights loaded whole (the readiness word in host memory orders the loader's copies before
    the worker's kernels: docs/models.md "Layered loading")."""
    import shutil

    from meshserve.services.model_loader import loads
    from tiny_model import make_tiny_llama

    deep = make_tiny_llama(tmp_path / "deep", num_hidden_layers=4, seed=21)
    paths = {n: shutil.copytree(deep, tmp_path / n) for n in ("first", "layered", "whole")}
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- {{name: first, path: '{paths['first']}'}}\n"
                        f"- {{name: layered, path: '{paths['layered']}', layered_loading: true}}\n"
                        f"- {{name: whole, path: '{paths['whole']}', layered_loading: false}}\n")
    want = expected(LLM(str(deep), "float32", device="cuda"), PROMPTS[0], 6)
    m = Mesh(paths["first"], tmp_path, prefill=0, decode=1,
             extra=["--device", "cuda", "--models", str(manifest), "--no-prewarm"],
             env={loads.PART_DELAY_ENV: "0.4", "MESHSERVE_CACHE": str(tmp_path / "cache")})
    try:
        m.wait_ready(timeout=120)

        def run(model: str) -> str:
            r = httpx.post(m.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert run("layered") == run("whole") == want
        switches = {s["to"]: s for s in m.ask("scheduler.status")["recent_model_switches"]}
        loaded = {x["name"]: x for x in m.ask("models.node0.status")["models"]}
        took = {n: loaded[n]["load_s"]["source"] for n in ("layered", "whole")}
        assert min(took.values()) > 2.0, took  # six parts at 0.4 s
        assert switches["layered"]["ok"] and switches["layered"]["seconds"] < took["layered"] - 1.0, (switches, took)
        assert switches["whole"]["ok"] and switches["whole"]["seconds"] >= took["whole"], (switches, took)
    finally:
        m.stop()


def _models_oracle(models: dict, prompt: str, tokens: int) -> dict[str, str]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return {n: LLM(str(p), "float32", device="cuda").generate([prompt], params)[0].text for n, p in models.items()}


def _wait_for(what, check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_gpu_weights_tier_evicts_to_host_and_frees_gpu_memory_once_workers_let_go(tmp_path):
    """Three models, GPU memory for the weights of two (--weights-memory-gb): the least recently
    used goes to the host tier (a copy in the loader's memory) and comes back from it by one copy;
    its GPU allocation is freed once the worker no longer lists its CUDA IPC handle. A reload that
    replaces a model by one of a new KV shape retires the old shape's GPU arena, freed the same way.
    Every text equals the model alone on the GPU."""
    import os

    from tiny_model import make_tiny_llama

    models = {"narrow": make_tiny_llama(tmp_path / "narrow", seed=31),  # 2 layers x 2 KV heads x 16
              "deep": make_tiny_llama(tmp_path / "deep", seed=32, num_hidden_layers=3, num_attention_heads=2,
                                      num_key_value_heads=1),  # 3 x 1 x 32
              "other": make_tiny_llama(tmp_path / "other", seed=33),  # narrow's shape
              "wide": make_tiny_llama(tmp_path / "wide", seed=34, num_hidden_layers=4)}  # 4 x 2 x 16
    prompt, tokens = PROMPTS[0], 8
    oracle = _models_oracle(models, prompt, tokens)
    manifest = tmp_path / "models.yaml"

    def write(*names):
        manifest.write_text("".join(f"- {{name: {n}, path: '{models[n]}'}}\n" for n in names))

    write("narrow", "deep", "other")
    size = {n: os.path.getsize(p / "model.safetensors") for n, p in models.items()}
    # Room for deep and other, not for narrow beside them: the third load evicts the least recently used.
    budget, gb = size["deep"] + size["other"] + size["narrow"] / 2, 1 << 30
    m = Mesh(models["narrow"], tmp_path, prefill=0, decode=1, env={"MESHSERVE_CACHE": str(tmp_path / "cache")},
             extra=["--device", "cuda", "--models", str(manifest), "--no-prewarm",
                    "--weights-memory-gb", f"{budget / gb:.9f}", "--host-cache-gb", f"{4 * max(size.values()) / gb:.9f}"])
    try:
        m.wait_ready(timeout=120)

        def complete(name: str) -> str:  # httpx: the GPU image has no openai package
            r = httpx.post(m.url + "/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        def tier(name: str) -> str:
            return next(x for x in m.ask("models.node0.status")["models"] if x["name"] == name)["tier"]

        assert [complete(n) for n in ("narrow", "deep", "other")] == [oracle[n] for n in ("narrow", "deep", "other")]
        _wait_for("narrow evicted to the host tier", lambda: tier("narrow") == "host")
        freed = _wait_for("narrow's GPU allocation freed", lambda: (
            g := m.ask("models.node0.status")["gpu_retired"])["freed"] >= 1 and not g["pending"] and g)
        assert freed["freed_bytes"] > 0, freed
        assert complete("narrow") == oracle["narrow"]  # back from host memory into a new allocation
        narrow = next(x for x in m.ask("models.node0.status")["models"] if x["name"] == "narrow")
        assert narrow["tier"] == "mapped" and "host" in narrow["load_s"], narrow
        # A reload: deep (its own KV shape) goes, wide (a new one) comes.
        write("narrow", "other", "wide")
        r = httpx.post(m.url + "/admin/models/reload", timeout=30)
        assert r.status_code == 200, r.text
        assert [complete(n) for n in ("wide", "narrow")] == [oracle["wide"], oracle["narrow"]]
        deep_key = "3x1x32-float32"
        kv = _wait_for("deep's GPU arena retired and freed", lambda: (
            s := m.ask("kv.node0.status"))["gpu_retired"]["freed"] >= 1 and not s["gpu_retired"]["pending"] and s)
        assert deep_key not in kv["arenas"] and any(x["key"] == deep_key for x in kv["retired"]), kv["retired"]
        assert complete("other") == oracle["other"]  # the mesh serves on after the frees
    finally:
        m.stop()


def test_gpu_prepared_weights_are_kept_and_load_the_same_bytes(tiny_llama, tmp_path, monkeypatch):
    """A GGUF loaded on CUDA keeps its prepared form (the GPU allocation's bytes): the next load
    copies that file into a new allocation, byte for byte what the first load made."""
    import types

    from tiny_model import write_tiny_gguf

    from meshserve.services.model_loader import loads, prepared
    from meshserve.services.model_loader.main import ModelLoader
    from meshserve.shared.subjects import Subjects

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tiny_llama, tmp_path / "t.gguf")
    loader = ModelLoader(types.SimpleNamespace(subjects=Subjects("t")), "n0", max_models=4, device="cuda")

    def load_bytes(tier: str) -> tuple[bytes, object]:
        load = loader.open_load(str(gguf), "bfloat16")
        loader.finish_load(load)
        assert load.tier == tier and load.buffer is not None and load.buffer.is_cuda
        return loads.read_back(load.path, load.buffer), load

    first, a = load_bytes("source")
    kept = prepared.entry(gguf, "bfloat16", "cuda")
    assert kept != prepared.entry(gguf, "bfloat16", "cpu") and (kept / "weights.bin").stat().st_size == len(first)
    second, b = load_bytes("disk")
    assert second == first and (b.specs, b.config) == (a.specs, a.config)


def test_gpu_tier_load_times_of_a_random_model_and_a_gguf(tiny_llama, tmp_path, monkeypatch):
    """bench-models --tier-load-times --device cuda on a random ~100M model (bf16) and a tiny GGUF:
    each tier loads into a GPU allocation (a GGUF's disk tier is its prepared form); the times are
    printed for docs/benchmarks."""
    import json

    from tiny_model import write_tiny_gguf

    from meshserve.bench.model_loads_bench import tier_load_times, write_random_model

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    path, n = write_random_model(tmp_path / "random", "1024,2816,8", str(tiny_llama))
    big = tier_load_times(str(path), "bfloat16", 2, device="cuda")
    assert big["came_from"] == {"source": "source", "disk": "source", "host": "host"}
    gguf = tier_load_times(str(write_tiny_gguf(tiny_llama, tmp_path / "t.gguf")), "bfloat16", 1, device="cuda")
    assert gguf["came_from"] == {"source": "source", "disk": "disk", "host": "host"}
    for out in (big, gguf):
        assert out["bytes"] > 0 and all(0 < out[t]["answer_s"]["min"] <= out[t]["total_s"]["min"]
                                        for t in ("source", "disk", "host")), out
    print("GPU tier load times:", json.dumps({"random_model_parameters": n, "random": big, "gguf": gguf}))


def test_workers_run_under_a_real_mps_daemon(tmp_path, tiny_llama):
    """`meshserve up --device cuda --mps` with a model's `gpu_percent` (last in this file, and run in
    a pytest process of its own by scripts/gpu_check.sh: CUDA processes that predate the daemon are
    not its clients): NVIDIA's MPS control daemon runs while the mesh serves (a server process appears once a worker uses the GPU), the text is
    the engine's, and the daemon the mesh started is stopped with it."""
    import shutil
    import subprocess

    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control is not installed here")

    def ask(cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([control], input=cmd + "\n", capture_output=True, text=True, timeout=30)

    if ask("get_server_list").returncode == 0:
        pytest.skip("an MPS daemon already runs here: the mesh would use it and not stop it")
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- {{name: small, path: '{tiny_llama}', gpu_percent: 50}}\n")
    m = Mesh(tiny_llama, tmp_path, prefill=0, decode=1, extra=["--device", "cuda", "--mps", "--models", str(manifest)])
    try:
        m.wait_ready(timeout=120)
        r = httpx.post(m.url + "/v1/completions", timeout=120, json={
            "model": "small", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        servers = ask("get_server_list")
        assert servers.returncode == 0 and servers.stdout.split(), (servers.stdout, servers.stderr)
    finally:
        m.stop()
    assert ask("get_server_list").returncode != 0, "the daemon the mesh started still runs"
    # The oracle only now: this process's own CUDA context, made while the daemon ran, would not be
    # an MPS client (scripts/gpu_check.sh runs this test in a pytest process of its own).
    assert r.json()["choices"][0]["text"] == expected(LLM(str(tiny_llama), "float32", device="cuda"), PROMPTS[1], 6)
