"""The gateway alone, against a real nats-server: validation and errors over HTTP and NATS, the
token-stream demultiplexer, and whole responses parsed by the official openai client.

The end-to-end tests here use a stand-in that answers scheduler.submit and publishes scripted
TokenChunks; that is only to test the gateway without the rest of the mesh (the real mesh has its own
end-to-end tests). The stand-in's behaviour is picked by the request's seed (see StandIn).
"""

from __future__ import annotations

import asyncio
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

import meshserve
from meshserve.services.gateway.streams import TokenStreams, confirm_subscriptions
from meshserve.shared.bus import Bus
from meshserve.shared.schemas import (Abort, GenerateRequest, Logprob, Sampling, SubmitReply, TokenChunk)
from meshserve.shared.tokenizer import Tokenizer

NATS_SERVER = Path(sys.executable).parent / "nats-server"
NS = "gwtest"
SERVED = "tiny"
SCRIPT = " The quick brown fox jumps over the lazy dog. Hello world!"
EOS = 2
# StandIn modes, chosen by the request's seed
NORMAL, SHUFFLED, LOSES_WORKER, SLOW, SILENT = None, 1, 2, 3, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def nats_url():
    port = free_port()
    proc = subprocess.Popen([str(NATS_SERVER), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    wait_for(up, 10, "nats-server")
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama)


@pytest.fixture(scope="module")
def gateway(nats_url, tiny_llama, tmp_path_factory):
    """A real gateway process; its base URL. Stopped with SIGTERM, which must exit cleanly."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.services.gateway.main", "--nats-url", nats_url, "--namespace", NS,
             "--port", str(port), "--model", str(tiny_llama), "--served-model-name", SERVED,
             "--max-model-len", "128", "--stream-timeout", "2", "--ready-timeout", "1"],
            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{base}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "the gateway")
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_path.read_text()
    assert "gateway for tiny listening on http://127.0.0.1" in log_path.read_text()


def run_async(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ------------------------------------------------------------------ errors, no mesh behind


def check_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


BAD = [
    ("/v1/completions", b"{not json", None, None),
    ("/v1/completions", b"[1, 2]", None, None),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 9}', "temperature", None),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', "top_p", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', "max_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "n": 17}', "n", None),  # more choices than MAX_N
    ("/v1/completions", b'{"max_tokens": 3}', "prompt", None),
    ("/v1/completions", b'{"prompt": [1000000]}', "prompt", None),
    ("/v1/completions", b'{"prompt": "hi", "priority": "urgent"}', "priority", None),
    ("/v1/completions", b'{"prompt": "' + b"hello " * 200 + b'"}', "prompt", "context_length_exceeded"),
    ("/v1/completions", b'{"prompt": "hi", "stream": true, "stream_options": {"bogus": 1}}', "stream_options.bogus",
     None),  # a nested object's unknown key is refused too, not ignored
    ("/v1/completions", b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
                        b'{"schema": {}, "strictly": true}}}', "response_format.json_schema.strictly", None),
    ("/v1/chat/completions", b'{"messages": []}', "messages", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', None, None),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
                             b'"top_logprobs": 99}', "top_logprobs", None),
    # fields that would change the output and are not honoured, or are out of range (issue 10)
    ("/v1/completions", b'{"prompt": "hi", "suffix": "bye"}', "suffix", None),
    ("/v1/completions", b'{"prompt": "hi", "best_of": 3}', "best_of", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', "max_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "min_tokens": 3}', "min_tokens", None),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 3}', "presence_penalty", None),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": 0}', "repetition_penalty", None),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias", None),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 101}}', "logit_bias", None),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"99999": 1}}', "logit_bias", None),
    ("/v1/completions", b'{"prompt": "hi", "guided_json": {"type": "strin"}}', "guided_json", None),
    ("/v1/completions", b'{"prompt": "hi", "guided_regex": "[a-"}', "guided_regex", None),
    ("/v1/completions", b'{"prompt": "hi", "guided_grammar": "start: ("}', "guided_grammar", None),
    ("/v1/completions", b'{"prompt": "hi", "guided_choice": []}', "guided_choice", None),
    ("/v1/completions", b'{"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}', "guided_choice", None),
    ("/v1/completions", b'{"prompt": "hi", "guided_whitespace_pattern": " "}', "guided_whitespace_pattern", None),
    ("/v1/completions", b'{"prompt": "hi", "structured_outputs": {"regex": "[a-"}}', "structured_outputs.regex",
     None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": '
                             b'{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}',
     "response_format.json_schema.schema", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "response_format": '
                             b'{"type": "xml"}}', "response_format.type", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}',
     "tool_choice", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                             b'"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": '
                             b'{"name": "g"}}}', "tool_choice", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                             b'"function": {"name": "f", "parameters": {"type": "objec"}}}]}',
     "tools[0].function.parameters", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}',
     "functions", None),
    # a field the server does not know is refused by name, never silently ignored
    ("/v1/completions", b'{"prompt": "hi", "bogus_option": 1}', "bogus_option", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}',
     "modalities", None),
    # vLLM's and OpenAI's fields this server does not implement: only the value that asks nothing passes
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true}',
     "use_beam_search", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}',
     "reasoning_effort", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "length_penalty": 2.0}',
     "length_penalty", None),
    # a model without a reasoning parser has no reasoning to leave out
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "include_reasoning": false}',
     "include_reasoning", None),
]


@pytest.mark.parametrize("path,body,param,code", BAD)
def test_bad_requests_are_400(gateway, path, body, param, code):
    r = httpx.post(gateway + path, content=body, headers={"content-type": "application/json"})
    check_error(r, 400, param, code)


def test_fields_at_the_values_that_ask_nothing_are_accepted(gateway, mesh, client):
    """What SDKs send by default (null, or a field's default) for fields this server does not
    implement, and OpenAI's fields that change no output, pass."""
    r = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=3, metadata={"run": "a"},
        service_tier="auto", extra_body={"use_beam_search": False, "length_penalty": 1.0, "audio": None,
                                         "modalities": ["text"], "echo": False, "reasoning_effort": None,
                                         "spaces_between_special_tokens": True, "logits_processors": None})
    assert r.usage.completion_tokens == 3


def test_unknown_model_is_404(gateway):
    r = httpx.post(f"{gateway}/v1/chat/completions",
                   json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    check_error(r, 404, "model", "model_not_found")
    check_error(httpx.get(f"{gateway}/v1/nowhere"), 404)
    check_error(httpx.get(f"{gateway}/v1/completions"), 405)


def test_no_scheduler_is_503(gateway):
    r = httpx.post(f"{gateway}/v1/completions", json={"model": SERVED, "prompt": "hi"})
    check_error(r, 503)
    assert int(r.headers["Retry-After"]) > 0 and "waited 1 s" in r.json()["error"]["message"]
    check_error(httpx.get(f"{gateway}/health"), 503)
    check_error(httpx.get(f"{gateway}/ping"), 503)


def test_models(gateway):
    r = httpx.get(f"{gateway}/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [SERVED]
    assert body["data"][0]["object"] == "model"
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED]
    one = client.models.retrieve(SERVED)  # OpenAI's GET /v1/models/{model}: the card the list has
    assert one.id == SERVED and one.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    check_error(httpx.get(f"{gateway}/v1/models/no/such/model"), 404, "model", "model_not_found")


def _get_on(sock: socket.socket, path: str = "/v1/models") -> int:
    """One HTTP/1.1 GET on an open connection, its body read to the end; its status."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the gateway closed the connection instead of answering"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the gateway closed the connection mid-body"
        body += chunk
    return int(head.split()[1])


def test_an_idle_connection_outlives_the_clients_pools(gateway):
    """A keep-alive connection idle as long as httpx and the openai client keep one in their pools
    (5 s) is still open and serves the next request. A server that closes it first (uvicorn's
    default is 5 s too) loses the request of a client that reuses it just then, as bench-soak did:
    "Server disconnected without sending a response", no error body, nothing logged."""
    idle = max(httpx.Limits().keepalive_expiry, openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry) + 1.0
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert _get_on(sock) == 200
        closed, _, _ = select.select([sock], [], [], idle)  # readable while idle: the gateway hung up
        assert not closed, f"the gateway closed a connection idle for less than {idle:g} s"
        assert _get_on(sock) == 200


def test_nats_api_errors(gateway, nats_url):
    async def go():
        bus = await Bus.connect(nats_url, namespace=NS)
        try:
            s = bus.subjects
            r = await bus.nc.request(s.completions, b"{oops", timeout=5)
            assert orjson.loads(r.data)["error"]["message"] and r.headers["Meshserve-Status"] == "400"
            r = await bus.nc.request(s.chat_completions, orjson.dumps({"model": "gpt-9", "messages": [
                {"role": "user", "content": "hi"}]}), timeout=5)
            assert orjson.loads(r.data)["error"]["code"] == "model_not_found"
            assert r.headers["Meshserve-Status"] == "404"
            # streaming: the error, then [DONE]
            inbox = bus.nc.new_inbox()
            sub = await bus.nc.subscribe(inbox)
            await confirm_subscriptions(bus.nc)
            await bus.nc.publish(s.completions, orjson.dumps({"prompt": "hi", "top_p": 0, "stream": True}),
                                 reply=inbox)
            first = await sub.next_msg(timeout=5)
            assert orjson.loads(first.data)["error"]["param"] == "top_p"
            assert (await sub.next_msg(timeout=5)).data == b"[DONE]"
        finally:
            await bus.close()

    run_async(go())


# ------------------------------------------------------------------ the demultiplexer


def chunk(rid: str, seq: int, index: int, tokens: list[int], **kw) -> TokenChunk:
    return TokenChunk(request_id=rid, seq=seq, index=index, token_ids=tokens, **kw)


def gen_request(rid: str, subject: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model=SERVED, prompt_token_ids=[5, 6, 7], sampling=Sampling(),
                           stream_subject=subject, arrival_time=time.time())


async def read_all(stream, n_chunks: int | None = None) -> list[TokenChunk]:
    out = []
    while not (out and out[-1].finished) and (n_chunks is None or len(out) < n_chunks):
        out.append(await stream.next(5))
    return out


def test_demux_dedupes_and_holds_gaps(nats_url):
    async def go():
        bus, pub = await Bus.connect(nats_url, namespace=NS), await Bus.connect(nats_url, namespace=NS)
        streams = TokenStreams(bus, "demux-test")
        await streams.start()
        try:
            a, b = streams.open(gen_request("a", streams.subject)), streams.open(gen_request("b", streams.subject))
            lp = [Logprob(logprob=-float(i)) for i in range(3)]
            for c in [chunk("a", 0, 0, [10, 11]),
                      chunk("b", 0, 0, [20]),
                      chunk("a", 2, 4, [14], finished=True, finish_reason="length"),  # a gap: held
                      chunk("a", 0, 0, [10, 11]),  # a repeat: dropped
                      chunk("a", 1, 1, [11, 12, 13], logprobs=lp),  # overlaps: only 12, 13 are new
                      chunk("b", 1, 1, [21], finished=True, finish_reason="stop"),
                      chunk("nobody", 0, 0, [1])]:
                await pub.publish(streams.subject, c)
            got_a, got_b = await read_all(a), await read_all(b)
            assert [(c.index, c.token_ids) for c in got_a] == [(0, [10, 11]), (2, [12, 13]), (4, [14])]
            assert [x.logprob for x in got_a[1].logprobs] == [-1.0, -2.0]
            assert got_a[-1].finish_reason == "length" and a.token_ids == [10, 11, 12, 13, 14]
            assert [c.token_ids for c in got_b] == [[20], [21]] and got_b[-1].finish_reason == "stop"
            # an error fails the request
            c = streams.open(gen_request("c", streams.subject))
            await pub.publish(streams.subject, chunk("c", 0, 0, [], error="out of memory", finished=True))
            with pytest.raises(Exception, match="out of memory") as e:
                await c.next(5)
            assert e.value.status_code == 500
        finally:
            await streams.stop()
            await bus.close()
            await pub.close()

    run_async(go())


def test_demux_resubmits_when_the_worker_is_lost(nats_url):
    async def go():
        bus, worker = await Bus.connect(nats_url, namespace="lost"), await Bus.connect(nats_url, namespace="lost")
        submits: list[GenerateRequest] = []

        async def on_submit(msg):
            submits.append(GenerateRequest.decode(msg.data))
            await msg.respond(SubmitReply(ok=True).encode())

        await worker.nc.subscribe(worker.subjects.submit, cb=on_submit)
        await confirm_subscriptions(worker.nc)
        streams = TokenStreams(bus, "lost-test")
        await streams.start()
        try:
            req = gen_request("r", streams.subject)
            s = streams.open(req)
            pub = lambda c: worker.publish(streams.subject, c)  # noqa: E731
            await pub(chunk("r", 0, 0, [10, 11], worker_id="w1"))
            await pub(chunk("r", 2, 3, [13], worker_id="w1"))  # held, then dropped: w1 dies before index 2
            await pub(chunk("r", 3, 2, [], worker_id="w1", error="worker_lost"))
            assert [c.token_ids for c in await read_all(s, 1)] == [[10, 11]]
            wait = asyncio.get_running_loop().time() + 5
            while not submits and asyncio.get_running_loop().time() < wait:
                await asyncio.sleep(0.01)
            assert len(submits) == 1
            again = submits[0]
            assert again.request_id == "r" and again.output_token_ids == [10, 11]
            assert again.prompt_token_ids == req.prompt_token_ids and again.stream_subject == streams.subject
            await pub(chunk("r", 1, 2, [99], worker_id="w1"))  # late, from the dead worker: ignored
            await pub(chunk("r", 0, 2, [12, 13], worker_id="w2"))
            await pub(chunk("r", 1, 4, [14], worker_id="w2", finished=True, finish_reason="stop"))
            rest = await read_all(s)
            assert [c.token_ids for c in rest] == [[12, 13], [14]] and s.token_ids == [10, 11, 12, 13, 14]
        finally:
            await streams.stop()
            await bus.close()
            await worker.close()

    run_async(go())


def test_demux_resubmits_to_a_restarted_scheduler_as_a_new_attempt(nats_url):
    """A new id on scheduler.hello: what the old scheduler accepted is re-submitted as attempt 1 (the
    old attempt aborted first, on the workers' subject too); attempt-0 chunks are ignored after."""
    from meshserve.shared.schemas import ServiceHello

    async def go():
        bus, sched = await Bus.connect(nats_url, namespace="restart"), await Bus.connect(nats_url, namespace="restart")
        seen: list = []  # submits and aborts, in the order the scheduler side received them

        async def on_submit(msg):
            seen.append(GenerateRequest.decode(msg.data))
            await msg.respond(SubmitReply(ok=True, scheduler_id="old" if len(seen) == 1 else "new").encode())

        async def on_abort(msg):
            seen.append(Abort.decode(msg.data))

        await sched.nc.subscribe(sched.subjects.submit, cb=on_submit)
        await sched.nc.subscribe(sched.subjects.abort, cb=on_abort)
        await confirm_subscriptions(sched.nc)
        streams = TokenStreams(bus, "restart-test")
        await streams.start()
        try:
            s = streams.open(gen_request("r", streams.subject))
            await s.submit()
            pub = lambda c: sched.publish(streams.subject, c)  # noqa: E731
            await pub(chunk("r", 0, 0, [10, 11], worker_id="w1"))
            assert [c.token_ids for c in await read_all(s, 1)] == [[10, 11]]
            await sched.publish(sched.subjects.scheduler_hello, ServiceHello(service_id="old"))  # no change
            await sched.publish(sched.subjects.scheduler_hello, ServiceHello(service_id="new"))
            wait_until = asyncio.get_running_loop().time() + 5
            while len(seen) < 3 and asyncio.get_running_loop().time() < wait_until:
                await asyncio.sleep(0.01)
            assert len(seen) == 3, seen
            abort, again = seen[1], seen[2]
            assert isinstance(abort, Abort) and abort.attempt == 0 and abort.request_id == "r"
            assert again.attempt == 1 and again.output_token_ids == [10, 11]
            await pub(chunk("r", 1, 2, [99], worker_id="w1"))  # the old attempt, still running: ignored
            await pub(chunk("r", 0, 2, [12], worker_id="w1", attempt=1))
            await pub(chunk("r", 1, 3, [13], worker_id="w1", attempt=1, finished=True, finish_reason="length"))
            rest = await read_all(s)
            assert [c.token_ids for c in rest] == [[12], [13]] and s.token_ids == [10, 11, 12, 13]
            assert s.scheduler_id == "new"
        finally:
            await streams.stop()
            await bus.close()
            await sched.close()

    run_async(go())


# ------------------------------------------------------------------ whole responses, stand-in mesh


class StandIn:
    """Answers scheduler.submit (ok) and scheduler.status (ready), and "generates" SCRIPT's tokens,
    two per chunk, on the request's stream subject; records aborts. The seed picks a behaviour:
    SHUFFLED sends chunks out of order and repeated, LOSES_WORKER reports worker_lost after two
    chunks then continues when re-submitted, SLOW waits 0.2 s per chunk, SILENT sends nothing."""

    def __init__(self, nats_url: str, tokenizer: Tokenizer):
        self.url = nats_url
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.submits: list[GenerateRequest] = []
        self.aborts: list[Abort] = []
        self.tasks: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self):
        self.bus = bus = await Bus.connect(self.url, namespace=NS)
        s = bus.subjects
        await bus.nc.subscribe(s.submit, cb=self._on_submit)
        await bus.nc.subscribe(s.abort, cb=self._on_abort)
        await bus.nc.subscribe(s.scheduler_status, cb=self._on_status)
        await confirm_subscriptions(bus.nc)

    async def _stop(self):
        for t in self.tasks:
            t.cancel()
        await self.bus.close()

    async def _on_abort(self, msg):
        self.aborts.append(Abort.decode(msg.data))

    async def _on_status(self, msg):
        tiny = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "prefix_queries": 10, "prefix_hits": 4,
                "num_preemptions": 0}
        await msg.respond(orjson.dumps({"ready": True, "workers": ["w1"], **tiny, "by_model": {SERVED: tiny}}))

    async def _on_submit(self, msg):
        req = GenerateRequest.decode(msg.data)
        self.submits.append(req)
        await msg.respond(SubmitReply(ok=True).encode())
        task = asyncio.get_running_loop().create_task(self._generate(req))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def aborted(self, rid: str) -> Abort | None:
        return next((a for a in self.aborts if a.request_id == rid), None)

    def expected_tokens(self, max_tokens: int) -> list[int]:
        return self.script[:max_tokens] if max_tokens <= len(self.script) else self.script + [EOS]

    async def _generate(self, req: GenerateRequest):
        mode, k = req.sampling.seed, req.sampling.logprobs
        tokens = self.expected_tokens(req.sampling.max_tokens)
        reason = "length" if req.sampling.max_tokens <= len(self.script) else "stop"
        start = len(req.output_token_ids)
        worker = "w2" if start else "w1"
        chunks = []
        for seq, i in enumerate(range(start, len(tokens), 2)):
            ids = tokens[i:i + 2]
            lps = None if k is None else [Logprob(logprob=-0.5, top=[(t, -0.5), (t + 1, -1.5)][:k]) for t in ids]
            last = i + 2 >= len(tokens)
            chunks.append(TokenChunk(request_id=req.request_id, seq=seq, index=i, token_ids=ids, logprobs=lps,
                                     finished=last, finish_reason=reason if last else None,
                                     num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=3,
                                     worker_id=worker))
        if mode == SILENT:
            return
        if mode == SHUFFLED and len(chunks) >= 3:
            chunks = [chunks[0], chunks[2], chunks[1], chunks[1], chunks[0]] + chunks[2:]
        if mode == LOSES_WORKER and not start:
            chunks = chunks[:2] + [TokenChunk(request_id=req.request_id, seq=2, index=4, token_ids=[],
                                              worker_id=worker, error="worker_lost")]
        for c in chunks:
            await asyncio.sleep(0.2 if mode == SLOW else 0.005)
            if self.aborted(req.request_id):
                return
            await self.bus.publish(req.stream_subject, c)


@pytest.fixture
def mesh(nats_url, tokenizer):
    with StandIn(nats_url, tokenizer) as m:
        yield m


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=20)


