"""Tenants through a real mesh (`meshserve up --tenants`, real nats-server, the official openai
client, a nats-py client): 401, 403, 429 (concurrency, tokens per minute) and 503 (a full class
queue) with OpenAI error bodies and Retry-After, /health open and every other endpoint behind a
key, the NATS API's Authorization header, `meshserve batch --url`, per-tenant metrics and the
request log's tenant, as `meshserve analyze` reads it. One mesh for the whole module."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import nats
import openai
import orjson
import pytest

from mesh_util import Mesh

TENANTS = """\
tenants:
  - name: acme
    api_keys: ["sk-acme", "sha256:{hashed}"]
    max_priority: interactive
  - name: lowly
    api_keys: ["sk-lowly"]
    default_priority: background
    max_priority: normal
  - name: single
    api_keys: ["sk-single"]
    max_concurrent_requests: 1
  - name: metered
    api_keys: ["sk-metered"]
    tokens_per_minute: 60
  - name: private
    api_keys: ["sk-private"]
    isolate_prefix_cache: true
queues:
  interactive: {{max_waiting: 1}}
metrics_api_keys: ["sk-scrape"]
"""
HASHED_KEY = "sk-acme-hashed"  # stored only as its sha256
PROMPT = [5, 6, 7, 8]  # token ids: a known prompt length


@pytest.fixture(scope="module")
def mesh(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    f = tmp / "tenants.yaml"
    f.write_text(TENANTS.format(hashed=hashlib.sha256(HASHED_KEY.encode()).hexdigest()))
    m = Mesh(tiny_llama, tmp, prefill=0, decode=1, extra=["--tenants", str(f), "--max-num-seqs", "1"],
             env={"MESHSERVE_REQUEST_LOG": str(tmp / "requests.jsonl")})
    m.request_log = tmp / "requests.jsonl"
    with m:
        yield m


def client(mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key=key, max_retries=0, timeout=60)


def complete(mesh, key: str, max_tokens: int = 4, **extra):
    return client(mesh, key).completions.create(model=mesh.model, prompt=PROMPT, max_tokens=max_tokens,
                                                temperature=0, extra_body={"ignore_eos": True, **extra})


def error_of(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


def test_health_is_open_and_everything_else_needs_a_key(mesh):
    health = httpx.get(mesh.url + "/health")
    assert health.status_code == 200 and "acme" not in health.text  # open, and it names no tenant
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-acme"}):
        r = httpx.get(mesh.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(mesh.url + "/v1/chat/completions", headers=headers,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 2}), ("/tokenize", {"prompt": "hi"}),
                           ("/detokenize", {"tokens": [5]})):
            r = httpx.post(mesh.url + path, headers=headers, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert httpx.get(mesh.url + "/v1/models", headers={"Authorization": "Bearer sk-acme"}).status_code == 200
    assert httpx.post(mesh.url + "/tokenize", headers={"Authorization": "Bearer sk-acme"},
                      json={"prompt": "hi"}).status_code == 200
    assert httpx.get(mesh.url + "/openapi.json").status_code == 200  # the schema names no tenant: open, as /health
    # /metrics is protected separately: only metrics_api_keys, not a tenant's key.
    assert httpx.get(mesh.url + "/metrics", headers={"Authorization": "Bearer sk-acme"}).status_code == 401
    assert httpx.get(mesh.url + "/metrics").status_code == 401
    assert httpx.get(mesh.url + "/metrics", headers={"Authorization": "Bearer sk-scrape"}).status_code == 200


def test_401_with_the_openai_client_then_a_good_key_works(mesh):
    with pytest.raises(openai.AuthenticationError) as e:
        complete(mesh, "sk-nobody")
    assert error_of(e.value)["code"] == "invalid_api_key"
    r = complete(mesh, HASHED_KEY)  # a key the file holds only as sha256:<hex>
    assert r.usage.completion_tokens == 4


def test_403_above_the_tenants_class_and_its_default_class(mesh):
    with pytest.raises(openai.PermissionDeniedError) as e:
        complete(mesh, "sk-lowly", priority="interactive")
    err = error_of(e.value)
    assert (e.value.status_code, err["param"], err["code"]) == (403, "priority", "priority_not_allowed")
    assert "normal" in err["message"]
    assert complete(mesh, "sk-lowly").usage.completion_tokens == 4  # its default: background
    assert complete(mesh, "sk-lowly", priority="normal").usage.completion_tokens == 4
    with pytest.raises(openai.PermissionDeniedError):  # vLLM's integer: below 0 is interactive
        complete(mesh, "sk-lowly", priority=-1)
    assert complete(mesh, "sk-lowly", priority=0).usage.completion_tokens == 4


def _worker_pid(mesh) -> int:
    for pid in mesh.children():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and b"decode" in cmd:
            return pid
    raise AssertionError("no decode worker found")


@contextmanager
def blocked_worker(mesh):
    """The only worker stopped (SIGSTOP): what is dispatched to it stays in flight, unserved.
    Resumed well within the scheduler's 3 s heartbeat timeout."""
    pid = _worker_pid(mesh)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_429_for_concurrency_and_503_for_a_full_class_queue(mesh):
    c_single, c_acme = client(mesh, "sk-single"), client(mesh, "sk-acme")

    def stream(c, **extra):
        return c.completions.create(model=mesh.model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True, **extra})

    with blocked_worker(mesh):
        held = stream(c_single)  # admitted: single's one concurrent request
        with pytest.raises(openai.RateLimitError) as e:
            stream(c_single)
        err = error_of(e.value)
        assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded")
        assert int(e.value.response.headers["retry-after"]) >= 1
        # One seat (--max-num-seqs 1): the first interactive request takes it, the second waits,
        # and a third finds the interactive queue full (max_waiting 1).
        first = stream(c_acme, priority="interactive")
        second = stream(c_acme, priority="interactive")
        with pytest.raises(openai.InternalServerError) as e:
            stream(c_acme, priority="interactive")
        err = error_of(e.value)
        assert (e.value.status_code, err["code"]) == (503, "queue_full"), err
        assert int(e.value.response.headers["retry-after"]) >= 1
    for s in (held, first, second):  # all served once the worker runs again
        chunks = list(s)
        assert chunks[-1].choices[0].finish_reason == "length"
    # single's slot is free again once its request ended (the gateway reports it to the scheduler)
    deadline = time.monotonic() + 10
    while mesh.ask("scheduler.status")["admission"]["tenants"]["single"]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert complete(mesh, "sk-single").usage.completion_tokens == 4


