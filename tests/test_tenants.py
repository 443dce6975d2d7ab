"""The tenants file, API keys, the class rule and the scheduler's admission (quotas, queue bounds),
without a mesh: shared/tenants.py, services/scheduler/admission.py, services/gateway/auth.py.
The mesh end to end is in test_tenants_mesh.py."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from meshserve.services.gateway.auth import Auth, bearer
from meshserve.services.scheduler.admission import SETTLE_GRACE, Admission, queue_bound, waiting_by_class
from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.schemas import GenerateRequest, Sampling
from meshserve.shared.tenants import (ClassNotAllowed, KeyRing, QueueLimit, TenantsFile, TenantsFileError,
                                      load_tenants, request_class)

ISSUE_EXAMPLE = """\
tenants:
  - name: acme
    api_keys: ["sk-acme-1", "sha256:{digest}"]
    default_priority: normal
    max_priority: interactive
    max_concurrent_requests: 8
    tokens_per_minute: 200000
queues:            # optional; per class
  interactive: {{max_waiting: 64}}
  normal: {{max_waiting: 256}}
  background: {{max_waiting: 4096}}
"""


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(**tenant) -> TenantsFile:
    return TenantsFile.model_validate({"tenants": [{"name": "t", "api_keys": ["k"], **tenant}]})


def test_the_issues_example_file(tmp_path):
    f = tmp_path / "tenants.yaml"
    f.write_text(ISSUE_EXAMPLE.format(digest=sha("sk-acme-2")))
    cfg = load_tenants(f)
    acme = cfg.tenants[0]
    assert (acme.name, acme.default_priority, acme.max_priority) == ("acme", "normal", "interactive")
    assert (acme.max_concurrent_requests, acme.tokens_per_minute) == (8, 200000)
    assert {c: q.max_waiting for c, q in cfg.queues.items()} == {"interactive": 64, "normal": 256, "background": 4096}
    auth = Auth(cfg)
    assert auth.tenant("Bearer sk-acme-1").name == "acme"
    assert auth.tenant("bearer  sk-acme-2 ").name == "acme"  # the stored digest's key
    assert "sk-acme-1" not in repr(cfg)  # keys stay out of logs


@pytest.mark.parametrize("text,says", [
    ("tenants: []", "tenants: List should have at least 1 item"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    colour: red", "tenants.0.colour: Extra inputs are not permitted"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    max_priority: urgent", "tenants.0.max_priority"),
    ("tenants:\n  - name: a\n    api_keys: [k]\n    default_priority: interactive\n    max_priority: normal",
     "default_priority 'interactive' is above max_priority 'normal'"),
    ("tenants:\n  - {name: a, api_keys: [k]}\n  - {name: a, api_keys: [j]}", "tenant names must be unique"),
    ("tenants:\n  - {name: a, api_keys: [k]}\n  - {name: b, api_keys: ['sha256:" + sha("k") + "']}",
     "one API key belongs to two tenants: a and b"),
    ("tenants:\n  - {name: a, api_keys: ['sha256:abc']}", "64 hex digits"),
    ("tenants:\n  - {name: a, api_keys: [k], max_concurrent_requests: 0}", "max_concurrent_requests"),
    ("tenants:\n  - {name: a, api_keys: [k]}\nqueues: {urgent: {max_waiting: 1}}", "queues.urgent"),
    ("tenants: [", "is not valid YAML"),
    ("- a\n- b", "expected a mapping"),
])
def test_bad_files_say_why_in_one_line(tmp_path, text, says):
    f = tmp_path / "t.yaml"
    f.write_text(text)
    with pytest.raises(TenantsFileError) as e:
        load_tenants(f)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_bad_file_stops_the_commands_with_exit_2(tmp_path, capsys):
    from meshserve.cli.main import main

    f = tmp_path / "t.yaml"
    f.write_text("tenants:\n  - {name: a, api_keys: [k], max_priority: urgent}\n")
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "up", "--tenants", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshserve up: error: --tenants: ") and "max_priority" in lines[0]
    for role in ("gateway", "scheduler"):
        assert main(["serve", role, "--tenants", str(f)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"meshserve serve {role}: error: --tenants: "), err


def test_keys_plain_and_hashed():
    ring = KeyRing([("plain", "a"), ("sha256:" + sha("hashed"), "b")])
    assert ring.lookup("plain") == "a" and ring.lookup("hashed") == "b"
    assert ring.lookup("sha256:" + sha("hashed")) is None  # the digest is not itself a key
    assert ring.lookup("plai") is None and ring.lookup("") is None and ring.lookup(None) is None
    assert bearer("Bearer x") == "x" and bearer("Basic x") is None
    assert bearer("Bearer ") is None and bearer(None) is None


def test_401_without_or_with_a_wrong_key_and_metrics_rules():
    auth = Auth(config())
    for header in (None, "", "Bearer", "Bearer nope", "k"):
        with pytest.raises(OpenAIError) as e:
            auth.tenant(header)
        assert (e.value.status_code, e.value.code) == (401, "invalid_api_key")
    auth.check_metrics("Bearer k")  # no metrics_api_keys: any tenant's key
    only = Auth(TenantsFile.model_validate({"tenants": [{"name": "t", "api_keys": ["k"]}],
                                            "metrics_api_keys": ["scrape"]}))
    only.check_metrics("Bearer scrape")
    for header in (None, "Bearer k"):
        with pytest.raises(OpenAIError) as e:
            only.check_metrics(header)
        assert e.value.status_code == 401
    Auth(TenantsFile.model_validate({"tenants": [{"name": "t", "api_keys": ["k"]}],
                                     "metrics_api_keys": []})).check_metrics(None)  # []: open
    assert Auth(None).tenant(None) is None  # no file: open


def test_the_class_rule():
    t = config(default_priority="background", max_priority="normal").tenants[0]
    assert request_class(None, None) == "normal"
    assert request_class(None, t) == "background"
    assert request_class("normal", t) == "normal" and request_class("background", None) == "background"
    with pytest.raises(ClassNotAllowed):
        request_class("interactive", t)
    with pytest.raises(ValueError):
        request_class("urgent", t)
    with pytest.raises(OpenAIError) as e:
        Auth.request_class("interactive", t)
    assert (e.value.status_code, e.value.param, e.value.code) == (403, "priority", "priority_not_allowed")
    with pytest.raises(OpenAIError) as e:
        Auth.request_class(["x"], t)
    assert e.value.status_code == 400


# -- admission at the scheduler


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def request(rid: str, prompt: int = 10, max_tokens: int = 20, tenant: str | None = "t",
            priority: str = "normal") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=[1] * prompt,
                           sampling=Sampling(max_tokens=max_tokens), priority=priority, stream_subject="s",
                           arrival_time=0.0, tenant=tenant)


def no_wait():
    return {}


def test_concurrency_limit_resubmission_and_release():
    adm = Admission(config(max_concurrent_requests=2), Clock())
    assert adm.admit(request("a"), no_wait) is None and adm.admit(request("b"), no_wait) is None
    r = adm.admit(request("c"), no_wait)
    assert (r.status_code, r.error_type, r.error_code, r.retry_after) == (429, "requests", "rate_limit_exceeded", 1.0)
    assert adm.admit(request("a"), no_wait) is None  # a re-submission (its worker died) was admitted already
    adm.settle("a", 5)
    assert adm.admit(request("c"), no_wait) is None
    assert adm.status()["tenants"]["t"]["in_flight"] == 2


def test_tokens_per_minute_reserves_then_charges_what_was_used():
    clock = Clock()
    adm = Admission(config(tokens_per_minute=60), clock)  # refills 1 token per second
    assert adm.admit(request("a", prompt=10, max_tokens=30), no_wait) is None  # reserves 40 of 60
    r = adm.admit(request("b", prompt=10, max_tokens=20), no_wait)  # needs 30, has 20
    assert (r.status_code, r.error_type, r.error_code, r.retry_after) == (429, "tokens", "rate_limit_exceeded", 10)
    adm.settle("a", 5)  # used 15: 25 back, 45 in the bucket
    assert adm.status()["tenants"]["t"]["tokens_available"] == 45
    assert adm.admit(request("b", prompt=10, max_tokens=20), no_wait) is None  # 15 left
    clock.t += 30  # +30, back to 45
    assert adm.status()["tenants"]["t"]["tokens_available"] == 45
    # A reservation is at most a full bucket, so it can run; what it really used is charged.
    clock.t += 100
    assert adm.admit(request("big", prompt=10, max_tokens=200), no_wait) is None  # reserves 60
    adm.settle("big", 200)  # used 210: the bucket owes 150
    assert adm.status()["tenants"]["t"]["tokens_available"] == -150
    r = adm.admit(request("c", prompt=5, max_tokens=5), no_wait)
    assert r.status_code == 429 and r.retry_after == 160


def test_requests_without_a_known_tenant_are_refused_and_no_file_admits_all():
    adm = Admission(config(), Clock())
    for tenant in (None, "other"):
        r = adm.admit(request("a", tenant=tenant), no_wait)
        assert (r.status_code, r.error_code) == (401, "invalid_api_key")
    open_ = Admission(None, Clock())
    assert open_.admit(request("a", tenant=None), no_wait) is None and not open_.admitted


def test_sweep_releases_what_no_usage_settled():
    clock = Clock()
    adm = Admission(config(max_concurrent_requests=1), clock)
    adm.admit(request("a"), no_wait)
    adm.sweep(lambda rid: True)
    clock.t += SETTLE_GRACE * 2
    adm.sweep(lambda rid: True)  # still tracked by the scheduler: kept however long it runs
    assert "a" in adm.admitted
    adm.sweep(lambda rid: False)
    clock.t += SETTLE_GRACE - 1
    adm.sweep(lambda rid: False)
    assert "a" in adm.admitted
    clock.t += 2
    adm.sweep(lambda rid: False)
    assert "a" not in adm.admitted and adm.admit(request("b"), no_wait) is None


def test_waiting_by_class_and_the_queue_bound():
    # Two seats: of interactive, background, background, normal the best two run and both background
    # ones wait. A heartbeat that reports more waiting (short of KV blocks) counts as more; a worker
    # of unknown seats counts what its heartbeat says.
    w = waiting_by_class([(["interactive", "background", "background", "normal"], 2, {"background": 1}),
                          (["normal"], 4, {"normal": 3}), (["background"] * 5, 0, {})])
    assert w == {"interactive": 0, "normal": 3, "background": 2}
    queues = {"normal": QueueLimit(max_waiting=3)}
    r = queue_bound("normal", w, queues)
    assert (r.status_code, r.error_code, r.retry_after) == (503, "queue_full", 1.0) and "max_waiting 3" in r.error
    assert queue_bound("normal", {**w, "normal": 2}, queues) is None
    assert queue_bound("background", w, queues) is None  # no bound for that class
    cfg = TenantsFile.model_validate({"tenants": [{"name": "t", "api_keys": ["k"]}],
                                      "queues": {"interactive": {"max_waiting": 0}}})
    adm = Admission(cfg, Clock())
    asked = []
    r = adm.admit(request("a", priority="interactive"), lambda: asked.append(1) or {"interactive": 0})
    assert r.status_code == 503 and asked  # max_waiting 0: never wait
    assert adm.admit(request("b", priority="normal"), lambda: pytest.fail("no bound: not asked")) is None


def test_the_docs_example_is_a_valid_file(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "tenants.md").read_text()
    block = doc.split("## The file", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    f = tmp_path / "t.yaml"
    f.write_text(block)
    cfg = load_tenants(f)
    assert [t.name for t in cfg.tenants] == ["acme", "nightly-jobs"] and cfg.metrics_api_keys == ["sk-prometheus"]
