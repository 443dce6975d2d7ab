"""Tracing entry points for services, tolerant of shared/telemetry.py not being importable."""

from __future__ import annotations


def init_tracing(service: str) -> None:
    try:
        from .telemetry import init_tracing as init
    except ImportError:
        return
    init(service)


def shutdown_tracing() -> None:
    try:
        from .telemetry import shutdown
    except ImportError:
        return
    shutdown()


def span(name: str, carrier: dict | None = None, **attributes):
    try:
        from .telemetry import span as real_span
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return real_span(name, carrier, **attributes)