def test_a_tenant_with_one_request_is_not_held_back_by_anothers_many(mesh):
    """Fair share within a class: acme queues five requests on the one seat, then private sends one,
    lifted to acme's counter as it starts waiting; after one more of acme's, private's counter is
    the least, so it ends among the first three rather than last."""
    import threading

    ended: list[str] = []

    def stream(key: str):
        return client(mesh, key).completions.create(model=mesh.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})

    def read(name: str, s) -> None:
        assert list(s)[-1].choices[0].finish_reason == "length"
        ended.append(name)

    with blocked_worker(mesh):
        streams = [(f"acme{i}", stream("sk-acme")) for i in range(5)] + [("private", stream("sk-private"))]
    readers = [threading.Thread(target=read, args=x) for x in streams]
    for t in readers:
        t.start()
    for t in readers:
        t.join(60)
    assert len(ended) == 6 and ended.index("private") <= 2, ended


def test_429_for_tokens_per_minute_over_http_and_nats(mesh):
    # 60 tokens a minute: 4 prompt + 40 reserved (and used), then a second such request is short.
    assert complete(mesh, "sk-metered", max_tokens=40).usage.completion_tokens == 40
    with pytest.raises(openai.RateLimitError) as e:
        complete(mesh, "sk-metered", max_tokens=40)
    err = error_of(e.value)
    assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
    assert 10 <= int(e.value.response.headers["retry-after"]) <= 44, e.value.response.headers

    async def over_nats():
        nc = await nats.connect(mesh.nats_url)
        try:
            body = orjson.dumps({"prompt": PROMPT, "max_tokens": 40})
            return await nc.request(f"{mesh.namespace}.v1.completions", body, timeout=30,
                                    headers={"Authorization": "Bearer sk-metered"})
        finally:
            await nc.close()

    msg = asyncio.run(over_nats())
    assert orjson.loads(msg.data)["error"]["code"] == "rate_limit_exceeded"
    assert msg.headers["Meshserve-Status"] == "429" and int(msg.headers["Retry-After"]) >= 10


def test_nats_api_with_and_without_the_authorization_header(mesh):
    async def ask(headers):
        nc = await nats.connect(mesh.nats_url)
        try:
            body = orjson.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
            return await nc.request(f"{mesh.namespace}.v1.completions", body, timeout=30, headers=headers)
        finally:
            await nc.close()

    for headers in (None, {"Authorization": "Bearer wrong"}):
        msg = asyncio.run(ask(headers))
        assert msg.headers["Meshserve-Status"] == "401"
        assert orjson.loads(msg.data)["error"]["code"] == "invalid_api_key"
    msg = asyncio.run(ask({"Authorization": "Bearer sk-acme"}))
    assert orjson.loads(msg.data)["usage"]["completion_tokens"] == 3


