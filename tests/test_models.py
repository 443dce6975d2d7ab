"""Many models on one mesh (docs/models.md): the manifest, the loader's tiers, models loaded on demand
by a worker switching model, and a model that cannot load failing alone.

The mesh test runs one `meshserve up` (real nats-server, real processes) with one worker and three
tiny random models of one KV shape (different weights and MLP widths) plus a broken one, under a
mapped-weights budget that holds two models and a host tier that holds one.
"""

from __future__ import annotations

import concurrent.futures
import json
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
    f.write_text(f"- {{name: c, version: a, path: {tiny_llama}, share: 25}}\n"
                 f"- {{name: c, version: b, path: {tiny_llama}, share: 75}}\n")
    c = load_manifest(f)
    assert c.ids == ["c@a", "c@b"] and c.names == ["c"] and c.get("c@b").version == "b"
    assert [c.pick("c", u).version for u in (0.0, 0.24, 0.25, 0.99)] == ["a", "a", "b", "b"]
    f.write_text(f"- {{name: a, path: {tiny_llama}, speculative: {{method: draft, model: ./d, "
                 f"num_speculative_tokens: 2}}}}\n- {{name: b, path: {tiny_llama}, speculative: false, "
                 f"reasoning_parser: deepseek_r1, tool_call_parser: pythonic}}\n")
    (tmp_path / "d").mkdir()
    s = load_manifest(f)
    assert s.models[0].speculative.model == str(tmp_path / "d") and s.models[1].speculative is False
    assert s.models[0].reasoning_parser is None and s.models[1].reasoning_parser == "deepseek_r1"
    assert s.models[1].tool_call_parser == "pythonic"
    assert s.models[0].speculative.model_dump(exclude_none=True) == {"method": "draft", "model": str(tmp_path / "d"),
                                                                     "num_speculative_tokens": 2}
    for text, words in ((f"- {{name: a, path: {tiny_llama}, compute_share: 3}}", "compute_share: unknown key"),
                        (f"- {{name: a, path: {tiny_llama}}}\n- {{name: a, path: {tiny_llama}}}", "listed 2 times"),
                        (f"- {{name: a, path: {tiny_llama}, aliases: [b]}}\n- {{name: b, path: {tiny_llama}}}",
                         "'b' is given twice"),
                        ("- {name: a, path: no-such-model}", "unknown model"),
                        ("[]", "at least 1"), ("name: a", "expected a list"),
                        (f"- {{name: c, version: a, path: {tiny_llama}, share: 20}}\n"
                         f"- {{name: c, version: b, path: {tiny_llama}, share: 20}}", "sum to 40"),
                        (f"- {{name: c, path: {tiny_llama}}}\n- {{name: c, version: b, path: {tiny_llama}, share: 20}}",
                         "each need a `version` and a `share`"),
                        (f"- {{name: a, path: {tiny_llama}, speculative: {{method: draft}}}}", "draft needs a `model`"),
                        (f"- {{name: a, path: {tiny_llama}, speculative: {{method: ngram, k: 3}}}}", "k: unknown key"),
                        (f"- {{name: a, path: {tiny_llama}, speculative: {{method: draft, model: nope}}}}",
                         "unknown model"),
                        (f"- {{name: a, path: {tiny_llama}, reasoning_parser: granite}}", "reasoning_parser"),
                        (f"- {{name: a, path: {tiny_llama}, tool_call_parser: granite}}", "tool_call_parser")):
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


def _mapped(t: Tiers, name: str, nbytes: int, worker: str | None = None, pinned: bool = False,
            beside: bool = False) -> Entry:
    e = t.entry((name, "float32", None), name)
    e.pinned = pinned
    if worker:
        t.use(worker, e, beside=beside)
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


