"""Hostile input against one real `meshserve up` with NATS authentication on (its default): the
public NATS user serves a request end to end and nothing without credentials gets in; the request
limits answer with OpenAI error bodies over HTTP and NATS; schemathesis fuzzes every route of the
gateway's /openapi.json (schema-valid and schema-breaking bodies) and hypothesis fuzzes the NATS
API. Every answer must be a 2xx, or a 4xx (or a documented 503) with an OpenAI error body: no 5xx,
no hang, and afterwards every process is the one that started (none died) and the mesh serves.

CI-sized: HTTP_EXAMPLES per HTTP operation and mode, NATS_EXAMPLES per NATS subject; generation is capped at
MAX_TOKENS tokens (the fuzzer's max_tokens would otherwise make a run minutes long). A larger run sets
MESHSERVE_FUZZ_EXAMPLES (HTTP, per operation and mode; NATS gets three times as many, or
MESHSERVE_FUZZ_NATS_EXAMPLES) and MESHSERVE_FUZZ_SEED (docs/security.md records one)."""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path

import httpx
import nats
import nats.errors
import orjson
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from openai import OpenAI

from mesh_util import Mesh
from meshserve.shared import nats_auth

schemathesis = pytest.importorskip("schemathesis")

# per operation and mode (7 routes with a body x 2 modes, 3 without)
HTTP_EXAMPLES = int(os.environ.get("MESHSERVE_FUZZ_EXAMPLES", 25))
NATS_EXAMPLES = int(os.environ.get("MESHSERVE_FUZZ_NATS_EXAMPLES", 3 * HTTP_EXAMPLES))  # per NATS API subject
SEED = os.environ.get("MESHSERVE_FUZZ_SEED")  # unset: hypothesis' derandomized (fixed) examples
MAX_TOKENS = 4
LIMITS = {"max-body-bytes": 65536, "max-messages": 8, "max-stop": 4, "max-logprobs": 5, "max-json-depth": 16}
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # printed at the end


def fuzz_settings(examples: int):
    """A fixed set of examples (derandomized), or with MESHSERVE_FUZZ_SEED the ones that seed gives."""
    s = settings(max_examples=examples, deadline=None, database=None, derandomize=SEED is None,
                 suppress_health_check=list(HealthCheck))
    return (lambda f: seed(int(SEED))(s(f))) if SEED is not None else s


@pytest.fixture(scope="module")
def mesh(tiny_llama, tmp_path_factory):
    extra = [x for k, v in LIMITS.items() for x in (f"--{k}", str(v))]
    with Mesh(tiny_llama, tmp_path_factory.mktemp("fuzz"), prefill=0, decode=1, extra=extra) as m:
        m.pids = {s: m.service_pid(s) for s in ("nats-server", "gateway", "scheduler", "kv-pool", "model-loader",
                                               "decode")}
        yield m
    print("fuzzing, status codes per target:", {k: dict(v) for k, v in COUNTS.items()})
    total = sum((c for c in COUNTS.values()), collections.Counter())
    print(f"fuzzing: {sum(total.values())} requests ({HTTP_EXAMPLES} HTTP examples per operation and mode, "
          f"{NATS_EXAMPLES} per NATS subject), status codes {dict(sorted(total.items()))}")


def check_error_body(data: bytes, status: int, where: str) -> None:
    assert 400 <= status < 500 or status == 503, f"{where}: {status} {data[:500]!r}"
    err = orjson.loads(data)["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], f"{where}: {data[:500]!r}"


def capped(body):
    """The body with generation kept short (only an int max_tokens is lowered: a bad one stays bad)."""
    if isinstance(body, dict):
        body = dict(body)
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if "max_tokens" not in body and "max_output_tokens" not in body:
            body["max_completion_tokens" if "messages" in body else "max_tokens"] = MAX_TOKENS
    return body


async def nats_call(url: str, user: str | None, subject: str, body: bytes, timeout: float = 30.0):
    """(status, messages) of a NATS API request; status from Meshserve-Status, 200 without it."""
    env = nats_auth.read_credentials(user) if user else {}
    nc = await nats.connect(url, allow_reconnect=False, **nats_auth.connect_options(env))
    try:
        inbox, got, done = nc.new_inbox(), [], asyncio.Event()

        async def on_msg(msg):
            got.append(msg)
            stream = msg.data == b"[DONE]" or len(got) == 1 and (msg.headers or {}).get("Meshserve-Status")
            if stream or not _is_stream(body):
                done.set()
        await nc.subscribe(inbox, cb=on_msg)
        await nc.publish(subject, body, reply=inbox)
        await asyncio.wait_for(done.wait(), timeout)
        return int((got[0].headers or {}).get("Meshserve-Status", 200)), got
    finally:
        await nc.close()


def _is_stream(body: bytes) -> bool:
    try:
        b = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(b, dict) and b.get("stream") is True


def test_auth_on_by_default_serves_end_to_end(mesh):
    ns, url = mesh.namespace, f"nats://{mesh.nats_address}"
    # nothing gets in without credentials
    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(nats.connect(url, allow_reconnect=False, error_cb=_ignore))
    # the public user's request over the NATS API, and an HTTP one, are served
    public = mesh.credentials / "public.env"
    status, msgs = asyncio.run(nats_call(url, public, f"{ns}.v1.completions",
                                         orjson.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0})))
    assert status == 200 and orjson.loads(msgs[0].data)["usage"]["completion_tokens"] == 3
    r = OpenAI(base_url=mesh.url + "/v1", api_key="none").completions.create(model=mesh.model, prompt="Hello",
                                                                              max_tokens=3, temperature=0)
    assert r.choices[0].text == orjson.loads(msgs[0].data)["choices"][0]["text"]
    # ...which is all it may do: the scheduler's status is not the public's to ask
    with pytest.raises(asyncio.TimeoutError):  # (the server refused the publish: a permissions violation)
        asyncio.run(nats_call(url, public, f"{ns}.scheduler.status", b"{}", timeout=1))
    # credentials travel in the environment, never on a command line
    passwords = [nats_auth.read_credentials(f)[nats_auth.ENV_PASSWORD] for f in mesh.credentials.glob("*.env")
                 if f.name != nats_auth.SERVER_ENV]  # every user's, the workers' own included
    assert len(passwords) == len(nats_auth.USERS) + 1  # (one worker: worker-0)
    for pid in [mesh.proc.pid, *mesh.children()]:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(pw in argv for pw in passwords), argv


