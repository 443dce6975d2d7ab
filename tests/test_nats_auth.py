"""NATS authentication and subject permissions (shared/nats_auth.py) on a real nats-server started
with the config `meshserve up` writes: who may connect, publish and subscribe (each worker its own
user); the bus's refusal of messages over max_payload; TLS with a self-signed certificate. Then one
real `meshserve up` with TLS on, a small max_payload and a user per worker: served end to end over
TLS while a plain connection is refused, a NATS API reply over max_payload refused naming the limit,
one worker's credentials kept off another worker's subjects. The fuzzed mesh is tests/test_fuzz.py's."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import nats
import nats.errors
import orjson
import pytest
from openai import OpenAI

from meshserve.cli.launcher import nats_server_binary
from meshserve.shared import nats_auth
from meshserve.shared.bus import Bus, PayloadTooLarge
from meshserve.shared.schemas import LeaseRequest
from meshserve.shared.subjects import Subjects

sys.path.insert(0, str(Path(__file__).parent))
from mesh_util import Mesh, free_port  # noqa: E402

NS = "authtest"
S = Subjects(NS)


def read_until_closed(sock) -> bytes:
    """Everything the server sends until it closes the connection (or the socket times out)."""
    answer = b""
    try:
        while chunk := sock.recv(4096):
            answer += chunk
    except (ConnectionError, TimeoutError):
        pass
    return answer

def start_server(tmp: Path, extra: str = "", max_payload: str = "1MB", workers: int = 0):
    port = free_port()
    passwords = nats_auth.generate_passwords(workers=workers)
    conf = tmp / f"nats-{port}.conf"
    nats_auth.write_private(conf, f"listen: 127.0.0.1:{port}\nmax_payload: {max_payload}\n{extra}"
                            + nats_auth.authorization_block(NS, passwords))
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, port, passwords


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, port, passwords = start_server(tmp_path_factory.mktemp("nats-auth"), workers=2)
    yield f"nats://127.0.0.1:{port}", passwords
    proc.terminate()
    proc.wait(10)


async def connect_as(url: str, passwords: dict, user: str, errors: list | None = None):
    async def on_error(e):
        if errors is not None:
            errors.append(str(e))
    for _ in range(100):  # the server may still be starting
        try:
            return await nats.connect(url, error_cb=on_error, allow_reconnect=False,
                                      **nats_auth.connect_options(nats_auth.env_for(user, passwords[user])))
        except (OSError, nats.errors.NoServersError):
            await asyncio.sleep(0.05)
    raise AssertionError("nats-server did not start")


async def violations_of(nc, errors: list, want: int, timeout: float = 5.0) -> list[str]:
    await nc.flush()
    deadline = asyncio.get_running_loop().time() + timeout
    while sum("permissions violation" in e.lower() for e in errors) < want:
        assert asyncio.get_running_loop().time() < deadline, errors
        await asyncio.sleep(0.02)
    return [e for e in errors if "permissions violation" in e.lower()]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def check_kept_off(connect, user: str, other: str, s: Subjects, more_subscriptions: tuple[str, ...] = ()):
    """`user`, a worker's credentials, may neither publish on worker `other`'s subjects nor on the
    public API, nor read `other`'s requests (nor subscribe to `more_subscriptions`): each is refused
    as a permissions violation, and nothing it published reaches a subscriber. connect(user, errors)
    opens a connection whose async errors go to `errors`; returns (admin, the worker's), still open."""
    admin = await connect("admin")
    heard = []

    async def hear(msg):
        heard.append(msg.subject)
    for subject in (s.worker(other, "adopt"), s.worker(other, "prefill"), s.completions):
        await admin.subscribe(subject, cb=hear)
    await admin.flush()
    errors: list[str] = []
    worker = await connect(user, errors)
    for subject in (s.worker(other, "adopt"), s.completions):  # another worker's, the public API
        await worker.publish(subject, b"{}")
    for subject in (s.worker(other, "prefill"), *more_subscriptions):  # reading another worker's requests
        await worker.subscribe(subject)
    got = await violations_of(worker, errors, 3 + len(more_subscriptions))
    assert any("publish" in e.lower() and s.worker(other, "adopt") in e for e in got), got
    assert any("subscription" in e.lower() and s.worker(other, "prefill") in e for e in got), got
    await admin.flush()
    assert heard == []  # nothing the worker published reached those subjects
    return admin, worker


def test_config_and_credentials_are_private(tmp_path):
    nats_auth.write_credentials(tmp_path / "creds", nats_auth.generate_passwords())
    for f in (tmp_path / "creds").iterdir():
        assert f.stat().st_mode & 0o777 == 0o600, f
    env = nats_auth.read_credentials(tmp_path / "creds" / "worker.env")
    assert env[nats_auth.ENV_USER] == "worker" and env[nats_auth.ENV_INBOX] == "_INBOX_worker"


def test_connection_without_credentials_is_refused(server):
    url, passwords = server

    async def go():
        await connect_as(url, passwords, "admin")  # the server is up
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, error_cb=_ignore)
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, user="worker", password="wrong", allow_reconnect=False, error_cb=_ignore)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionError, match="refused the credentials"):
            await Bus.connect(url, namespace=NS)  # immediately, not after its 30 s of retries
        assert asyncio.get_running_loop().time() - t0 < 5
    run(go())