def test_completion_non_streaming(gateway, client, mesh, tokenizer):
    prompt = "Hello there"
    r = client.completions.create(model=SERVED, prompt=prompt, max_tokens=5, logprobs=2)
    want = mesh.expected_tokens(5)
    assert r.choices[0].text == tokenizer.decode(want) and r.choices[0].finish_reason == "length"
    assert r.object == "text_completion" and r.model == SERVED and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 3
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and lp.token_logprobs == [-0.5] * 5 and len(lp.top_logprobs[0]) == 2
    sub = mesh.submits[-1]
    assert sub.model == SERVED and sub.priority == "normal" and sub.trace == {}
    assert sub.prompt_token_ids == tokenizer.encode(prompt) and sub.sampling.logprobs == 2
    # token ids as the prompt, a priority, and the end of the output (EOS) as finish
    r = client.completions.create(model=SERVED, prompt=[5, 6, 7], max_tokens=100, temperature=0.5, top_p=0.9,
                                  extra_body={"priority": "interactive", "top_k": 7})
    assert r.choices[0].text == tokenizer.decode(mesh.script) and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == len(mesh.script) + 1
    sub = mesh.submits[-1]
    assert sub.priority == "interactive" and sub.prompt_token_ids == [5, 6, 7]
    assert (sub.sampling.temperature, sub.sampling.top_p, sub.sampling.top_k, sub.sampling.max_tokens) == \
        (0.5, 0.9, 7, 100)
    r = httpx.post(f"{gateway}/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 2},
                   headers={"X-Request-Id": "proxy-42"})  # a proxy's id names the response, and comes back
    assert r.json()["id"] == "cmpl-proxy-42" and r.headers["x-request-id"] == "proxy-42"
    r = httpx.post(f"{gateway}/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 2})
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"] == "cmpl-" + mesh.submits[-1].request_id
    for asked, cls in ((-1, "interactive"), (0, "normal"), (7, "background")):  # vLLM's integer priorities
        client.completions.create(model=SERVED, prompt=[5, 6, 7], max_tokens=2, extra_body={"priority": asked})
        assert mesh.submits[-1].priority == cls, asked


def test_chat_streaming_with_usage(client, mesh, tokenizer):
    stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                            stream=True, stream_options={"include_usage": True}, seed=SHUFFLED,
                                            logprobs=True, top_logprobs=1)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(mesh.script)  # out of order and repeated on the wire, not here
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(mesh.script) + 1
    assert all(c.usage is None for c in chunks[:-1])
    n_lp = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert n_lp == len(mesh.script) + 1  # one per token, EOS included
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]),
                              add_special_tokens=False)
    assert chunks[-1].usage.prompt_tokens == len(prompt) and mesh.submits[-1].prompt_token_ids == prompt
    assert mesh.submits[-1].sampling.max_tokens == 128 - len(prompt)  # no max_tokens: fill the context
    # not streamed
    r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=4)
    assert r.choices[0].message.content == tokenizer.decode(mesh.script[:4])
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 4