async def _ignore(e):
    pass


@pytest.mark.parametrize("body,status,param,code", [
    ({"prompt": "x" * 70000}, 413, None, "request_too_large"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"messages": [{"role": "user", "content": "hi"}] * 9}, 400, "messages", None),
    ({"prompt": "hi", "logprobs": 6}, 400, "logprobs", None),
    ({"prompt": "hi", "guided_json": {"a": [[[[[[[[[[[[[[[[{}]]]]]]]]]]]]]]]]}}, 400, None, "json_too_deep"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, 400, "chat_template", None),
])
def test_limits_answer_with_openai_errors(mesh, body, status, param, code):
    kind = "chat/completions" if "messages" in body else "completions"
    data = orjson.dumps(body)
    r = httpx.post(f"{mesh.url}/v1/{kind}", content=data, headers={"content-type": "application/json"})
    got_nats = asyncio.run(nats_call(f"nats://{mesh.nats_address}", mesh.credentials / "public.env",
                                     f"{mesh.namespace}.v1.{kind.replace('/', '.')}", data))
    for where, (st_, raw) in (("http", (r.status_code, r.content)), ("nats", (got_nats[0], got_nats[1][0].data))):
        check_error_body(raw, st_, where)
        err = orjson.loads(raw)["error"]
        assert st_ == status and (param is None or err["param"] == param) and (code is None or err["code"] == code), \
            (where, st_, err)
    assert str(LIMITS["max-body-bytes"]) in r.json()["error"]["message"] or status != 413


def test_fuzz_http_with_schemathesis(mesh):
    schema = schemathesis.openapi.from_url(mesh.url + "/openapi.json")
    session = __import__("requests").Session()
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                       "/detokenize", "/v1/models", "/health"}
    for op in ops:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if op.method.upper() == "GET" and mode == schemathesis.GenerationMode.NEGATIVE:
                continue  # nothing to break in a request without a body

            @fuzz_settings(HTTP_EXAMPLES)
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                if op.method.upper() == "POST":
                    case.body = capped(case.body)
                r = case.call(base_url=mesh.url, session=session, timeout=60)
                COUNTS[f"{op.method.upper()} {op.path}"][r.status_code] += 1
                if r.status_code >= 300:
                    check_error_body(r.content, r.status_code, f"{op.method} {op.path} {case.body!r:.300}")
            try:
                fuzz()
            except Unsatisfiable:  # a request without parameters or body: nothing to break
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.path
    print("HTTP fuzzing, status codes per route:", {k: dict(v) for k, v in COUNTS.items() if not k.startswith("NATS")})


def _json_values():
    scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                             max_size=4), max_leaves=12)


FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "logprobs", "echo",
          "seed", "logit_bias", "response_format", "tools", "tool_choice", "priority", "stream_options", "model"]


def _bodies():
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
                                     "content": st.text(max_size=30) | _json_values()})
    fields = st.dictionaries(st.sampled_from(FIELDS), _json_values(), max_size=5)
    base = st.one_of(st.fixed_dictionaries({"prompt": st.text(max_size=30) | st.lists(st.integers(-5, 500), max_size=6)}),
                     st.fixed_dictionaries({"messages": st.lists(message, max_size=3)}))
    structured = st.tuples(base, fields).map(lambda t: {**t[0], **t[1]})
    return st.one_of(structured.map(lambda b: orjson.dumps(capped(b))), _json_values().map(orjson.dumps),
                     st.binary(max_size=40))


def test_fuzz_nats_api_with_hypothesis(mesh):
    url, public = f"nats://{mesh.nats_address}", mesh.credentials / "public.env"
    loop = asyncio.new_event_loop()
    try:
        for endpoint in ("completions", "chat.completions"):
            subject = f"{mesh.namespace}.v1.{endpoint}"

            @fuzz_settings(NATS_EXAMPLES)
            @given(body=_bodies())
            def fuzz(body):
                status, msgs = loop.run_until_complete(nats_call(url, public, subject, body))
                COUNTS[f"NATS {endpoint}"][status] += 1
                if status != 200:
                    check_error_body(msgs[0].data, status, f"{subject} {body[:300]!r}")
                elif _is_stream(body):  # an error after the stream started is a message with its status
                    assert msgs[-1].data == b"[DONE]"
                    for m in msgs:
                        if (m.headers or {}).get("Meshserve-Status"):
                            check_error_body(m.data, int(m.headers["Meshserve-Status"]), f"{subject} {body[:300]!r}")
            fuzz()
            print(f"NATS fuzzing, {endpoint}: {dict(COUNTS[f'NATS {endpoint}'])}")
    finally:
        loop.close()


def test_mesh_still_serving_after_fuzzing(mesh):
    """Runs last: nothing died (every service is the process that started) and requests are served."""
    assert {s: mesh.service_pid(s) for s in mesh.pids} == mesh.pids
    r = httpx.post(f"{mesh.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
