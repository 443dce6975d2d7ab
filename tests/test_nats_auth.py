"""NATS authentication and subject permissions (shared/nats_auth.py) on a real nats-server started
with the config `meshserve up` writes: who may connect, publish and subscribe; the bus's refusal of
messages over max_payload; TLS with a self-signed certificate. The whole mesh under these rules
is tests/test_fuzz.py's."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest

from meshserve.cli.launcher import nats_server_binary
from meshserve.shared import nats_auth
from meshserve.shared.bus import Bus, PayloadTooLarge
from meshserve.shared.schemas import LeaseRequest
from meshserve.shared.subjects import Subjects

sys.path.insert(0, str(Path(__file__).parent))
from mesh_util import free_port  # noqa: E402

NS = "authtest"
S = Subjects(NS)


def start_server(tmp: Path, extra: str = "", max_payload: str = "1MB"):
    port = free_port()
    passwords = nats_auth.generate_passwords()
    conf = tmp / f"nats-{port}.conf"
    nats_auth.write_private(conf, f"listen: 127.0.0.1:{port}\nmax_payload: {max_payload}\n{extra}"
                            + nats_auth.authorization_block(NS, passwords))
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, port, passwords


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, port, passwords = start_server(tmp_path_factory.mktemp("nats-auth"))
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
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=meshserve-test",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
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
