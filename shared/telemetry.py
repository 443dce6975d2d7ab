"""OpenTelemetry tracing for every service, switched on only by the standard OTEL_* variables.

A request crosses several processes (gateway -> scheduler -> prefill -> decode), so its spans are
linked by a W3C traceparent carried in NATS headers and in GenerateRequest.trace: `inject()` writes
one, `span(..., carrier=...)` continues it.

    OTEL_TRACES_EXPORTER=otlp      OTLP over HTTP (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT), batched
    OTEL_TRACES_EXPORTER=console   each span printed to stdout as it ends
    OTEL_TRACES_EXPORTER=none      off (also when unset, or OTEL_SDK_DISABLED=true)
    MESHSERVE_TRACE_FILE=/path     each span appended to /path as one JSON line (tests)

Off is the default and must cost nothing on the token path: the OpenTelemetry packages are not
even imported, `span()` hands back one shared no-op object and `inject()` returns at once.
"""

from __future__ import annotations

import logging
import os
import time
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_provider = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer = None
_propagator = None  # TraceContextTextMapPropagator
_otel_context = None  # the opentelemetry.context module


class _NoopSpan:
    """Stands in for both the context manager and the span when tracing is off: one shared
    instance, no state, so nesting and concurrent use are free."""

    __slots__ = ()

    def __enter__(self) -> "_NoopSpan":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: dict[str, Any] | None = None, timestamp: int | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException, attributes: dict[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        pass

    def set_status(self, *args, **kwargs) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def end(self, end_time: int | None = None) -> None:
        pass


NOOP_SPAN = _NoopSpan()


def enabled() -> bool:
    return _tracer is not None


def init_tracing(service_name: str) -> None:
    """Turns tracing on for this process when the environment asks for it; a no-op otherwise,
    and on a second call (the global tracer provider can be set only once)."""
    global _provider, _tracer, _propagator, _otel_context
    exporters = _requested_exporters()
    if not exporters:
        return
    with _lock:
        if _tracer is not None:
            return
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        for kind in exporters:
            provider.add_span_processor(_processor(kind))
        trace.set_tracer_provider(provider)
        _provider = provider
        _propagator = TraceContextTextMapPropagator()
        _otel_context = otel_context
        _tracer = provider.get_tracer("meshserve")
        log.info("tracing on for %s: %s", service_name, ", ".join(exporters))


def _requested_exporters() -> list[str]:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    kinds = []
    for kind in os.environ.get("OTEL_TRACES_EXPORTER", "").split(","):
        kind = kind.strip().lower()
        if kind in ("otlp", "console") and kind not in kinds:
            kinds.append(kind)
        elif kind not in ("", "none"):
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); ignored", kind)
    if os.environ.get("MESHSERVE_TRACE_FILE"):
        kinds.append("file")
    return kinds


def _processor(kind: str):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if kind == "otlp":
        # Reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter())
    if kind == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    return SimpleSpanProcessor(_JsonLinesExporter(os.environ["MESHSERVE_TRACE_FILE"]))


def span(name: str, carrier: dict[str, str] | None = None, **attributes: Any):
    """A span around a block, yielding the span. Its parent is the traceparent in `carrier`
    (NATS headers, GenerateRequest.trace) when that has one, else the current span."""
    if _tracer is None:
        return NOOP_SPAN
    return _recording_span(name, carrier, attributes)


def _recording_span(name: str, carrier: dict[str, str] | None, attributes: dict[str, Any]):
    ctx = _propagator.extract(carrier, context=_otel_context.get_current()) if carrier else None
    # None is not a valid OTel attribute value; callers pass optional fields as they are.
    attrs = {k: v for k, v in attributes.items() if v is not None}
    return _tracer.start_as_current_span(name, context=ctx, attributes=attrs or None)


def record(name: str, carrier: dict[str, str] | None, start: float, end: float | None = None,
           **attributes: Any) -> None:
    """A span for an interval that is over (or ends now), timed by time.time() stamps: for work
    that spans many engine steps (queue wait, prefill, decode), where no block encloses it."""
    if _tracer is None:
        return
    ctx = _propagator.extract(carrier, context=_otel_context.get_current()) if carrier else None
    attrs = {k: v for k, v in attributes.items() if v is not None}
    sp = _tracer.start_span(name, context=ctx, attributes=attrs or None, start_time=int(start * 1e9))
    sp.end(end_time=int((end if end is not None else time.time()) * 1e9))


def start(name: str, carrier: dict[str, str] | None = None, **attributes: Any):
    """A span to end later with `.end()` (the gateway's request span lives across awaits)."""
    if _tracer is None:
        return NOOP_SPAN
    ctx = _propagator.extract(carrier, context=_otel_context.get_current()) if carrier else None
    attrs = {k: v for k, v in attributes.items() if v is not None}
    return _tracer.start_span(name, context=ctx, attributes=attrs or None)


def inject_span(sp, carrier: dict[str, str] | None = None) -> dict[str, str]:
    """The traceparent naming `sp` (rather than the current span)."""
    if carrier is None:
        carrier = {}
    if _tracer is not None:
        from opentelemetry import trace as _trace
        _propagator.inject(carrier, context=_trace.set_span_in_context(sp))
    return carrier


def inject(carrier: dict[str, str] | None = None) -> dict[str, str]:
    """The current span as a W3C traceparent, added to `carrier` (or a new dict)."""
    if carrier is None:
        carrier = {}
    if _tracer is not None:
        _propagator.inject(carrier)
    return carrier


def extract(carrier: dict[str, str] | None):
    """The OTel context a carrier names (for `opentelemetry.context.attach`), or None when
    tracing is off or the carrier is empty."""
    if _tracer is None or not carrier:
        return None
    return _propagator.extract(carrier, context=_otel_context.get_current())


def shutdown() -> None:
    """Flushes spans still queued (the OTLP batch) and turns tracing off; services call it on exit."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush()
        provider.shutdown()


class _JsonLinesExporter:  # a SpanExporter by duck typing: subclassing would import the SDK when off
    """Appends each finished span as one JSON line. One os.write per line on an O_APPEND fd keeps
    lines whole when several processes write the same file at once (a buffered file could split
    a line across two writes and interleave it with another process's)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans) -> Any:
        import orjson
        from opentelemetry.sdk.trace.export import SpanExportResult

        for s in spans:
            parent = s.parent
            line = orjson.dumps({
                "name": s.name,
                "trace_id": f"{s.context.trace_id:032x}",
                "span_id": f"{s.context.span_id:016x}",
                "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
                "service": s.resource.attributes.get("service.name"),
                "start": s.start_time,  # Unix nanoseconds
                "end": s.end_time,
                "attributes": dict(s.attributes or {}),
            }) + b"\n"
            while line:  # a short write (disk full, a signal) is the only reason to loop
                line = line[os.write(self._fd, line):]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