async def _ignore(e):
    pass


def test_worker_cannot_submit_nor_answer_kv(server):
    url, passwords = server

    async def go():
        admin = await connect_as(url, passwords, "admin")
        heard = []

        async def hear(msg):
            heard.append(msg.subject)
        for subject in (S.submit, S.completions, S.chat_completions):
            await admin.subscribe(subject, cb=hear)
        await admin.flush()
        errors: list[str] = []
        worker = await connect_as(url, passwords, "worker", errors)
        for subject in (S.submit, S.completions, S.chat_completions):
            await worker.publish(subject, b"{}")
        await worker.subscribe(S.kv("lease", "node0"))
        await worker.subscribe(S.kv("arena", "*"))
        got = await violations_of(worker, errors, 5)
        assert any("publish" in e.lower() and S.submit in e for e in got), got
        assert any("subscription" in e.lower() and S.kv("lease", "node0") in e for e in got), got
        await admin.flush()
        assert heard == []  # nothing the worker published got through
        # ...while what a worker does is allowed: the kv-pool answers its lease (allow_responses)
        pool = await connect_as(url, passwords, "kv-pool")
        async def lease(msg):
            await msg.respond(b"leased")
        await pool.subscribe(S.kv("lease", "node0"), cb=lease)
        await pool.flush()
        await pool.flush()  # nats-py: the second PING goes after the SUB (services/gateway/streams.py)
        reply = await worker.request(S.kv("lease", "node0"), LeaseRequest(worker_id="w", num_blocks=1).encode(),
                                     timeout=5)
        assert reply.data == b"leased"
        assert len([e for e in errors if "permissions violation" in e.lower()]) == 5
        for nc in (admin, worker, pool):
            await nc.close()
    run(go())


def test_public_user_reaches_only_the_public_api(server):
    url, passwords = server

    async def go():
        gateway = await connect_as(url, passwords, "gateway")

        async def answer(msg):  # a streamed answer: several messages on one reply subject
            for chunk in (b"one", b"two", b"[DONE]"):
                await gateway.publish(msg.reply, chunk)
        await gateway.subscribe(S.completions, queue="gateway", cb=answer)
        await gateway.flush()
        errors: list[str] = []
        public = await connect_as(url, passwords, "public", errors)
        inbox = public.new_inbox()
        got = []
        done = asyncio.Event()

        async def on_chunk(msg):
            got.append(msg.data)
            if msg.data == b"[DONE]":
                done.set()
        await public.subscribe(inbox, cb=on_chunk)
        await public.publish(S.completions, b"{}", reply=inbox)
        await asyncio.wait_for(done.wait(), 5)
        assert got == [b"one", b"two", b"[DONE]"]
        # nothing else: not the scheduler, not a worker, not the token streams, not a service's replies
        for subject in (S.submit, S.scheduler_status, S.worker("w", "prefill"), S.kv("lease", "node0")):
            await public.publish(subject, b"{}")
        for subject in (S.tokens("*"), S.heartbeat, "_INBOX_scheduler.>", ">"):
            await public.subscribe(subject)
        assert len(await violations_of(public, errors, 8)) == 8
        # the model-loader, which publishes nothing of its own, may only answer
        ml_errors: list[str] = []
        loader = await connect_as(url, passwords, "model-loader", ml_errors)
        await loader.publish(S.submit, b"{}")
        await violations_of(loader, ml_errors, 1)
        for nc in (gateway, public, loader):
            await nc.close()
    run(go())


