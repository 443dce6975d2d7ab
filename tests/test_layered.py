"""Layered loading (docs/models.md): a worker computes a prompt's first layers while the model-loader
still writes the later ones, and its greedy tokens equal those of a model loaded whole.

The loader is slowed per part by MESHSERVE_LOADER_PART_DELAY_S (test and bench only), so the
overlap really happens: in process (a model over a load being written in a thread) and through a
real mesh (one worker switching to a cold model with layered loading on, and to one with it off).
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from mesh_util import Mesh
from openai import OpenAI
from tiny_model import make_tiny_llama

from meshserve.services.model_loader import loads
from meshserve.shared import shm
from meshserve.shared.model.layer_gate import FAILED, LayerGate, LoadFailed, num_parts, open_gate, part_of

PROMPT = "The quick brown fox"
TOKENS = 6
LAYERS = 4


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny model with four layers (six parts to load)."""
    return make_tiny_llama(tmp_path_factory.mktemp("deep"), num_hidden_layers=LAYERS, seed=21)


@pytest.fixture(scope="module")
def expected(deep):
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    llm = LLM(str(deep), "float32")
    return llm.tokenizer.encode(PROMPT), llm.engine.generate([llm.tokenizer.encode(PROMPT)],
                                                             SamplingParams(max_tokens=TOKENS, temperature=0))[0]


def _weights(load: loads.Load) -> dict:
    buf = shm.map_bytes(load.path)
    return {s.name: shm.view(buf, s.offset, s.dtype, s.shape) for s in load.specs}


def test_parts_cover_every_byte_in_forward_order(deep, tmp_path, monkeypatch):
    import torch

    from meshserve.shared.model.llama import fuse_hf_weights
    from meshserve.shared.models_repo import load_model_files

    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    load = loads.open_source(str(deep), "float32", None, "w-source", "cpu")
    load.run()
    assert [part_of(s.name, LAYERS) for s in load.specs] == sorted(part_of(s.name, LAYERS) for s in load.specs)
    assert {part_of(s.name, LAYERS) for s in load.specs} == set(range(num_parts(LAYERS)))  # untied: a head part
    cfg, sd, _ = load_model_files(deep)
    whole = fuse_hf_weights(cfg, sd, torch.float32)
    got = _weights(load)
    assert set(got) == set(whole) and all(torch.equal(got[k], whole[k]) for k in whole)
    data = open(load.path, "rb").read()
    # the host and disk tiers copy part by part too: the same bytes
    host = loads.open_host("w-host", data, load.specs, load.config)
    host.run()
    (tmp_path / "kept.bin").write_bytes(data)
    disk = loads.open_prepared("w-disk", tmp_path / "kept.bin", load.specs, load.config, "test")
    disk.run()
    assert open(host.path, "rb").read() == data == open(disk.path, "rb").read()


def test_a_model_on_a_layered_load_waits_per_layer_and_gives_the_same_tokens(deep, expected, tmp_path, monkeypatch):
    from meshserve.shared.engine.llm_engine import LLMEngine
    from meshserve.shared.engine.sequence import SamplingParams
    from meshserve.shared.model.config import ModelConfig
    from meshserve.shared.model.llama import LlamaModel

    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    monkeypatch.setenv(loads.PART_DELAY_ENV, "0.1")
    load = loads.open_source(str(deep), "float32", None, "w-layered", "cpu")
    load.layered()
    gate = open_gate(load.ready_path, LAYERS)
    assert gate is not None and gate.ready() == 0
    engine = LLMEngine(LlamaModel(ModelConfig(**load.config), _weights(load), gate=gate), eos_token_ids=[2])
    writer = threading.Thread(target=load.run)
    writer.start()
    try:
        ids, want = expected
        got = engine.generate([ids], SamplingParams(max_tokens=TOKENS, temperature=0))[0]
    finally:
        writer.join()
    assert got == want
    assert gate.done and gate.waited_s > 0.3 and engine.model.gate is None  # it waited for parts, then dropped it


def test_a_failed_or_finished_load_seen_by_the_gate(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    path = shm.create("w.ready", 8)
    word = np.memmap(path, dtype=np.int64, mode="r+", shape=(1,))
    gate = LayerGate(str(path), num_parts(2))
    word[0] = 2
    gate.wait(1)  # parts 0 and 1 are in
    assert not gate.done
    word[0] = FAILED
    with pytest.raises(LoadFailed, match="failed to load"):
        gate.wait(2)
    word[0] = num_parts(2)
    assert open_gate(str(path), 2) is None  # complete by the time a worker opens it: no gate at all


# -- through the mesh


@pytest.fixture(scope="module")
def mesh(deep, tmp_path_factory):
    import shutil

    tmp = tmp_path_factory.mktemp("layered-mesh")
    # the same weights under two paths: two models to the loader, one loaded layered, one whole
    layered = shutil.copytree(deep, tmp / "layered")
    whole = shutil.copytree(deep, tmp / "whole")
    first = shutil.copytree(deep, tmp / "first")
    manifest = tmp / "models.yaml"
    manifest.write_text(f"- {{name: first, path: '{first}'}}\n"
                        f"- {{name: layered, path: '{layered}', layered_loading: true}}\n"
                        f"- {{name: whole, path: '{whole}', layered_loading: false}}\n")
    m = Mesh(first, tmp, prefill=0, decode=1, extra=["--models", str(manifest), "--no-prewarm"],
             env={loads.PART_DELAY_ENV: "0.4", "MESHSERVE_CACHE": str(tmp / "cache")})
    with m:
        yield m


def _complete(m: Mesh, model: str) -> str:
    client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0).choices[0].text


