"""Many models on one mesh (docs/models.md): the manifest, the loader's tiers, models loaded on demand
by a worker switching model, and a model that cannot load failing alone.

The mesh test runs one `meshserve up` (real nats-server, real processes) with one worker and three
tiny random models of one KV shape (different weights and MLP widths) plus a broken one, under a
mapped-weights budget that holds two models and a host tier that holds one.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from mesh_util import Mesh
from openai import OpenAI
from tiny_model import make_tiny_llama

from meshserve.services.model_loader.tiers import Entry, Tiers
from meshserve.shared.manifest import Manifest, ManifestError, load_manifest

PROMPT = "The quick brown fox"
TOKENS = 6


# -- the manifest


def test_manifest_parses_and_refuses_what_it_does_not_know(tmp_path, tiny_llama):
    f = tmp_path / "models.yaml"
    f.write_text(f"- name: a\n  path: {tiny_llama}\n  aliases: [first]\n  pinned: true\n  version: 2\n"
                 f"- {{name: b, path: {tiny_llama}, dtype: float32, memory_quota_gb: 0.5}}\n")
    m = load_manifest(f)
    assert m.names == ["a", "b"] and m.get("first").name == "a" and m.get(None).name == "a"
    assert m.models[0].pinned and m.models[0].version == "2" and m.models[1].memory_quota_gb == 0.5
    assert Manifest.single("x").models[0].name == "x"
    for text, words in ((f"- {{name: a, path: {tiny_llama}, compute_share: 3}}", "compute_share: unknown key"),
                        (f"- {{name: a, path: {tiny_llama}}}\n- {{name: a, path: {tiny_llama}}}", "given twice"),
                        ("- {name: a, path: no-such-model}", "unknown model"),
                        ("[]", "at least 1"), ("name: a", "expected a list")):
        f.write_text(text)
        with pytest.raises(ManifestError, match=words):
            load_manifest(f)


def test_cli_refuses_a_bad_manifest_in_one_line(tmp_path):
    import subprocess
    import sys

    f = tmp_path / "m.yaml"
    f.write_text("- {name: a, path: nowhere-model, pinned: maybe}\n")
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "up", "--models", str(f)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "--models" in r.stderr and "pinned" in r.stderr and "Traceback" not in r.stderr


# -- the loader's tiers (pure bookkeeping)


def _mapped(t: Tiers, name: str, nbytes: int, worker: str | None = None, pinned: bool = False) -> Entry:
    e = t.entry((name, "float32", None), name)
    e.pinned = pinned
    if worker:
        t.use(worker, e)
    t.mapped(e, type("D", (), {"tier": "source", "load_s": 0.1})(), nbytes)
    for victim, to in t.evictions():
        t.moved(victim, to)
    return e


def test_tiers_evict_least_recently_used_never_pinned_or_in_use():
    t = Tiers(weights_budget=200, host_budget=100, max_mapped=8)
    a = _mapped(t, "a", 100, pinned=True)
    b = _mapped(t, "b", 100, worker="w")
    c = _mapped(t, "c", 100, worker="w")  # w moves off b: b is the LRU one not pinned
    assert (a.tier, b.tier, c.tier) == ("mapped", "host", "mapped")
    d = _mapped(t, "d", 100, worker="w")  # c goes to host, b (older) from host to disk
    assert (a.tier, b.tier, c.tier, d.tier) == ("mapped", "disk", "host", "mapped")
    e = _mapped(t, "e", 100, worker="v")  # d is in use, a pinned: over budget rather than evict them
    assert (a.tier, d.tier, e.tier) == ("mapped", "mapped", "mapped") and t.over_budget == 1
    assert t.status()["models"][0]["loads"] == {"source": 1}


# -- the mesh


def _manifest(path: Path, models: dict[str, Path], pinned: str) -> Path:
    lines = [f"- {{name: {n}, path: '{p}', pinned: {'true' if n == pinned else 'false'}}}" for n, p in models.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {name: make_tiny_llama(root / name, seed=seed, intermediate_size=width)
           for name, seed, width in (("alpha", 11, 128), ("beta", 12, 96), ("gamma", 13, 160))}
    broken = make_tiny_llama(root / "broken", seed=14)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return out, broken


@pytest.fixture(scope="module")
def oracle(models):
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    good, _ = models
    return {n: LLM(str(p), "float32").generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0))[0].text
            for n, p in good.items()}


@pytest.fixture(scope="module")
def mesh(models, tmp_path_factory):
    good, broken = models
    tmp = tmp_path_factory.mktemp("mesh")
    size = max(os.path.getsize(p / "model.safetensors") for p in good.values())
    manifest = _manifest(tmp / "models.yaml", {**good, "broken": broken}, pinned="alpha")
    gb = 1 << 30
    m = Mesh(good["alpha"], tmp, prefill=0, decode=1, extra=[
        "--models", str(manifest), "--weights-memory-gb", f"{2.5 * size / gb:.9f}",
        "--host-cache-gb", f"{1.5 * size / gb:.9f}"],
        env={"MESHSERVE_CACHE": str(tmp / "cache")})
    with m:
        m.manifest = manifest
        yield m


def _states(m: Mesh) -> dict[str, dict]:
    return {x["id"]: x for x in httpx.get(m.url + "/v1/models", timeout=10).json()["data"]}


def _complete(m: Mesh, model: str) -> str:
    client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0).choices[0].text


def _wait_state(m: Mesh, model: str, state: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:  # the loaders' tiers reach the scheduler's status within a second
        st = _states(m)[model]
        if st["state"] == state or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def test_models_load_on_demand_with_lru_eviction_and_pinning(mesh, oracle):
    st = _states(mesh)
    assert list(st) == ["alpha", "beta", "gamma", "broken"]
    assert st["alpha"]["state"] == "mapped" and st["alpha"]["pinned"] and st["alpha"]["workers"] == 1
    assert st["beta"]["state"] == st["gamma"]["state"] == "disk"
    # The one worker switches model for each: each output is that model's alone.
    for name in ("beta", "gamma"):
        assert _complete(mesh, name) == oracle[name], name
    # Three models, room for two mapped: beta (least recently used, not pinned) went to the host tier.
    assert _wait_state(mesh, "beta", "host")["state"] == "host"
    assert _states(mesh)["alpha"]["state"] == "mapped"  # pinned: never evicted
    assert _complete(mesh, "beta") == oracle["beta"]  # back on demand, from host memory
    beta = _wait_state(mesh, "beta", "mapped")
    assert beta["state"] == "mapped" and set(beta["load_times_s"]) == {"source", "host"}, beta
    assert _wait_state(mesh, "gamma", "host")["state"] == "host"
    assert _states(mesh)["alpha"]["state"] == "mapped"
    # All three at once: each waits in its model's queue while the worker takes them in turn.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = dict(zip(oracle, pool.map(lambda n: _complete(mesh, n), oracle)))
    assert got == oracle
    status = mesh.ask("scheduler.status")
    assert status["model_switches"] >= 5 and all(s["ok"] for s in status["recent_model_switches"])
    loader = mesh.ask("models.node0.status")
    assert next(x for x in loader["models"] if x["name"] == "alpha")["evictions"] == 0


def test_a_model_that_cannot_load_fails_alone(mesh, oracle):
    with pytest.raises(openai.APIStatusError) as e:
        _complete(mesh, "broken")
    assert e.value.status_code == 503
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert "'broken' is unavailable: loading it failed" in message and "SafetensorError" in message, message
    st = _states(mesh)["broken"]
    assert st["state"] == "failed" and "SafetensorError" in st["error"]
    assert _complete(mesh, "alpha") == oracle["alpha"]  # the others keep serving
    with pytest.raises(openai.APIStatusError) as again:  # within the retry window: refused at once, same reason
        _complete(mesh, "broken")
    assert again.value.status_code == 503
    with pytest.raises(openai.NotFoundError):
        _complete(mesh, "no-such-model")


def test_reload_removes_a_model(mesh, models, oracle):
    good, _ = models
    _manifest(mesh.manifest, {"alpha": good["alpha"], "beta": good["beta"]}, pinned="alpha")
    r = httpx.post(mesh.url + "/admin/models/reload", timeout=30)
    assert r.status_code == 200 and r.json()["scheduler"]["removed"] == ["gamma", "broken"], r.text
    assert list(_states(mesh)) == ["alpha", "beta"]
    with pytest.raises(openai.NotFoundError):
        _complete(mesh, "gamma")
    assert _complete(mesh, "beta") == oracle["beta"]
    mesh.manifest.write_text("- {name: alpha, path: nowhere-at-all}\n")
    bad = httpx.post(mesh.url + "/admin/models/reload", timeout=30)
    assert bad.status_code == 400 and "nowhere-at-all" in bad.json()["error"]["message"]
    assert list(_states(mesh)) == ["alpha", "beta"]  # the old manifest stays
