"""What every service process does around its own work: connect to the bus, set up logging and
tracing, run until SIGTERM or Ctrl-C, then clean up and drain the connection (a SIGTERM while it
is still starting cancels the start: a start that made files of its own removes them itself). With
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
        started, cleanup = await _start_unless_stopped(name, start(bus), stop)
        if started:
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


async def _start_unless_stopped(name: str, starting: Awaitable[Cleanup], stop: asyncio.Event) -> tuple[bool, Cleanup]:
    """(True, its cleanup) once the service started; (False, None) when a stop came first, which
    cancels the start: a start may wait minutes for what a stopping mesh never sends (a worker for
    the kv-pool's arena or the loader's weights), and a stop must not wait for it. A start that fails
    after the stop came (what it needed went away) is a stop too, logged with why."""
    task = asyncio.ensure_future(starting)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if task.cancelled():
        log.info("%s stopped while starting", name)
        return False, None
    e = task.exception()
    if e is not None and stop.is_set():
        log.warning("%s stopped while starting (%s: %s)", name, type(e).__name__, e)
        return False, None
    return True, task.result()