def test_a_draft_mapped_beside_a_model_is_in_use_until_the_workers_next_model():
    """A speculative worker maps its draft beside its model (`LoadRequest.beside`): neither is
    evicted while it runs on them; its next model's load releases both."""
    t = Tiers(weights_budget=200, host_budget=0, max_mapped=8)
    target = _mapped(t, "target", 100, worker="w")
    draft = _mapped(t, "draft", 50, worker="w", beside=True)
    other = _mapped(t, "other", 100, worker="v")  # over budget: nothing of w's may go
    assert (target.tier, draft.tier, other.tier) == ("mapped", "mapped", "mapped") and t.over_budget == 1
    assert target.users == {"w"} and draft.users == {"w"}
    _mapped(t, "next", 10, worker="w")  # w switches: its model and its draft are free to go
    assert not target.users and not draft.users
    assert (target.tier, draft.tier) == ("disk", "mapped")  # the least recently used went; the rest fits


# -- the mesh


def _manifest(path: Path, models: dict[str, Path], pinned: str, canary: dict[str, tuple[Path, float]] = None,
              extra: dict[str, str] | None = None) -> Path:
    """extra: more keys of a model's entry, `key: value` text."""
    lines = [f"- {{name: {n}, path: '{p}', pinned: {'true' if n == pinned else 'false'}"
             f"{', ' + extra[n] if extra and n in extra else ''}}}" for n, p in models.items()]
    lines += [f"- {{name: canary, version: '{v}', path: '{p}', share: {share}}}" for v, (p, share) in (canary or {}).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _canary(models, v1: float) -> dict[str, tuple[Path, float]]:
    copies = models[2]
    return {"1": (copies["1"], v1), "2": (copies["2"], 100 - v1)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {name: make_tiny_llama(root / name, seed=seed, intermediate_size=width, max_position_embeddings=context)
           for name, seed, width, context in (("alpha", 11, 128, 256), ("beta", 12, 96, 256), ("gamma", 13, 160, 192))}
    broken = make_tiny_llama(root / "broken", seed=14)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    import shutil

    # the canary's versions: beta's and gamma's weights under other paths (other models to the loader)
    canary = {v: Path(shutil.copytree(out[src], root / f"canary-{v}", copy_function=os.link))
              for v, src in (("1", "beta"), ("2", "gamma"))}
    return out, broken, canary


@pytest.fixture(scope="module")
def oracle(models):
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    good = models[0]
    return {n: LLM(str(p), "float32").generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0))[0].text
            for n, p in good.items()}


@pytest.fixture(scope="module")
def mesh(models, tmp_path_factory):
    good, broken, _ = models
    tmp = tmp_path_factory.mktemp("mesh")
    size = max(os.path.getsize(p / "model.safetensors") for p in good.values())
    manifest = _manifest(tmp / "models.yaml", {**good, "broken": broken}, pinned="alpha", canary=_canary(models, 100),
                         extra={"gamma": "tool_call_parser: llama3_json"})
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
    assert list(st) == ["alpha", "beta", "gamma", "broken", "canary"]
    assert st["alpha"]["state"] == "mapped" and st["alpha"]["pinned"] and st["alpha"]["workers"] == 1
    assert st["beta"]["state"] == st["gamma"]["state"] == "disk"
    one = httpx.get(mesh.url + "/v1/models/canary", timeout=10).json()  # retrieve: the same card
    assert one["id"] == "canary" and [v["version"] for v in one["versions"]] == ["1", "2"]
    # The one worker switches model for each: each output is that model's alone.
    for name in ("beta", "gamma"):
        assert _complete(mesh, name) == oracle[name], name
    # Three models, room for two mapped: beta (least recently used, not pinned) went to the host tier.
    assert _wait_state(mesh, "beta", "host")["state"] == "host"
    # Its shared file lost its name, and the worker, on gamma now, no longer maps it: the memory is back.
    maps = Path(f"/proc/{mesh.service_pid('decode')}/maps").read_text()
    assert "(deleted)" not in "".join(line for line in maps.splitlines() if "-weights-" in line), maps
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


