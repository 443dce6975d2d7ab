"""What every service process does around its own work: connect to the bus, set up logging and
tracing, run until SIGTERM or Ctrl-C, then clean up and drain the connection. With
MESHSERVE_READY_FILE set, that file exists while the service is up (a container's readiness probe)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from .bus import Bus
from . import telemetry

log = logging.getLogger("meshserve.service")

Cleanup = Callable[[], Awaitable[None] | None] | None


async def run_service(name: str, args, start: Callable[[Bus], Awaitable[Cleanup]]) -> None:
    telemetry.init_tracing(name)
    ready_file = os.environ.get("MESHSERVE_READY_FILE")
    bus = await Bus.connect(args.nats_url, name=f"{name}-{os.getpid()}", namespace=args.namespace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cleanup = None
    try:
        cleanup = await start(bus)
        log.info("%s ready (pid %d)", name, os.getpid())
        if ready_file:  # what a container's readiness probe looks for (deploy/)
            Path(ready_file).write_text(f"{os.getpid()}\n")
        await stop.wait()
    finally:
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
        if cleanup is not None:
            res = cleanup()
            if asyncio.iscoroutine(res):
                await res
        await bus.close()
        telemetry.shutdown()
        log.info("%s stopped", name)
