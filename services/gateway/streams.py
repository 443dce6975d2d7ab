"""The token-stream demultiplexer: one NATS subscription per gateway, one ordered stream per request.

Every worker publishes the TokenChunks of this gateway's requests on one subject. Chunks of one
request can come from several publishers (a prefill worker then a decode worker, or a replacement
after a worker died), and NATS orders messages only per publisher, so a chunk can arrive early
(a gap: held until the missing tokens arrive) or twice (a repeat: dropped). `index` (position of
the chunk's first token in the output) is what decides, so the client sees every token once, in order.

The gateway owns its requests: when the scheduler that accepted one restarts (a new id on
`scheduler.hello`), when the bus reconnects (what the server held is lost), when a gap stays
open for GAP_TIMEOUT, or when nothing was heard of it for STALL_S (whoever holds a request
without streaming its tokens says so every KEEPALIVE_S, so silence means it was lost), it
re-submits the request as a new `attempt` with the tokens the client already has, after
aborting the old attempt on the workers; chunks of older attempts are ignored.
A recomputed greedy or seeded continuation is the same text, so the client sees no seam.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import nats.errors

from meshserve.shared.bus import Bus, PayloadTooLarge
from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.schemas import (NOT_READY, STALL_S, Abort, GenerateRequest, ServiceHello, SubmitReply,
                                      TokenChunk)

log = logging.getLogger(__name__)

GATEWAY_ID = uuid.uuid4().hex  # names this process's token subject
WORKER_LOST = "worker_lost"
MAX_RESUBMITS = 5  # a request that kills workers should not take the whole mesh down with it
SUBMIT_TIMEOUT = 5.0
GAP_TIMEOUT = 5.0  # a gap in a stream held open this long means a lost chunk: re-submit
STILL_QUEUED = object()  # what a TokenChunk.queued puts in a stream's queue
RESUBMIT_DEADLINE = 20.0  # a re-submission refused for want of a scheduler or workers retries this long


async def confirm_subscriptions(nc) -> None:
    """Returns once the server has every subscription made so far on `nc`.

    One flush is not enough: nats-py (2.16) writes the flush's PING straight to the socket while a
    SUB may still wait in its send buffer, so the PONG can come back before the SUB is read, and
    messages published meanwhile by other connections are lost. By the second PING the buffer has
    been written (the flusher was woken before the first PING went out).
    """
    await nc.flush()
    await nc.flush()


def error_type(status_code: int) -> str:
    return "invalid_request_error" if status_code < 500 else "server_error"


def mesh_failure(error: str, status: int | None = None) -> OpenAIError:
    """A chunk's error as the client sees it: its status (a request a worker refused: 400), else 503
    when the mesh lacks capacity, else 500."""
    if status is None:
        status = 503 if any(w in error.lower() for w in ("no worker", "no_worker", "unavailable", "overload")) else 500
    return OpenAIError(f"generation failed: {error}", status, type=error_type(status))


class NotSubmitted(OpenAIError):
    """A 503 for a request the scheduler certainly did not take because the mesh is not up yet
    (nobody listens on its subject, or no worker has joined): sending it again later cannot run it
    twice. Other refusals (a full queue, a tenant's limits) are plain OpenAIErrors."""

    def __init__(self, message: str):
        super().__init__(message, 503, type="server_error", code=NOT_READY)


class MaybeSubmitted(OpenAIError):
    """A 503 for a submission that went out but got no answer: the scheduler (or the nats-server)
    may have died with it in hand, or taken it and died before replying. Sent again, it must be a
    new attempt, the old one aborted (RequestStream.supersede), so it cannot run twice."""

    def __init__(self, message: str):
        super().__init__(message, 503, type="server_error")


async def submit(bus: Bus, request: GenerateRequest) -> SubmitReply:
    """Hands a request to the scheduler; raises OpenAIError when it is refused or nobody answers."""
    try:
        reply = await bus.request(bus.subjects.submit, request, SubmitReply, timeout=SUBMIT_TIMEOUT)
    except PayloadTooLarge as e:  # a prompt too long for the bus: the client's to shorten
        raise OpenAIError(f"the request is too large for the mesh's message bus: {e}", 413,
                          code="request_too_large") from None
    except nats.errors.NoRespondersError:
        raise NotSubmitted("no scheduler is available to serve the request") from None
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        raise MaybeSubmitted(f"the scheduler did not answer the submission in {SUBMIT_TIMEOUT:g} s") from None
    except nats.errors.Error as e:
        raise MaybeSubmitted(f"the mesh is unreachable: {e}") from None
    except RuntimeError as e:  # the scheduler answered with an error instead of a SubmitReply
        raise OpenAIError(f"the scheduler failed: {e}", 500, type="server_error") from None
    if not reply.ok:
        if reply.status_code == 503 and reply.error_code == NOT_READY:
            raise NotSubmitted(reply.error or "the scheduler cannot serve the request now")
        status = reply.status_code if reply.status_code >= 400 else 500
        headers = {} if reply.retry_after is None else {"Retry-After": str(max(1, math.ceil(reply.retry_after)))}
        raise OpenAIError(reply.error or "the scheduler refused the request", status,
                          type=reply.error_type or error_type(status), code=reply.error_code, headers=headers)
    return reply


class RequestStream:
    """The in-order chunks of one request. `feed` runs in the subscription callback and never
    awaits; the request's handler reads with `next`."""

    def __init__(self, bus: Bus, request: GenerateRequest):
        self.bus = bus
        self.request = request
        self.token_ids: list[int] = []  # accepted so far, in order: what the client gets
        self.workers: list[str] = []  # the workers whose tokens the client got, in turn (a handoff: two)
        self.finished = False
        self.resubmits = 0
        self.scheduler_id: str | None = None  # who accepted the current attempt (None: not yet)
        self._gap_since: float | None = None
        self._heard_at = time.monotonic()  # the last chunk (or keepalive) of the current attempt
        self._held: dict[int, TokenChunk] = {}
        self._queue: asyncio.Queue[TokenChunk | OpenAIError | object] = asyncio.Queue()
        self._lost_workers: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._resubmitting: asyncio.Task | None = None

    async def submit(self) -> None:
        """The first submission (Gateway.submit); raises OpenAIError."""
        self.scheduler_id = (await submit(self.bus, self.request)).scheduler_id

    async def next(self, timeout: float) -> TokenChunk:
        """The next in-order chunk (trimmed of repeats); raises OpenAIError when the request failed
        and TimeoutError when nothing arrived for `timeout` seconds. A gap held open for
        GAP_TIMEOUT, or STALL_S without a word of the request, re-submits it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            wait = min(deadline - loop.time(), self._heard_at + STALL_S - time.monotonic())
            if self._gap_since is not None:
                wait = min(wait, self._gap_since + GAP_TIMEOUT - loop.time())
            try:
                item = await asyncio.wait_for(self._queue.get(), max(0.0, wait))
                if item is STILL_QUEUED:  # waiting its turn, not lost: the timeout starts again
                    deadline = loop.time() + timeout
                    continue
                break
            except asyncio.TimeoutError:
                if loop.time() >= deadline:
                    raise
                if self._gap_since is not None and loop.time() >= self._gap_since + GAP_TIMEOUT:
                    self.resubmit(f"a gap at token {len(self.token_ids)} stayed open {GAP_TIMEOUT:g} s")
                elif time.monotonic() >= self._heard_at + STALL_S:
                    if self._resubmitting is not None and not self._resubmitting.done():
                        self._heard_at = time.monotonic()  # its re-submission is under way: wait for it
                    else:
                        self.resubmit(f"nothing heard of it for {STALL_S:g} s after {len(self.token_ids)} tokens")
        if isinstance(item, OpenAIError):
            raise item
        return item

    def supersede(self) -> Abort:
        """Makes the request a new attempt: the old attempt's chunks (and those of its dead
        scheduler's routing) are ignored from now on. Returns the Abort that stops the old one on
        the workers, for the caller to publish before submitting the new one."""
        old = self.request.attempt
        self.request = self.request.model_copy(update={"attempt": old + 1})
        self._held.clear()
        self._gap_since = None
        self._heard_at = time.monotonic()
        self.scheduler_id = None
        return Abort(request_id=self.request.request_id, reason="superseded", attempt=old)

    def resubmit(self, why: str) -> None:
        """A new attempt from the tokens the client has: the old one is aborted on the workers."""
        if self.finished:
            return
        abort = self.supersede()
        self.resubmits += 1
        if self.resubmits > MAX_RESUBMITS:
            self._fail(OpenAIError(f"the request was re-submitted {self.resubmits - 1} times; giving up "
                                   f"(last: {why})", 503, type="server_error"))
            return
        log.warning("request %s: %s; re-submitting after %d tokens (attempt %d)", self.request.request_id, why,
                    len(self.token_ids), self.request.attempt)
        again = self.request.model_copy(update={"output_token_ids": list(self.token_ids)})
        self._resubmitting = self._spawn(self._resubmit(again, abort))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def feed(self, chunk: TokenChunk) -> None:
        if self.finished or chunk.attempt != self.request.attempt:
            return  # over, or a superseded attempt's late chunk
        if chunk.worker_id and chunk.worker_id in self._lost_workers:
            return  # a dead (or declared dead) worker's late chunks would race its replacement's
        self._heard_at = time.monotonic()
        if chunk.queued:
            self._queue.put_nowait(STILL_QUEUED)
            return
        if chunk.error:
            if chunk.error == WORKER_LOST and not chunk.finished:
                self._worker_lost(chunk)
            else:
                self._fail(mesh_failure(chunk.error, chunk.error_status))
            return
        if chunk.index > len(self.token_ids):
            self._held[chunk.index] = chunk
            if self._gap_since is None:
                self._gap_since = asyncio.get_running_loop().time()
            return
        self._accept(chunk)
        while self._held and not self.finished:
            ready = sorted(i for i in self._held if i <= len(self.token_ids))
            if not ready:
                break
            for i in ready:
                self._accept(self._held.pop(i))
        if not self._held:
            self._gap_since = None

    def _accept(self, chunk: TokenChunk) -> None:
        """`chunk.index` <= tokens received: keep only its new tokens."""
        if self.finished:
            return
        skip = len(self.token_ids) - chunk.index
        if skip > 0:
            if skip >= len(chunk.token_ids) and not chunk.finished:
                return  # a pure repeat
            chunk = chunk.model_copy(update={
                "index": len(self.token_ids), "token_ids": chunk.token_ids[skip:],
                "logprobs": None if chunk.logprobs is None else chunk.logprobs[skip:]})
        self.token_ids += chunk.token_ids
        if chunk.worker_id and (chunk.token_ids or chunk.finished) and self.workers[-1:] != [chunk.worker_id]:
            self.workers.append(chunk.worker_id)
        if chunk.finished:
            self.finished = True
            self._held.clear()
        self._queue.put_nowait(chunk)

    def _fail(self, error: OpenAIError) -> None:
        self.finished = True
        self._held.clear()
        self._queue.put_nowait(error)

    def _worker_lost(self, chunk: TokenChunk) -> None:
        """Re-submits the request with the tokens the client already has; the new worker goes on
        from there. Held chunks came from the dead worker and are dropped: the new one may differ."""
        if chunk.worker_id:
            self._lost_workers.add(chunk.worker_id)
        self._held.clear()
        self._gap_since = None
        self.resubmits += 1
        if self.resubmits > MAX_RESUBMITS:
            self._fail(OpenAIError(f"the request lost its worker {self.resubmits} times; giving up",
                                   503, type="server_error"))
            return
        if self._resubmitting is not None and not self._resubmitting.done():
            return  # one re-submission of this attempt is under way already (it was lost twice)
        again = self.request.model_copy(update={"output_token_ids": list(self.token_ids)})
        log.warning("request %s lost worker %s after %d tokens; re-submitting", self.request.request_id,
                    chunk.worker_id or "?", len(self.token_ids))
        self._resubmitting = self._spawn(self._resubmit(again))

    async def _resubmit(self, request: GenerateRequest, abort: Abort | None = None) -> None:
        """Submits again; a 503 (no scheduler yet, no workers heard yet) is retried until
        RESUBMIT_DEADLINE, since a restart is what made this necessary."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESUBMIT_DEADLINE
        while not self.finished and request.attempt == self.request.attempt:
            try:
                if abort is not None:  # before the submission: a worker hears it first
                    await self.bus.publish(self.bus.subjects.abort, abort)
                reply = await submit(self.bus, request)
                if request.attempt == self.request.attempt:
                    self.scheduler_id = reply.scheduler_id
                return
            except (OpenAIError, nats.errors.Error) as e:
                retry = not isinstance(e, OpenAIError) or e.status_code == 503
                if not retry or loop.time() + 0.5 > deadline:
                    if not self.finished and request.attempt == self.request.attempt:
                        self._fail(e if isinstance(e, OpenAIError) else
                                   OpenAIError(f"the mesh is unreachable: {e}", 503, type="server_error"))
                    return
                await asyncio.sleep(0.5)


class TokenStreams:
    """Routes this gateway's token subject to the open RequestStreams by request_id."""

    def __init__(self, bus: Bus, gateway_id: str = GATEWAY_ID):
        self.bus = bus
        self.subject = bus.subjects.tokens(gateway_id)
        self._streams: dict[str, RequestStream] = {}
        self._sub = None
        self._hello_sub = None

    async def start(self) -> None:
        # Generous pending limits: a slow consumer here would drop tokens of every request at once.
        self._sub = await self.bus.nc.subscribe(self.subject, cb=self._on_message,
                                                pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
        self._hello_sub = await self.bus.nc.subscribe(self.bus.subjects.scheduler_hello, cb=self._on_hello)
        self.bus.on_reconnect(lambda: self.resubmit_all("the bus reconnected"))
        await confirm_subscriptions(self.bus.nc)  # before any request is submitted

    async def stop(self) -> None:
        for sub in (self._sub, self._hello_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except nats.errors.Error:
                    pass
        self._sub = self._hello_sub = None

    def resubmit_all(self, why: str, unless_accepted_by: str | None = None) -> int:
        """Re-submits every open request (but those the scheduler `unless_accepted_by` holds, and
        those whose submission is still in flight)."""
        n = 0
        for stream in list(self._streams.values()):
            if stream.finished or stream.scheduler_id is None or stream.scheduler_id == unless_accepted_by:
                continue
            stream.resubmit(why)
            n += 1
        return n

    async def _on_hello(self, msg) -> None:
        try:
            sid = ServiceHello.decode(msg.data).service_id
        except Exception:  # noqa: BLE001
            return
        n = self.resubmit_all(f"scheduler {sid[:8]} replaced the one that accepted it", unless_accepted_by=sid)
        if n:
            log.warning("a new scheduler %s: re-submitted %d open requests", sid[:8], n)

    def open(self, request: GenerateRequest) -> RequestStream:
        """Registers before the request is submitted, so its first chunk cannot be missed."""
        stream = RequestStream(self.bus, request)
        self._streams[request.request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    async def _on_message(self, msg) -> None:
        try:
            chunk = TokenChunk.decode(msg.data)
        except Exception:  # noqa: BLE001 - a bad message must not stop the subscription
            log.warning("dropping an undecodable message on %s", self.subject)
            return
        stream = self._streams.get(chunk.request_id)
        if stream is not None:
            stream.feed(chunk)
