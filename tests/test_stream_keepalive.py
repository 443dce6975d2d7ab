"""A request waiting its turn is not a lost stream: the gateway's RequestStream restarts its
no-token timeout on each `TokenChunk.queued` (sent by the scheduler for its queued requests and
by a worker for those queued or preempted in its engine), and still times out without them."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshserve.services.gateway.streams import RequestStream
from meshserve.shared.schemas import GenerateRequest, Sampling, TokenChunk

REQ = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=4),
                      stream_subject="s", arrival_time=time.time(), priority="background")


def _chunk(**kw) -> TokenChunk:
    return TokenChunk(**{"request_id": "r1", "seq": 0, "index": 0, "token_ids": [], **kw})


async def _first_chunk(keepalives: int, every: float, timeout: float) -> TokenChunk:
    stream = RequestStream(bus=None, request=REQ)

    async def feed():
        for _ in range(keepalives):
            await asyncio.sleep(every)
            stream.feed(_chunk(queued=True))
        await asyncio.sleep(every)
        stream.feed(_chunk(token_ids=[7], finished=True, finish_reason="stop"))

    task = asyncio.ensure_future(feed())
    try:
        return await stream.next(timeout)
    finally:
        task.cancel()


def test_keepalives_keep_a_queued_request_waiting_past_the_timeout():
    # 6 x 0.1 s of queueing against a 0.35 s timeout: only the keepalives let it wait.
    chunk = asyncio.run(_first_chunk(keepalives=6, every=0.1, timeout=0.35))
    assert chunk.token_ids == [7] and chunk.finished


def test_without_keepalives_the_same_wait_times_out():
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(_first_chunk(keepalives=0, every=0.7, timeout=0.35))


def test_a_stale_attempts_keepalive_does_not_count():
    async def go():
        stream = RequestStream(bus=None, request=REQ)
        stream.feed(_chunk(queued=True, attempt=5))  # not the running attempt
        return await stream.next(0.2)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(go())