def test_layered_loading_through_the_mesh_gives_the_tokens_of_loading_first(mesh, deep):
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    want = LLM(str(deep), "float32").generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0))[0].text
    layered = _complete(mesh, "layered")
    whole = _complete(mesh, "whole")
    assert layered == whole == want
    switches = {s["to"]: s for s in mesh.ask("scheduler.status")["recent_model_switches"]}
    loaded = {m["name"]: m for m in mesh.ask("models.node0.status")["models"]}
    took = {n: loaded[n]["load_s"]["source"] for n in ("layered", "whole")}
    # six parts at 0.4 s: each load took over 2 s; the worker switched to the layered model long before
    # its load ended (it then computed while the parts came), and to the other one only after it
    assert min(took.values()) > 2.0, took
    assert switches["layered"]["ok"] and switches["layered"]["seconds"] < took["layered"] - 1.0, (switches, took)
    assert switches["whole"]["ok"] and switches["whole"]["seconds"] >= took["whole"], (switches, took)
    assert httpx.get(mesh.url + "/health", timeout=10).status_code == 200


def test_a_loader_stopped_mid_load_stops_writing_and_leaves_no_files(deep, tmp_path):
    """SIGTERM to a model-loader whose layered preload is still being written (5 s a part, six
    parts): it stops at the next part instead of writing the rest, and removes the load's files."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mesh_util import free_port

    from meshserve.cli.launcher import nats_server_binary

    port, shm_dir, ready = free_port(), tmp_path / "shm", tmp_path / "ready"
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "loader.log"
    loader = subprocess.Popen(
        [sys.executable, "-m", "meshserve.cli.main", "serve", "model-loader", "--nats-url", f"nats://127.0.0.1:{port}",
         "--namespace", "stoploader", "--model", str(deep), "--dtype", "float32", "--node-id", "n0", "--preload"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "MESHSERVE_SHM_DIR": str(shm_dir), "MESHSERVE_READY_FILE": str(ready),
             "MESHSERVE_CACHE": str(tmp_path / "cache"), loads.PART_DELAY_ENV: "5"})
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():  # preloaded: answered once the buffer existed, parts still coming
            assert loader.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert any(shm_dir.iterdir()) and "layered load" in log.read_text()
        t0 = time.monotonic()
        loader.send_signal(signal.SIGTERM)
        assert loader.wait(30) == 0, log.read_text()
        took = time.monotonic() - t0
        assert took < 12, f"{took:.1f}s: it wrote the remaining parts (5 s each) before it stopped"
        assert not list(shm_dir.iterdir()), "the load's files were left behind"
    finally:
        if loader.poll() is None:
            loader.kill()
        server.terminate()
        server.wait(10)


# -- the benchmark's load times (bench-models --tier-load-times), on tiny models


def test_tier_load_times_of_a_written_random_model_and_a_gguf(tiny_llama, tmp_path, monkeypatch):
    from tiny_model import write_tiny_gguf

    from meshserve.bench.model_loads_bench import tier_load_times, write_random_model

    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    path, n = write_random_model(tmp_path / "random", "64,128,2", str(tiny_llama))
    vocab = 384
    assert n == 2 * vocab * 64 + 64 + 2 * (64 * 64 * 2 + 64 * 64 * 2 + 3 * 64 * 128 + 2 * 64)
    hf = tier_load_times(str(path), "float32", 2)
    assert hf["came_from"] == {"source": "source", "disk": "disk", "host": "host"}
    gguf = tier_load_times(str(write_tiny_gguf(tiny_llama, tmp_path / "t.gguf")), "float32", 1)
    assert gguf["came_from"] == {"source": "source", "disk": "disk", "host": "host"}
    for out in (hf, gguf):
        assert out["bytes"] > 0 and all(0 < out[t]["answer_s"]["min"] <= out[t]["total_s"]["min"]
                                        for t in ("source", "disk", "host")), out
    assert not list((tmp_path / "shm").iterdir())  # every buffer it made is gone again


def test_cold_ttft_benchmark_times_a_load_and_a_loaded_prompt_without_prefix_hits(tiny_llama, tmp_path):
    """bench-models --cold-ttft on a tiny model, one round: each run's first request switched the
    worker to the cold model, from its files in a fresh cache (source) and from the prepared form an
    earlier run kept (disk); its load time is reported, and the second request computed a prompt of
    its own (it shared no block with the first: the prefix cache saved it nothing)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "cold.json"
    subprocess.run([sys.executable, "-m", "meshserve.cli.main", "bench-models", "--cold-ttft", "--cold-model",
                    str(tiny_llama), "--model", str(tiny_llama), "--dtype", "float32", "--cold-prompt-tokens", "40",
                    "--cold-repeat", "1", "--quiet", "--out", str(out)],
                   check=True, timeout=300, stdout=subprocess.DEVNULL,
                   env={**os.environ, "MESHSERVE_SHM_DIR": str(tmp_path / "shm")})
    res = json.loads(out.read_text())["cold_ttft"]
    for tier in ("source", "disk"):
        for mode in ("layered", "whole"):
            (run,) = res[tier][mode]["runs"]
            assert run["switch"]["ok"] and run["switch"]["to"] == "cold" and run["switch"]["tier"] == tier, run
            assert run["load_s"][tier] > 0 and 0 < run["loaded_ttft_s"] and 0 < run["cold_ttft_s"], run
            assert run["cached_tokens"] == [0, 0, 0, 0] and len(run["loaded_ttfts_s"]) == 3, run
            assert res[tier][mode]["cold_ttft_s"] == run["cold_ttft_s"]
        assert res[tier]["layered_over_whole"] == res[tier]["layered"]["cold_ttft_s"] / res[tier]["whole"]["cold_ttft_s"]