def test_each_model_is_served_with_its_own_context(mesh):
    """The gateway knows each model's context (its config's): a chat without max_tokens may fill it,
    and a request beyond it is refused there, before any worker switches to the model."""
    st = _states(mesh)
    assert st["alpha"]["max_model_len"] == 256 and st["gamma"]["max_model_len"] == 192
    assert httpx.post(mesh.url + "/tokenize", json={"model": "gamma", "prompt": PROMPT}).json()["max_model_len"] == 192
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 192 tokens"):
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=190)
    r = client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": PROMPT}],
                                       extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == 192 and r.choices[0].finish_reason == "length", r.usage
    assert len(client.completions.create(model="alpha", prompt=PROMPT, max_tokens=200, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text) > 0
    # each request's series carry the model it ran on
    text = httpx.get(mesh.url + "/metrics", timeout=10).text
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("meshserve:")}
    assert series['meshserve:generation_tokens_total{model_name="gamma"}'] >= r.usage.completion_tokens
    assert series['meshserve:e2e_request_latency_seconds_count{model_name="gamma"}'] >= 1
    assert series['meshserve:request_success_total{finished_reason="length",model_name="alpha"}'] >= 1


def _series(m: Mesh) -> dict[str, float]:
    text = httpx.get(m.url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("meshserve:")}


def test_metrics_count_each_model_apart(mesh, oracle):
    """The scheduler's numbers are per served model: a worker counts towards the model it serves
    now, and its counters stay with the model they counted when it switches to another."""
    queries = 'meshserve:prefix_cache_queries{{model_name="{}"}}'.format

    def after(model: str, before: float) -> dict[str, float]:
        deadline = time.monotonic() + 10
        while (s := _series(mesh)).get(queries(model), 0) <= before and time.monotonic() < deadline:
            time.sleep(0.1)  # the counters come with the workers' heartbeats
        return s

    start = _series(mesh)
    assert _complete(mesh, "gamma") == oracle["gamma"]
    on_gamma = after("gamma", start.get(queries("gamma"), 0))
    assert on_gamma[queries("gamma")] > start.get(queries("gamma"), 0), on_gamma
    assert _complete(mesh, "beta") == oracle["beta"]  # the one worker switches to beta
    on_beta = after("beta", on_gamma.get(queries("beta"), 0))
    assert on_beta[queries("beta")] > on_gamma.get(queries("beta"), 0), on_beta
    assert on_beta[queries("gamma")] == on_gamma[queries("gamma")]  # gamma's count stayed gamma's
    for name in ("alpha", "beta", "gamma", "broken", "canary"):  # every model of the manifest has its gauges
        assert f'meshserve:num_requests_running{{model_name="{name}"}}' in on_beta, name
        assert f'meshserve:kv_cache_usage_perc{{model_name="{name}"}}' in on_beta, name
    assert on_beta['meshserve:kv_cache_usage_perc{model_name="gamma"}'] == 0  # no worker holds gamma's KV
    status = mesh.ask("scheduler.status")
    assert status["prefix_queries"] == sum(m["prefix_queries"] for m in status["by_model"].values())


def test_each_model_reads_tool_calls_its_own_way(mesh):
    """A manifest entry's `tool_call_parser`: gamma's (llama3_json) reads an answer that is a JSON
    call as a call, whole and streamed; alpha's (hermes, the default) leaves the same answer as
    content. The answer is forced by a regex, the random models having no calls of their own."""
    cards = _states(mesh)
    assert (cards["gamma"]["tool_call_parser"], cards["alpha"]["tool_call_parser"]) == ("llama3_json", "hermes")
    assert cards["gamma"]["reasoning_parser"] is None
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    body = dict(messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=40, temperature=0,
                extra_body={"guided_regex": r'\{"name": "weather", "parameters": \{"city": "Paris"\}\}'})
    r = client.chat.completions.create(model="gamma", **body).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == \
        [("weather", {"city": "Paris"})]
    calls, content = [], ""
    for chunk in client.chat.completions.create(model="gamma", stream=True, **body):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += [c.function.name for c in ch.delta.tool_calls or []]
    assert calls == ["weather"] and content == ""
    r = client.chat.completions.create(model="alpha", **body).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert r.message.content == '{"name": "weather", "parameters": {"city": "Paris"}}'


