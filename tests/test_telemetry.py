"""Tracing across processes, as the services use it: each check runs in fresh interpreters, because
the global tracer provider can be set only once per process and every service is its own process."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

# Process A opens a span and prints its carrier; process B continues the trace from that carrier.
PARENT = textwrap.dedent("""
    import json
    from meshserve.shared import telemetry
    telemetry.init_tracing("proc-a")
    with telemetry.span("a.submit", request_id="r1", skipped=None):
        print(json.dumps(telemetry.inject()))
    telemetry.shutdown()
""")

CHILD = textwrap.dedent("""
    import json, sys
    from meshserve.shared import telemetry
    telemetry.init_tracing("proc-b")
    with telemetry.span("b.prefill", carrier=json.loads(sys.argv[1]), tokens=7) as s:
        s.add_event("scheduled")
        with telemetry.span("b.step"):
            pass
    telemetry.shutdown()
""")


def _env(**extra: str) -> dict[str, str]:
    """This environment without any tracing settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "MESHSERVE_TRACE_FILE"}
    env.update(extra)
    return env


def _python(code: str, *args: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _spans(path: Path) -> dict[str, dict]:
    return {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}


def test_trace_links_spans_of_two_processes_through_a_carrier(tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    env = _env(MESHSERVE_TRACE_FILE=str(trace_file))
    carrier = _python(PARENT, env=env).strip()
    assert json.loads(carrier)["traceparent"].startswith("00-")
    _python(CHILD, carrier, env=env)

    spans = _spans(trace_file)
    a, b, step = spans["a.submit"], spans["b.prefill"], spans["b.step"]
    assert a["trace_id"] == b["trace_id"] == step["trace_id"]
    assert a["parent_span_id"] is None
    assert b["parent_span_id"] == a["span_id"]
    assert step["parent_span_id"] == b["span_id"]  # no carrier: the current span is the parent
    assert (a["service"], b["service"]) == ("proc-a", "proc-b")
    assert a["attributes"] == {"request_id": "r1"}  # None-valued attributes are dropped
    assert b["attributes"] == {"tokens": 7}
    assert len(a["trace_id"]) == 32 and len(a["span_id"]) == 16
    assert a["start"] <= a["end"] <= b["start"] <= step["start"] <= step["end"] <= b["end"]


def test_processes_appending_to_one_trace_file_keep_lines_whole(tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    writer = textwrap.dedent("""
        import sys
        from meshserve.shared import telemetry
        telemetry.init_tracing(sys.argv[1])
        for i in range(300):
            with telemetry.span("s", i=i, padding="x" * 3000):
                pass
    """)
    env = _env(MESHSERVE_TRACE_FILE=str(trace_file))
    procs = [subprocess.Popen([sys.executable, "-c", writer, f"w{n}"], env=env) for n in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    for n in range(3):
        assert sorted(s["attributes"]["i"] for s in lines if s["service"] == f"w{n}") == list(range(300))


OFF_CHECK = textwrap.dedent("""
    import json, os, sys
    from meshserve.shared import telemetry
    settings = json.loads(sys.argv[1])
    for setting in settings:
        os.environ.update(setting)
        telemetry.init_tracing("svc")
        assert not telemetry.enabled(), setting
        assert telemetry.span("x") is telemetry.span("y", carrier={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is telemetry.NOOP_SPAN
        with telemetry.span("x", a=1) as s:
            s.set_attribute("k", "v"); s.add_event("e"); s.record_exception(ValueError())
        try:
            with telemetry.span("x"):
                raise KeyError("propagates")
        except KeyError:
            pass
        else:
            raise AssertionError("the no-op span swallowed an exception")
        assert telemetry.inject() == {}
        assert telemetry.inject({"k": "v"}) == {"k": "v"}
        assert telemetry.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
        telemetry.shutdown()
        for k in setting:
            del os.environ[k]
    # Off never loads OpenTelemetry at all ...
    assert not [m for m in sys.modules if m.startswith("opentelemetry")], sorted(sys.modules)
    # ... so the global provider is still the API's default proxy.
    from opentelemetry import trace
    assert type(trace.get_tracer_provider()) is trace.ProxyTracerProvider
    print("ok")
""")


def test_tracing_off_is_a_shared_noop_and_leaves_otel_untouched():
    settings = [
        {},  # nothing set
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"},
    ]
    assert _python(OFF_CHECK, json.dumps(settings), env=_env()).strip() == "ok"


def test_console_exporter_prints_each_span():
    out = _python(PARENT, env=_env(OTEL_TRACES_EXPORTER="console"))
    carrier = json.loads(out.splitlines()[0])
    printed = json.loads(out[out.index("\n") + 1:])
    assert printed["name"] == "a.submit"
    assert printed["resource"]["attributes"]["service.name"] == "proc-a"
    assert printed["context"]["trace_id"][2:] in carrier["traceparent"]


class _Collector(http.server.BaseHTTPRequestHandler):
    """A stand-in OTLP/HTTP receiver: keeps each POST's path and decoded spans."""

    received: list[tuple[str, str, list[str], str]] = []

    def do_POST(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            names = [s.name for ss in rs.scope_spans for s in ss.spans]
            self.received.append((self.path, self.headers["Content-Type"], names, service))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    _Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Collector.received
    server.shutdown()
    server.server_close()


def test_otlp_exporter_posts_to_the_configured_endpoints(collector):
    url, received = collector
    _python(PARENT, env=_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=url))
    assert received == [("/v1/traces", "application/x-protobuf", ["a.submit"], "proc-a")]

    received.clear()  # the signal-specific endpoint is used as given, and wins
    _python(PARENT, env=_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9/",
                             OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{url}/custom/traces"))
    assert received == [("/custom/traces", "application/x-protobuf", ["a.submit"], "proc-a")]
