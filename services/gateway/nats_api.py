"""The OpenAI API over NATS request/reply, for clients inside the mesh (see docs/nats-api.md).

Same bodies and responses as HTTP, framed as messages: a non-streaming request gets one reply; a
streaming one gets one message per chunk on its reply subject, then b"[DONE]". There is no status
line, so an error is the OpenAI error JSON, with its HTTP status in the `Meshserve-Status` header
(and `Retry-After` where HTTP has one). With a tenants file, a request carries its API key in an
`Authorization: Bearer <key>` header, as on HTTP. A reply larger than the server's max_payload is
refused with a 400 `response_too_large` naming the limit (a streamed answer fits: one chunk a message).
Gateways subscribe in one queue group, so each request is served by exactly one of them.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import orjson

from meshserve.shared.openai_protocol import OpenAIError

from .auth import AUTH_HEADER
from .handler import Gateway, Generation, Kind
from .streams import confirm_subscriptions

log = logging.getLogger(__name__)

QUEUE_GROUP = "gateway"
DONE = b"[DONE]"
STATUS_HEADER = "Meshserve-Status"
RESPONSE_TOO_LARGE = "response_too_large"  # the error code of a reply over the server's max_payload


class NatsAPI:
    def __init__(self, gw: Gateway):
        self.gw = gw
        self._subs = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        nc, s = self.gw.bus.nc, self.gw.bus.subjects
        for subject, kind in ((s.completions, "completions"), (s.chat_completions, "chat")):
            self._subs.append(await nc.subscribe(subject, queue=QUEUE_GROUP, cb=self._callback(kind)))
        await confirm_subscriptions(nc)

    async def stop_accepting(self) -> None:
        """Leaves the queue group so other gateways get the new requests; in-flight ones go on."""
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def stop(self, grace: float = 30.0) -> None:
        """Waits up to `grace` seconds for in-flight requests, then cancels the rest."""
        await self.stop_accepting()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)

    def _callback(self, kind: Kind):
        async def on_message(msg):
            # A task per request: the subscription's callbacks run one at a time.
            task = asyncio.get_running_loop().create_task(self._serve(kind, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return on_message

    async def _serve(self, kind: Kind, msg) -> None:
        if not msg.reply:
            log.warning("ignoring a request on %s without a reply subject", msg.subject)
            return
        streaming = False
        gen: Generation | None = None
        try:
            try:
                body, bad_body = self.gw.decode_body(msg.data), None
            except OpenAIError as e:
                body, bad_body = None, e
            streaming = isinstance(body, dict) and body.get("stream") is True
            tenant = self.gw.authenticate(_header(msg, AUTH_HEADER))  # first, as on HTTP
            if bad_body is not None:
                raise bad_body
            gen = await self.gw.submit(kind, body, tenant)
            if not gen.stream:
                await self._send(msg.reply, await gen.body())
                return
            async for chunk in gen.chunks():
                await self._send(msg.reply, chunk, chunk=True)
        except OpenAIError as e:
            await self._send_error(msg.reply, e)
        except asyncio.CancelledError:
            await self._send_error(msg.reply, OpenAIError("the gateway is shutting down", 503, type="server_error"))
            raise
        except Exception:  # noqa: BLE001
            log.exception("NATS API request on %s failed", msg.subject)
            await self._send_error(msg.reply, OpenAIError("internal server error", 500, type="server_error"))
        finally:
            if gen is not None:
                gen.close()
            if streaming:
                await self._publish(msg.reply, DONE)

    async def _send(self, reply: str, body: dict, chunk: bool = False) -> None:
        data = orjson.dumps(body)
        if len(data) > self.gw.bus.max_payload:
            raise response_too_large(len(data), self.gw.bus.max_payload, chunk)
        await self._publish(reply, data)

    async def _send_error(self, reply: str, e: OpenAIError) -> None:
        await self._publish(reply, orjson.dumps(e.body()), {STATUS_HEADER: str(e.status_code), **e.headers})

    async def _publish(self, reply: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            await self.gw.bus.nc.publish(reply, data, headers=headers)
        except Exception as e:  # noqa: BLE001 - the connection is going away; nothing to tell anyone
            log.warning("could not reply on %s: %s", reply, e)


def response_too_large(size: int, limit: int, chunk: bool) -> OpenAIError:
    """A reply NATS would not carry: the client's request asked for more than one message holds.
    Not split: a client that wants a large answer streams it (each chunk is a message of its own)."""
    what, fix = (("a chunk of the stream", "ask for fewer logprobs") if chunk else
                 ("the response", 'send it with "stream": true (each chunk is a message of its own), '
                                  "or ask for fewer tokens, choices or logprobs"))
    return OpenAIError(f"{what} ({size} bytes) exceeds the NATS server's max_payload ({limit} bytes): {fix}",
                       400, code=RESPONSE_TOO_LARGE)


def _header(msg, name: str) -> str | None:
    """A NATS message header, its name matched without regard to case (HTTP's rule)."""
    headers = msg.headers or {}
    if name in headers:
        return headers[name]
    return next((v for k, v in headers.items() if k.lower() == name.lower()), None)
