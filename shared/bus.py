"""NATS plumbing shared by every service: connecting, typed publish/request, trace headers.

Messages are pydantic models (shared/schemas.py) encoded with orjson. NATS gives no delivery
guarantee beyond "at most once" and no backpressure, so callers that must not lose anything
check sequence numbers and use timeouts; this module only keeps the calls short.

A reply that is an error says so in a header (ERROR_HEADER, its value the message, the payload
empty), never in the payload, so no reply is told apart by looking at its bytes.

A restarted nats-server is reconnected to without end (nats-py re-creates the subscriptions and
sends what was published meanwhile, up to its pending buffer); what the server held when it died
is lost, so a service that must know registers `on_reconnect` (the gateway re-submits its open
requests). A restart silences every peer at once, which is not their death: a service that takes
a silent peer for gone counts the silence from `heard_since`.

Credentials, the reply prefix and TLS come from the environment (shared/nats_auth.py); a message
larger than the server's max_payload is refused here at once, naming the limit, instead of being
dropped into a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import TypeVar

import nats
import nats.errors
from nats.aio.client import Client

from . import nats_auth
from .schemas import Message
from .subjects import DEFAULT_NAMESPACE, Subjects

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

DEFAULT_NATS_URL = os.environ.get("MESHSERVE_NATS_URL", "nats://127.0.0.1:4222")
ERROR_HEADER = "Meshserve-Error"
NO_RESPONDERS_WAIT_S = 0.05  # a request to a service not subscribed yet is asked again after this,
NO_RESPONDERS_MARGIN_S = 0.2  # until this long before its timeout (its caller hears "no responders" in time)


def header_value(text: str) -> str:
    """`text` as one header value: NATS headers are lines, so line breaks become spaces."""
    return " ".join(str(text).splitlines())


def reply_error(msg) -> str | None:
    """The error a reply carries (ERROR_HEADER), or None for a reply that is not one."""
    return (msg.headers or {}).get(ERROR_HEADER)


async def _on_error(e: Exception) -> None:
    if "permissions violation" in str(e).lower():  # a subject this service's user may not use: a bug or an attack
        log.error("%s", e)
    else:
        log.debug("nats: %s", e)


async def _quiet(e: Exception) -> None:
    pass


class PayloadTooLarge(ValueError):
    """A message over the server's max_payload: NATS would drop the connection's write, never deliver it."""

    def __init__(self, size: int, subject: str, limit: int):
        super().__init__(f"message of {size} bytes on {subject} exceeds the NATS server's max_payload ({limit} bytes)")
        self.size, self.limit = size, limit


async def _on_disconnect() -> None:
    log.info("nats: disconnected, reconnecting")


class Bus:
    """One service's connection to the mesh."""

    def __init__(self, nc: Client, namespace: str = DEFAULT_NAMESPACE):
        self.nc = nc
        self.subjects = Subjects(namespace)
        self.url = ""  # the NATS URL it connected to (connect sets it): names this mesh's shared files
        self.reconnect_hooks: list = []  # called (no arguments) after each reconnection
        self._up_since = time.monotonic()
        self._reconnects = 0

    def on_reconnect(self, hook) -> None:
        self.reconnect_hooks.append(hook)

    def heard_since(self) -> float:
        """Since when (time.monotonic) this connection has been up without a break; +inf while it
        is down. What a peer sent meanwhile was lost, so its silence counts from here at the
        earliest: a restarted nats-server, which silences everyone at once, is no worker's death."""
        if not self.nc.is_connected:
            return math.inf
        n = self.nc.stats["reconnects"]  # counted before the client is CONNECTED again
        if n != self._reconnects:
            self._reconnects, self._up_since = n, time.monotonic()
        return self._up_since

    def silent_for(self, last_heard: float, now: float | None = None) -> float:
        """Seconds a peer last heard at `last_heard` has been silent, this service's own time off
        the bus not counted (heard_since)."""
        now = time.monotonic() if now is None else now
        return max(0.0, now - max(last_heard, self.heard_since()))

    def _reconnected(self) -> None:
        self.heard_since()
        log.warning("nats: reconnected to %s", self.nc.connected_url and self.nc.connected_url.netloc)
        for hook in self.reconnect_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook must not stop the others
                log.exception("reconnect hook failed")

    @classmethod
    async def connect(cls, url: str = DEFAULT_NATS_URL, name: str = "meshserve",
                      namespace: str | None = None, connect_timeout: float = 30.0) -> "Bus":
        """Connects, retrying until the server is up (services may start before nats-server)."""
        deadline = asyncio.get_running_loop().time() + connect_timeout
        bus: list[Bus] = []

        async def reconnected() -> None:
            if bus:
                bus[0]._reconnected()

        options = nats_auth.connect_options()
        while True:  # a probe without reconnection first: nats-py's reconnecting connect would retry refused
            try:     # credentials (or an absent server) forever
                probe = await nats.connect(url, name=name, connect_timeout=2, allow_reconnect=False,
                                           error_cb=_quiet, **options)
                await probe.close()
                break
            except Exception as e:  # noqa: BLE001 - nats raises several kinds while the server starts
                if "authorization violation" in str(e).lower():  # wrong credentials never become right
                    raise ConnectionError(f"NATS at {url} refused the credentials of user "
                                          f"{options.get('user') or '(none given)'}: {e}") from e
                if asyncio.get_running_loop().time() > deadline:
                    raise ConnectionError(f"cannot reach NATS at {url}: {e}") from e
                await asyncio.sleep(0.2)
        nc = await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                connect_timeout=2, allow_reconnect=True, error_cb=_on_error,
                                disconnected_cb=_on_disconnect, reconnected_cb=reconnected, **options)
        bus.append(cls(nc, namespace or os.environ.get("MESHSERVE_NAMESPACE", DEFAULT_NAMESPACE)))
        bus[0].url = url
        return bus[0]

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    def check_size(self, subject: str, data: bytes) -> bytes:
        """`data`, or PayloadTooLarge when the server would refuse it."""
        if len(data) > self.nc.max_payload:
            raise PayloadTooLarge(len(data), subject, self.nc.max_payload)
        return data

    async def publish(self, subject: str, msg: Message | bytes, headers: dict[str, str] | None = None) -> None:
        data = self.check_size(subject, msg if isinstance(msg, bytes) else msg.encode())
        await self.nc.publish(subject, data, headers=headers or None)

    async def request(self, subject: str, msg: Message, reply: type[M], timeout: float = 10.0,
                      headers: dict[str, str] | None = None) -> M:
        """One request/reply. A service that is not subscribed yet (start-up order) is waited for,
        within the same timeout, instead of failing at once with "no responders"."""
        resp = await self._request(subject, msg.encode(), timeout, headers)
        error = reply_error(resp)
        if error is not None:
            raise RuntimeError(f"{subject}: {error}")
        return reply.decode(resp.data)

    async def send(self, subject: str, msg: Message, timeout: float = 3.0) -> None:
        """Publishes and waits for the receiver's acknowledgement (`ack`). NATS drops a message
        whose receiver is disconnected at that moment (a restarted nats-server, reconnecting), so a
        message that must arrive is sent this way. Raises NoRespondersError when nobody was
        subscribed within the timeout (it certainly went nowhere), TimeoutError when no
        acknowledgement came (it may have arrived)."""
        await self._request(subject, msg.encode(), timeout, None)

    async def deliver(self, subject: str, msg: Message, within: float = 30.0, timeout: float = 3.0) -> bool:
        """`send`, again until acknowledged or `within` seconds passed; for messages whose receiver
        takes a repeat as a no-op. False (and a warning) when it never was."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            try:
                await self.send(subject, msg, timeout=min(timeout, max(0.1, deadline - loop.time())))
                return True
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                if loop.time() + 0.1 >= deadline:
                    log.warning("%s: not acknowledged within %gs (%s)", subject, within, e or type(e).__name__)
                    return False
                await asyncio.sleep(0.1)

    @staticmethod
    async def ack(msg) -> None:
        """Acknowledges a message sent with `send`/`deliver` (a plain publish has no reply subject)."""
        if msg.reply:
            await msg.respond(b"")

    async def _request(self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.check_size(subject, data)
        while True:
            try:
                return await self.nc.request(subject, data, timeout=max(0.05, deadline - loop.time()),
                                             headers=headers or None)
            except nats.errors.NoRespondersError:
                if loop.time() + NO_RESPONDERS_MARGIN_S > deadline:
                    raise
                await asyncio.sleep(NO_RESPONDERS_WAIT_S)

    async def respond_error(self, msg, error: str) -> None:
        """Answers a request with an error (what `request` raises as RuntimeError on the other end)."""
        await self.nc.publish(msg.reply, b"", headers={ERROR_HEADER: header_value(error)})

    async def close(self) -> None:
        try:
            await self.nc.drain()
        except Exception:  # noqa: BLE001 - closing an already-broken connection
            pass