def _canary_call(m: Mesh) -> tuple[str | None, str]:
    r = httpx.post(m.url + "/v1/completions", json={"model": "canary", "prompt": PROMPT, "max_tokens": TOKENS,
                                                    "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "canary"
    return r.headers.get("meshserve-model-version"), r.json()["choices"][0]["text"]


def _reload(m: Mesh) -> dict:
    r = httpx.post(m.url + "/admin/models/reload", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_canary_versions_follow_their_shares(mesh, models, oracle):
    good, broken, _ = models
    assert _canary_call(mesh) == ("1", oracle["beta"])  # share 100/0: version 1, beta's weights
    card = _states(mesh)["canary"]
    assert [(v["version"], v["share"]) for v in card["versions"]] == [("1", 100), ("2", 0)]
    _manifest(mesh.manifest, {**good, "broken": broken}, pinned="alpha", canary=_canary(models, 0))
    _reload(mesh)
    assert _canary_call(mesh) == ("2", oracle["gamma"])  # moved to 0/100: at once
    _manifest(mesh.manifest, {**good, "broken": broken}, pinned="alpha", canary=_canary(models, 50))
    _reload(mesh)
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        got = list(pool.map(lambda _: _canary_call(mesh), range(20)))
    assert {v for v, _ in got} == {"1", "2"}  # both (all one version: probability 2 in a million)
    assert all(text == oracle["beta" if v == "1" else "gamma"] for v, text in got)
    assert httpx.post(mesh.url + "/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 1},
                      timeout=60).headers.get("meshserve-model-version") is None  # no version: no header


def test_canary_rollback_under_load_loses_no_request(mesh, models, oracle):
    """A 50/50 canary under load is rolled back to 100/0 while requests of both versions are in
    flight: every request completes with its version's text (those already running finish on the
    version they started on), and once the reload is answered every new one goes to version 1."""
    good, broken, _ = models
    _manifest(mesh.manifest, {**good, "broken": broken}, pinned="alpha", canary=_canary(models, 50))
    _reload(mesh)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_canary_call, mesh) for _ in range(40)]
        deadline = time.monotonic() + 120
        while sum(f.done() for f in futures) < 8:  # the load is under way: roll back now
            assert time.monotonic() < deadline and not any(f.done() and f.exception() for f in futures)
            time.sleep(0.05)
        _manifest(mesh.manifest, {**good, "broken": broken}, pinned="alpha", canary=_canary(models, 100))
        in_flight = sum(not f.done() for f in futures)  # sent or queued when the rollback is asked for
        _reload(mesh)
        got = [f.result(timeout=120) for f in futures]
    assert in_flight > 0, "the rollback came after the load"
    assert {v for v, _ in got} <= {"1", "2"} and len(got) == 40
    assert all(text == oracle["beta" if v == "1" else "gamma"] for v, text in got)
    assert all(v == "1" for v, _ in (_canary_call(mesh) for _ in range(6)))


def test_reload_removes_a_model(mesh, models, oracle):
    good = models[0]
    _manifest(mesh.manifest, {"alpha": good["alpha"], "beta": good["beta"]}, pinned="alpha")
    r = httpx.post(mesh.url + "/admin/models/reload", timeout=30)
    assert r.status_code == 200 and r.json()["scheduler"]["removed"] == ["gamma", "broken", "canary@1", "canary@2"], \
        r.text
    assert list(_states(mesh)) == ["alpha", "beta"]
    with pytest.raises(openai.NotFoundError):
        _complete(mesh, "gamma")
    # The worker left on a removed model moves to a listed one; the loader then unloads the removed ones.
    deadline = time.monotonic() + 20
    while {x["name"] for x in mesh.ask("models.node0.status")["models"]} - {"alpha", "beta"}:
        assert time.monotonic() < deadline, mesh.ask("models.node0.status")
        time.sleep(0.2)
    assert _complete(mesh, "beta") == oracle["beta"]
    mesh.manifest.write_text("- {name: alpha, path: nowhere-at-all}\n")
    bad = httpx.post(mesh.url + "/admin/models/reload", timeout=30)
    assert bad.status_code == 400 and "nowhere-at-all" in bad.json()["error"]["message"]
    assert list(_states(mesh)) == ["alpha", "beta"]  # the old manifest stays