def test_batch_url_runs_lines_as_background(mesh, tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "priority": "interactive"}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 7}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "batch", "-i", str(inp), "-o", str(out),
                        "--url", mesh.url, "--api-key", "sk-acme"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "3 succeeded, 1 failed" in r.stderr, r.stderr
    results = {x["custom_id"]: x for x in map(orjson.loads, out.read_bytes().splitlines())}
    assert list(results) == ["a", "b", "c", "bad"]
    for cid in "abc":
        assert results[cid]["response"]["status_code"] == 200 and results[cid]["error"] is None
        assert results[cid]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert results["bad"]["response"]["status_code"] == 400 and results["bad"]["error"]["message"]
    ids = {results[c]["response"]["body"]["id"].split("-", 1)[1]: c for c in "abc"}
    logged = {rec["id"]: rec for rec in map(orjson.loads, mesh.request_log.read_bytes().splitlines())}
    assert {ids[i]: logged[i]["class"] for i in ids} == {"a": "background", "b": "background", "c": "interactive"}
    assert {logged[i]["tenant"] for i in ids} == {"acme"}

    # Without a key every line is its own 401 result.
    from meshserve.cli.batch_remote import run_remote

    res = asyncio.run(run_remote([orjson.dumps(lines[0])], mesh.url))
    assert res[0]["response"]["status_code"] == 401 and res[0]["error"]["code"] == "invalid_api_key"


def test_a_tenant_that_isolates_its_prefix_cache_shares_no_blocks(mesh):
    """`isolate_prefix_cache`: the private tenant's prompts hit only its own cached blocks, and no
    one else's requests hit them, whatever cache_salt they send (even the tenant's own name)."""
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16 to share

    def cached(key: str, **extra) -> int:
        r = client(mesh, key).completions.create(model=mesh.model, prompt=prompt, max_tokens=2, temperature=0,
                                                 extra_body=extra)
        details = r.usage.prompt_tokens_details
        return (details.cached_tokens if details else 0) or 0

    assert cached("sk-acme") == 0
    assert cached("sk-acme") == 48  # an open tenant's blocks are shared
    assert cached("sk-private") == 0  # not acme's
    assert cached("sk-private") == 48  # its own
    for salt in ("private", "tenant:private", '["private", null]'):
        assert cached("sk-acme", cache_salt=salt) == 0, salt
    assert cached("sk-private", cache_salt="x") == 0 and cached("sk-private", cache_salt="x") == 48


def test_metrics_and_analyze_by_tenant_and_still_healthy(mesh, tmp_path):
    from meshserve.cli.main import main

    assert complete(mesh, "sk-acme").usage.completion_tokens == 4
    text = httpx.get(mesh.url + "/metrics", headers={"Authorization": "Bearer sk-scrape"}).text
    model = mesh.model

    def value(name: str, **labels) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": model, **labels}.items()))
        for line in text.splitlines():
            if line.startswith(name + "{"):
                got = ",".join(sorted(line[len(name) + 1:line.rindex("}")].split(",")))
                if got == want:
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name}{{{want}}} not in /metrics")

    assert value("meshserve:tenant_requests_total", tenant="acme") >= 5
    assert value("meshserve:tenant_generation_tokens_total", tenant="metered") == 40
    assert value("meshserve:tenant_prompt_tokens_total", tenant="metered") == len(PROMPT)
    for tenant, reason in (("", "invalid_api_key"), ("lowly", "priority_not_allowed"),
                           ("single", "max_concurrent_requests"), ("metered", "tokens_per_minute"),
                           ("acme", "queue_full")):
        assert value("meshserve:tenant_rejections_total", tenant=tenant, reason=reason) >= 1, (tenant, reason)

    assert main(["analyze", str(mesh.request_log), "--json", str(tmp_path / "a.json")]) == 0
    by = orjson.loads((tmp_path / "a.json").read_bytes())["by_tenant"]
    assert {"acme", "lowly", "single", "metered"} <= set(by)
    assert by["metered"]["errors_by_status"].get("429", 0) >= 2 and by["metered"]["output_tokens"] == 40
    assert by["lowly"]["errors_by_status"] == {"403": 2} and by["lowly"]["class"]["background"] == 1
    assert by["acme"]["errors_by_status"].get("503") == 1
    assert httpx.get(mesh.url + "/health").status_code == 200