def test_messages_over_max_payload_fail_at_once_naming_the_limit(tmp_path):
    proc, port, passwords = start_server(tmp_path, max_payload="4096")
    try:
        async def go():
            url = f"nats://admin:{passwords['admin']}@127.0.0.1:{port}"
            bus = await Bus.connect(url, namespace=NS)
            big = LeaseRequest(worker_id="w" * 5000, num_blocks=1)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(PayloadTooLarge, match=r"max_payload \(4096 bytes\)"):
                await bus.request(S.kv("lease", "n"), big, LeaseRequest, timeout=10)
            with pytest.raises(PayloadTooLarge, match="4096"):
                await bus.publish(S.kv("release", "n"), big)
            assert asyncio.get_running_loop().time() - t0 < 1  # an error, not a timeout
            await bus.close()
        run(go())
        # a client that sends one anyway: the server says why and closes the connection
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert orjson.loads(sock.recv(4096)[5:])["max_payload"] == 4096  # INFO: the limit, for every client
            sock.sendall(b'CONNECT {"user":"admin","pass":"' + passwords["admin"].encode() + b'","verbose":false}\r\n'
                         + b"PUB " + S.kv("release", "n").encode() + b" 5000\r\n" + b"x" * 5000 + b"\r\n")
            answer = read_until_closed(sock)
        assert b"Maximum Payload" in answer, answer
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = make_certificate(tmp_path)
    proc, port, passwords = start_server(tmp_path, extra=f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n')
    try:
        async def go():
            env = {**nats_auth.env_for("admin", passwords["admin"]), nats_auth.ENV_TLS_CA: str(cert)}
            for _ in range(100):
                try:
                    nc = await nats.connect(f"tls://127.0.0.1:{port}", allow_reconnect=False, error_cb=_ignore,
                                            **nats_auth.connect_options(env))
                    break
                except (OSError, nats.errors.NoServersError):
                    await asyncio.sleep(0.05)
            assert nc.is_connected and nc.connected_url.scheme == "tls"
            await nc.close()
            # without the certificate to trust, the server is refused
            with pytest.raises(Exception, match="(?i)certificate"):
                await nats.connect(f"tls://127.0.0.1:{port}", allow_reconnect=False, error_cb=_ignore,
                                   **nats_auth.connect_options(nats_auth.env_for("admin", passwords["admin"])))
        run(go())
    finally:
        proc.terminate()
        proc.wait(10)


def test_each_worker_reaches_only_its_own_subjects(server):
    """worker-0 and worker-1 (the users `meshserve up` gives its workers): the scheduler reaches each
    one's subjects, whatever its pid; neither may read the other's, publish on any worker's, nor on
    the public API; the shared `worker` user does not reach theirs either."""
    url, passwords = server
    mine, theirs = "worker-0.prefill-node0-11", "worker-1.decode-node0-12"  # ids as Worker makes them

    async def go():
        async def connect(user, errors=None):
            return await connect_as(url, passwords, user, errors)
        # neither another's subjects, nor the shared user's
        admin, w0 = await check_kept_off(connect, "worker-0", theirs, S, (S.worker("worker.*", "prefill"),))
        got_own = asyncio.Event()

        async def own(msg):
            got_own.set()
        await w0.subscribe(S.worker(mine, "adopt"), cb=own)
        await w0.flush()
        await w0.flush()
        scheduler = await connect("scheduler")
        await scheduler.publish(S.worker(mine, "adopt"), b"{}")
        await asyncio.wait_for(got_own.wait(), 5)  # its own subjects work
        shared_errors: list[str] = []
        shared = await connect("worker", shared_errors)
        await shared.subscribe(S.worker(theirs, "prefill"))
        await violations_of(shared, shared_errors, 1)
        for nc in (admin, w0, scheduler, shared):
            await nc.close()
    run(go())


def test_workers_hear_each_others_compute_claims(server):
    """A worker's compute claim (services/worker/compute_claims.py) reaches the other workers, with
    their own users or the shared one; nothing else may publish claims."""
    url, passwords = server

    async def go():
        subject = S.compute("claim", "node0")
        heard: dict[str, asyncio.Event] = {}
        listeners = []
        for user in ("worker-1", "worker"):
            nc = await connect_as(url, passwords, user)
            heard[user] = asyncio.Event()

            async def hear(msg, e=heard[user]):
                e.set()
            await nc.subscribe(subject, cb=hear)
            await nc.flush()
            await nc.flush()
            listeners.append(nc)
        w0 = await connect_as(url, passwords, "worker-0")
        await w0.publish(subject, b"{}")
        for e in heard.values():
            await asyncio.wait_for(e.wait(), 5)
        errors: list[str] = []
        gateway = await connect_as(url, passwords, "gateway", errors)
        await gateway.publish(subject, b"{}")
        got = await violations_of(gateway, errors, 1)
        assert any("publish" in e.lower() and subject in e for e in got), got
        for nc in (*listeners, w0, gateway):
            await nc.close()
    run(go())


# -- one real mesh: TLS on, a small max_payload, a user per worker

MESH_MAX_PAYLOAD = 65536


def make_certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl: the `cryptography` package is not a dependency)."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=meshserve-test",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def secure_mesh(tiny_llama, tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    tmp = tmp_path_factory.mktemp("secure-mesh")
    cert, key = make_certificate(tmp)
    with Mesh(tiny_llama, tmp, prefill=1, decode=1, extra=[
            "--nats-tls-cert", str(cert), "--nats-tls-key", str(key),
            "--nats-max-payload", str(MESH_MAX_PAYLOAD)]) as m:
        m.pids = {s: m.service_pid(s) for s in ("nats-server", "gateway", "scheduler", "prefill", "decode")}
        yield m
        assert {s: m.service_pid(s) for s in m.pids} == m.pids  # nothing the tests sent killed anything


async def mesh_connect(mesh, user: str, errors: list | None = None):
    async def on_error(e):
        if errors is not None:
            errors.append(str(e))
    return await nats.connect(mesh.user_url(user), allow_reconnect=False, error_cb=on_error, **mesh.nats_options())


async def public_call(mesh, subject: str, body: dict, timeout: float = 60.0) -> list:
    """Every message of a NATS API answer as the public user (a stream: up to its [DONE])."""
    nc = await mesh_connect(mesh, "public")
    try:
        inbox, got, done = nc.new_inbox(), [], asyncio.Event()

        async def on_msg(msg):
            got.append(msg)
            if not body.get("stream") or msg.data == b"[DONE]":
                done.set()
        await nc.subscribe(inbox, cb=on_msg)
        await nc.publish(subject, orjson.dumps(body), reply=inbox)
        await asyncio.wait_for(done.wait(), timeout)
        return got
    finally:
        await nc.close()


def test_tls_mesh_serves_end_to_end_and_refuses_plain_connections(secure_mesh):
    m = secure_mesh
    assert f"NATS tls://{m.nats_address}" in m.wait_log("meshserve is ready")  # every service was given the TLS URL
    r = OpenAI(base_url=m.url + "/v1", api_key="none").completions.create(
        model=m.model, prompt="Hello", max_tokens=4, temperature=0)  # HTTP -> gateway -> NATS over TLS -> workers
    assert r.usage.completion_tokens == 4
    (msg,) = asyncio.run(public_call(m, f"{m.namespace}.v1.completions",
                                     {"prompt": "Hello", "max_tokens": 4, "temperature": 0}))
    assert orjson.loads(msg.data)["choices"][0]["text"] == r.choices[0].text  # and the public NATS API over TLS
    # a plain connection: the server's INFO demands TLS, and a CONNECT in the clear gets no PONG
    with socket.create_connection(("127.0.0.1", m.nats_port), timeout=10) as sock:
        info = sock.recv(4096)
        assert info.startswith(b"INFO ") and orjson.loads(info[5:])["tls_required"] is True
        pw = m.user_env("admin")[nats_auth.ENV_PASSWORD]
        sock.sendall(b'CONNECT {"user":"admin","pass":"' + pw.encode() + b'","verbose":false}\r\nPING\r\n')
        answer = read_until_closed(sock)
    assert b"PONG" not in answer, answer
    # and a client that does not trust the mesh's certificate is refused
    with pytest.raises(Exception, match="(?i)certificate"):
        asyncio.run(nats.connect(m.user_url("admin"), allow_reconnect=False, error_cb=_ignore))


def test_over_max_payload_requests_and_replies_fail_naming_the_limit(secure_mesh):
    m = secure_mesh
    subject = f"{m.namespace}.v1.chat.completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "ignore_eos": True, "n": 4,
            "logprobs": True, "top_logprobs": 20, "temperature": 0}

    async def oversized_request():
        nc = await mesh_connect(m, "public")
        try:
            assert nc.max_payload == MESH_MAX_PAYLOAD  # the limit, as the server announced it
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(nats.errors.MaxPayloadError):  # refused by the client at once, nothing sent
                await nc.request(subject, b" " * (MESH_MAX_PAYLOAD + 1), timeout=30)
            assert asyncio.get_running_loop().time() - t0 < 1
        finally:
            await nc.close()
    asyncio.run(oversized_request())
    # an HTTP body under --max-body-bytes whose request outgrows the bus: a 413 naming the limit
    r = httpx.post(m.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop_token_ids": [100] * 20000},
                   timeout=60)
    assert r.status_code == 413 and str(MESH_MAX_PAYLOAD) in r.json()["error"]["message"], r.text
    # a reply too large for one message: refused with an OpenAI error naming the limit, not a 500
    (msg,) = asyncio.run(public_call(m, subject, body))
    assert msg.headers["Meshserve-Status"] == "400", msg.data
    err = orjson.loads(msg.data)["error"]
    assert err["code"] == "response_too_large" and f"max_payload ({MESH_MAX_PAYLOAD} bytes)" in err["message"], err
    assert '"stream": true' in err["message"]
    # ...which the same request streamed gets whole, one chunk a message
    msgs = asyncio.run(public_call(m, subject, {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert msgs[-1].data == b"[DONE]" and not any((x.headers or {}).get("Meshserve-Status") for x in msgs)
    chunks = [orjson.loads(x.data) for x in msgs[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 * 24
    assert sum(len(x.data) for x in msgs) > MESH_MAX_PAYLOAD  # what one reply could not have carried
    tops = [len(t["top_logprobs"]) for c in chunks for ch in c["choices"]
            for t in ((ch.get("logprobs") or {}).get("content") or [])]
    assert len(tops) == 4 * 24 and set(tops) == {20}  # every token with its 20 alternatives


def test_a_workers_credentials_stay_off_other_workers_subjects(secure_mesh):
    m = secure_mesh
    ids = sorted(w["id"] for w in m.ask("scheduler.status")["workers"])  # both heard (Mesh.wait_ready)
    assert [i.split(".")[0] for i in ids] == ["worker-0", "worker-1"], ids  # each its own user, named in its id
    other, s = ids[1], Subjects(m.namespace)

    async def go():
        admin, w0 = await check_kept_off(lambda user, errors=None: mesh_connect(m, user, errors), "worker-0", other, s)
        await admin.close()
        await w0.close()
    asyncio.run(asyncio.wait_for(go(), 30))
    r = httpx.post(m.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200  # and the mesh serves on

