"""Prewarm (docs/models.md): models their recent request rates predict are brought up a tier before
they are asked for. The policy (services/scheduler/prewarm.py) is a pure function, checked by example
and with hypothesis; then once through a real mesh: a hot model the LRU evicted comes back to the
mapped tier before its next request, in place of a colder one.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mesh_util import Mesh
from openai import OpenAI

from meshserve.services.scheduler.models import pick_worker
from meshserve.services.scheduler.prewarm import MARGIN, MIN_RATE, Move, Rates, Resident, plan, residents

GB = 1 << 30


def test_rates_decay_with_their_half_life():
    r = Rates(half_life_s=10)
    for t in range(5):
        r.hit("a", now=100.0 + t)
    r.hit("b", now=104.0)
    assert r.rate("a", now=104.0) > 4 * r.rate("b", now=104.0) * 0.8
    assert r.rate("a", now=114.0) == pytest.approx(r.rate("a", now=104.0) / 2)
    assert r.rate("never", now=104.0) == 0.0


def test_plan_by_example():
    m = lambda name, tier, **kw: Resident(name, tier, kw.pop("nbytes", 100), **kw)  # noqa: E731
    # room in the host tier: the hot model on disk goes there; one move per tier per round
    assert plan({"a": 1.0, "b": 0.5}, [m("a", "disk"), m("b", "disk")], 100, 300, 4) == [Move("a", "host")]
    # no host tier: straight to mapped
    assert plan({"a": 1.0}, [m("a", "disk")], 100, 0, 4) == [Move("a", "mapped")]
    # full: it displaces the coldest resident only past the margin, never a pinned or in-use one
    full = [m("hot", "host"), m("cold", "mapped"), m("pin", "mapped", pinned=True), m("busy", "mapped", in_use=True)]
    assert plan({"hot": 1.0, "cold": 0.1}, full, 300, 100, 4) == [Move("hot", "mapped", ("cold",))]
    assert plan({"hot": 1.0, "cold": 0.9}, full, 300, 100, 4) == []
    assert plan({"hot": 1.0, "cold": 0.1}, [x for x in full if x.name != "cold"], 200, 100, 4) == []
    # --max-models counts too; a rate below MIN_RATE moves nothing
    assert plan({"a": 1.0}, [m("a", "host"), m("x", "mapped", in_use=True)], None, 100, 1) == []
    assert plan({"a": MIN_RATE / 2}, [m("a", "disk")], 100, 300, 4) == []
    # a model never loaded counts as large as the largest known: here it does not fit beside b
    assert plan({"a": 1.0}, [m("a", "disk", nbytes=0), m("b", "host", nbytes=250)], None, 300, 4) == [
        Move("a", "host", ("b",))]
    status = {"models": [{"name": "a", "tier": "host", "bytes": 7, "pinned": False, "users": ["w"]}]}
    assert residents(status, ["a", "b"]) == [Resident("a", "host", 7, False, True), Resident("b", "disk")]


tiers = st.sampled_from(["mapped", "host", "disk", "loading", "failed"])
model = st.builds(lambda i, t, n, p, u: Resident(f"m{i}", t, n, p, u), st.integers(0, 7), tiers,
                  st.integers(0, 500), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(model, max_size=8, unique_by=lambda m: m.name), st.dictionaries(st.sampled_from(
    [f"m{i}" for i in range(8)]), st.floats(0, 10)), st.one_of(st.none(), st.integers(0, 2000)),
       st.integers(0, 2000), st.integers(1, 6))
def test_plan_properties(models, rates, weights_budget, host_budget, max_mapped):
    moves = plan(rates, models, weights_budget, host_budget, max_mapped)
    by = {m.name: m for m in models}
    assert len({mv.to for mv in moves}) == len(moves)  # one move into each tier per round
    guess = max((m.nbytes for m in models), default=0)
    for mv in moves:
        m = by[mv.name]
        assert m.tier in ("host", "disk") and rates.get(m.name, 0) >= MIN_RATE
        # one tier up: host -> mapped; disk -> host, or mapped without a host tier
        assert mv.to == ("mapped" if m.tier == "host" or host_budget <= 0 else "host")
        there = [x for x in models if x.tier == mv.to and x.name not in mv.evict]
        used = sum(x.nbytes for x in there) + (m.nbytes or guess)
        budget = (weights_budget if mv.to == "mapped" else host_budget)
        assert budget is None or used <= budget  # it fits once its victim left
        if mv.to == "mapped":
            assert len(there) < max_mapped
        for v in mv.evict:  # never a pinned or in-use model, and only a much colder one
            assert not by[v].pinned and not by[v].in_use and by[v].tier == mv.to
            assert rates.get(m.name, 0) > MARGIN * rates.get(v, 0)


def test_a_switch_goes_to_the_node_that_holds_the_model_hottest():
    from meshserve.services.scheduler.routing import WorkerView
    from meshserve.shared.schemas import Heartbeat

    def w(wid, node):
        return WorkerView(Heartbeat(worker_id=wid, role="decode", model="other", node_id=node, num_running=0,
                                    num_waiting=0, free_blocks=8, held_blocks=8, total_blocks=8, block_size=16,
                                    max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, time=0.0))

    ws = [w("a", "n0"), w("b", "n1"), w("c", "n2")]
    assert pick_worker(ws, {}, {}, set(), {"n0": "disk", "n1": "mapped", "n2": "host"}).hb.worker_id == "b"
    assert pick_worker(ws, {}, {}, set(), {"n0": "disk", "n2": "host"}).hb.worker_id == "c"
    assert pick_worker(ws, {}, {}, set()).hb.worker_id == "a"


# -- through the mesh


@pytest.fixture(scope="module")
def mesh(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prewarm-mesh")
    paths = {n: shutil.copytree(tiny_llama, tmp / n, copy_function=os.link) for n in ("a", "b", "c")}
    manifest = tmp / "models.yaml"
    manifest.write_text("".join(f"- {{name: {n}, path: '{p}'}}\n" for n, p in paths.items()))
    size = os.path.getsize(tiny_llama / "model.safetensors")
    m = Mesh(paths["a"], tmp, prefill=0, decode=1, extra=[
        "--models", str(manifest), "--weights-memory-gb", f"{2.5 * size / GB:.9f}",
        "--host-cache-gb", f"{1.5 * size / GB:.9f}"], env={"MESHSERVE_CACHE": str(tmp / "cache")})
    with m:
        yield m


def _complete(m: Mesh, model: str) -> str:
    client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0).choices[0].text


def _loader(m: Mesh) -> dict[str, dict]:
    return {x["name"]: x for x in m.ask("models.node0.status")["models"]}


def test_a_hot_model_evicted_by_the_lru_comes_back_before_its_next_request(mesh):
    for _ in range(4):  # c is the hot one
        _complete(mesh, "c")
    _complete(mesh, "a")
    _complete(mesh, "b")  # room for two: c, used least recently, goes to the host tier
    want = {"model": "c", "to": "mapped", "evict": ["a"], "ok": True, "tier": "mapped"}
    deadline = time.monotonic() + 30
    while True:  # ... and, hotter than a by far, comes back in a's place without being asked for
        prewarms = mesh.ask("scheduler.status")["recent_prewarms"]
        if any(want.items() <= p.items() for p in prewarms):
            break
        assert time.monotonic() < deadline, (prewarms, _loader(mesh))
        time.sleep(0.2)
    loader = _loader(mesh)
    assert loader["c"]["tier"] == "mapped" and loader["c"]["prewarms"] >= 1 and loader["c"]["evictions"] >= 1, loader
    assert loader["a"]["tier"] in ("host", "disk") and loader["a"]["evictions"] >= 1, loader
    hits = loader["c"]["hits"]
    _complete(mesh, "c")  # the worker maps it: no load
    assert _loader(mesh)["c"]["hits"] == hits + 1 and _loader(mesh)["c"]["loads"] == loader["c"]["loads"]