def test_continuous_usage_stats(client, mesh, tokenizer):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    chunks = list(client.completions.create(model=SERVED, prompt="x", max_tokens=6, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 6 and all(c.usage.prompt_tokens == 1 for c in chunks)


def test_stop_string_ends_the_response_and_aborts(client, mesh, tokenizer):
    r = client.completions.create(model=SERVED, prompt="x", max_tokens=50, stop=["fox"], seed=SLOW)
    assert r.choices[0].text == SCRIPT.split("fox")[0] and r.choices[0].finish_reason == "stop"
    rid = mesh.submits[-1].request_id
    assert wait_for(lambda: mesh.aborted(rid), 5, "the stop Abort").reason == "stop"
    stream = client.completions.create(model=SERVED, prompt="x", max_tokens=50, stop="lazy", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == SCRIPT.split("lazy")[0]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_for(lambda: mesh.aborted(mesh.submits[-1].request_id), 5, "the stop Abort").reason == "stop"


def test_vllm_text_and_prompt_options(client, mesh, tokenizer):
    """include_stop_str_in_output keeps the stop string; truncate_prompt_tokens sends the prompt's last
    tokens (and echo returns theirs); add_special_tokens is the prompt's encoding."""
    r = client.completions.create(model=SERVED, prompt="x", max_tokens=50, stop=["fox"],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == SCRIPT.split("fox")[0] + "fox" and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=SERVED, prompt="x", max_tokens=50, stop="lazy", stream=True,
                                       extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in stream) == SCRIPT.split("lazy")[0] + "lazy"
    text = "one two three four five"
    ids = tokenizer.encode(text)
    r = client.completions.create(model=SERVED, prompt=text, max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert mesh.submits[-1].prompt_token_ids == ids[-3:] and r.usage.prompt_tokens == 3
    assert r.choices[0].text == tokenizer.decode(ids[-3:]) + tokenizer.decode(mesh.script[:2])
    for add in (True, False):
        client.completions.create(model=SERVED, prompt=text, max_tokens=1, extra_body={"add_special_tokens": add})
        assert mesh.submits[-1].prompt_token_ids == tokenizer.encode(text, add_special_tokens=add)


def test_lost_worker_is_invisible_to_the_client(client, mesh, tokenizer):
    stream = client.completions.create(model=SERVED, prompt="x", max_tokens=9, seed=LOSES_WORKER, stream=True)
    assert "".join(c.choices[0].text for c in stream) == tokenizer.decode(mesh.script[:9])
    first, again = mesh.submits[-2:]
    assert first.request_id == again.request_id and again.output_token_ids == mesh.script[:4]


def test_silent_mesh_times_out_and_aborts(gateway, mesh):
    r = httpx.post(f"{gateway}/v1/completions", json={"prompt": "x", "seed": SILENT}, timeout=10)
    check_error(r, 504, code="timeout")
    assert wait_for(lambda: mesh.aborted(mesh.submits[-1].request_id), 5, "the timeout Abort").reason == "abort"


def test_client_disconnect_aborts(gateway, mesh):
    with httpx.stream("POST", f"{gateway}/v1/completions",
                      json={"prompt": "x", "max_tokens": 20, "seed": SLOW, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    assert wait_for(lambda: mesh.aborted(mesh.submits[-1].request_id), 5, "the disconnect Abort")
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(f"{gateway}/v1/completions", json={"prompt": "x", "max_tokens": 20, "seed": SLOW}, timeout=0.5)
    assert wait_for(lambda: mesh.aborted(mesh.submits[-1].request_id), 5, "the disconnect Abort")


def test_nats_api_serves_like_http(gateway, nats_url, mesh, tokenizer):
    async def go():
        bus = await Bus.connect(nats_url, namespace=NS)
        try:
            body = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
            r = await bus.nc.request(bus.subjects.chat_completions, orjson.dumps(body), timeout=10)
            reply = orjson.loads(r.data)
            assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 6
            assert reply["choices"][0]["message"]["content"] == tokenizer.decode(mesh.script[:6])
            inbox = bus.nc.new_inbox()
            sub = await bus.nc.subscribe(inbox)
            await confirm_subscriptions(bus.nc)
            await bus.nc.publish(bus.subjects.completions, orjson.dumps(
                {"prompt": "x", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}),
                reply=inbox)
            msgs = []
            while not msgs or msgs[-1] != b"[DONE]":
                msgs.append((await sub.next_msg(timeout=10)).data)
            chunks = [orjson.loads(m) for m in msgs[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
                tokenizer.decode(mesh.script[:6])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        finally:
            await bus.close()

    run_async(go())


def test_health_and_metrics_with_a_scheduler(gateway, mesh, client):
    r = httpx.get(f"{gateway}/health")
    assert r.status_code == 200 and r.json()["scheduler"]["ready"] is True
    assert httpx.get(f"{gateway}/ping").json()["status"] == "ok"  # vLLM's and SageMaker's name for it
    assert httpx.get(f"{gateway}/version").json() == {"version": meshserve.__version__}
    client.completions.create(model=SERVED, prompt="x", max_tokens=3)
    text = httpx.get(f"{gateway}/metrics").text
    for line in ('meshserve:num_requests_running{model_name="tiny"} 2.0',
                 'meshserve:kv_cache_usage_perc{model_name="tiny"} 0.25',
                 'meshserve:prefix_cache_hits{model_name="tiny"} 4.0',
                 'meshserve:request_success_total{finished_reason="length",model_name="tiny"}'):
        assert line in text, line
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert f"meshserve:{name}_count" in text
    assert 'meshserve:prompt_tokens_total{model_name="tiny"}' in text
    assert 'meshserve:generation_tokens_total{model_name="tiny"}' in text


def test_still_serving_after_everything(gateway, mesh, client):
    assert httpx.get(f"{gateway}/v1/models").status_code == 200
    assert client.completions.create(model=SERVED, prompt="x", max_tokens=2).usage.completion_tokens == 2
