"""Fault drills on a real `meshserve up`: kill -9, in turn and mid-load, a prefill and a decode
worker, the kv-pool, the model loader, the scheduler, the gateway and the nats-server. Every
stream accepted before the fault must end with exactly the text of an undisturbed run, or with a
clear error (an SSE error event, or for the gateway's own clients a lost connection): never cut
short without one, never a gap or a repeat. The mesh must serve again within RECOVERY_S. One mesh
serves every drill: each waits until the launcher restarted what it killed and a request succeeds
again. `pytest -s` prints, per fault, how the streams ended and when the mesh served again
(docs/benchmarks/README.md's table)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import signal
import time

import httpx
import openai
import pytest
from openai import OpenAI

from mesh_util import Mesh, wait_streams_started
from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.sequence import SamplingParams

PROMPTS = ["The quick brown fox", "Hello world! Hello there", "def add(a, b):", "Once upon a time there was"]
MAX_TOKENS = 160
RECOVERY_S = 60.0  # from the kill to a request served again
WORKER_TIMEOUT_S = 3.0  # the kv-pool's and the scheduler's --worker-timeout (their default)
TIMES: dict[str, float] = {}  # recovery time per fault, printed at the end
OUTCOMES: dict[str, dict[str, int]] = {}  # per fault: streams identical / failed clearly / lost, printed at the end


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), "float32")
    return [llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].text
            for p in PROMPTS]


@pytest.fixture(scope="module")
def mesh(tiny_llama, tmp_path_factory):
    with Mesh(tiny_llama, tmp_path_factory.mktemp("faults"), prefill=1, decode=1) as m:
        yield m
    print("recovery times (s):", {k: round(v, 2) for k, v in TIMES.items()})
    for fault, counts in OUTCOMES.items():  # docs/benchmarks' per-fault table
        print(f"fault {fault}: {counts}, serving again after {TIMES.get(fault, float('nan')):.2f}s")


def _tally(fault: str, outcomes: list, reference: list) -> None:
    """How each stream of a drill ended (the asserts make `lost` 0; counted so the report shows it)."""
    counts = dict.fromkeys(("identical", "failed clearly", "connection lost", "lost"), 0)
    for (kind, text), want in zip(outcomes, reference):
        key = {"error": "failed clearly", "connection": "connection lost"}.get(kind, "lost")
        counts["identical" if (kind, text) == ("ok", want) else key] += 1
    OUTCOMES[fault] = counts


def _stream(client: OpenAI, model: str, prompt: str, received: list, i: int) -> tuple[str, str]:
    """("ok"|"cut", text), or ("error", message) when the stream ended with a clear error."""
    text, finish = "", None
    try:
        for c in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            received[i] += 1
    except openai.APIConnectionError as e:
        return "connection", str(e)
    except openai.APIError as e:  # an SSE error event, or an error status
        return "error", str(e)
    return ("ok" if finish else "cut"), text


def _serves(mesh: Mesh, want: str, deadline: float) -> float:
    """Polls until a request comes back right; returns when."""
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=10, max_retries=0)
    last = None
    while time.monotonic() < deadline:
        try:
            r = client.completions.create(model=mesh.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
            if r.choices[0].text == want:
                return time.monotonic()
            last = f"wrong text: {r.choices[0].text!r}"
        except (openai.APIError, httpx.HTTPError) as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"the mesh did not serve again within {RECOVERY_S}s: {last}\n"
                         f"{mesh.log.read_text()[-3000:]}")


def _all_back(mesh: Mesh, deadline: float) -> None:
    """Every service runs again and the scheduler knows both workers: the running ones, not a dead one
    it has not missed yet."""
    while time.monotonic() < deadline:
        names = ["nats-server", "model-loader", "kv-pool", "prefill", "decode", "scheduler", "gateway"]
        if all(mesh.service_pid(n) for n in names):
            try:
                st = mesh.ask("scheduler.status")
                heard = {int(w["id"].rsplit("-", 1)[1]) for w in st["workers"]}  # worker ids end with their pid
                if st["ready"] and heard == {mesh.service_pid("prefill"), mesh.service_pid("decode")}:
                    return
            except Exception:  # noqa: BLE001 - the bus may still be coming back
                pass
        time.sleep(0.2)
    raise AssertionError(f"not every service came back:\n{mesh.log.read_text()[-3000:]}")


def _no_seat_held(mesh: Mesh, deadline: float) -> None:
    """Once the streams ended, the scheduler counts no request as assigned to any worker: a seat
    kept by an attempt that ended elsewhere would shrink the worker for good (and stall a model
    switch, which waits for its worker to have nothing assigned)."""
    seats = None
    while time.monotonic() < deadline:
        try:
            seats = {w["id"]: w["assigned"] for w in mesh.ask("scheduler.status")["workers"]}
            if not any(seats.values()):
                return
        except Exception:  # noqa: BLE001 - the bus may still be coming back
            pass
        time.sleep(0.2)
    raise AssertionError(f"seats still held after every stream ended: {seats}")


@pytest.mark.parametrize("service", ["prefill", "decode", "model-loader", "scheduler", "kv-pool", "nats-server",
                                     "gateway"])
def test_kill9_mid_load_loses_nothing(mesh, reference, service):
    _all_back(mesh, time.monotonic() + RECOVERY_S)
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=90, max_retries=0)
    received = [0] * len(PROMPTS)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        futures = [ex.submit(_stream, client, mesh.model, p, received, i) for i, p in enumerate(PROMPTS)]
        wait_streams_started(received)
        pid = mesh.service_pid(service)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        at_kill = list(received)
        outcomes = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - killed < 100, "a stream hung"
    assert min(at_kill) < MAX_TOKENS / 2, f"the kill came late: {at_kill} chunks received"
    clear = ("error", "connection") if service == "gateway" else ("error",)
    for (kind, text), want in zip(outcomes, reference):
        assert kind in ("ok", *clear), f"{service}: a stream ended {kind}: {text!r}\n{mesh.log.read_text()[-6000:]}"
        if kind == "ok":
            assert text == want, f"{service}: a stream's text differs from an undisturbed run"
    TIMES[service] = _serves(mesh, reference[0], killed + RECOVERY_S) - killed
    _no_seat_held(mesh, time.monotonic() + 30)
    _tally(f"kill -9 {service}", outcomes, reference)
    TIMES[f"kill -9 {service}"] = TIMES[service]
    print(f"{service}: {[k for k, _ in outcomes]}, serving again {TIMES[service]:.2f}s after the kill")
    # The launcher restarts it after its backoff: the mesh may serve again before that (a decode
    # worker prefills its own prompts), and a child between fork and exec has no `serve` argv yet.
    deadline = killed + RECOVERY_S
    while mesh.service_pid(service) in (None, pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mesh.service_pid(service) not in (None, pid), "the launcher did not start it again"
    assert mesh.proc.poll() is None


def _holders(mesh: Mesh) -> dict[str, set[str]]:
    """Per KV arena of the node, the workers holding blocks of it."""
    return {k: set(a["holders"]) for k, a in mesh.ask("kv.node0.status")["arenas"].items()}


def test_a_nats_outage_longer_than_the_worker_timeout_is_no_workers_death(mesh, reference):
    """The nats-server stays down twice --worker-timeout (the launcher frozen so that it does not
    restart it). Every service heard nothing meanwhile, yet nobody died: the kv-pool must not take
    back the workers' blocks (they still write into them), nor retire the arena, nor the scheduler
    re-dispatch their requests; the streams go on where they were, with the undisturbed text."""
    _all_back(mesh, time.monotonic() + RECOVERY_S)
    before, start = _holders(mesh), len(mesh.log.read_bytes())
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=90, max_retries=0)
    received = [0] * len(PROMPTS)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        futures = [ex.submit(_stream, client, mesh.model, p, received, i) for i, p in enumerate(PROMPTS)]
        wait_streams_started(received)
        os.kill(mesh.proc.pid, signal.SIGSTOP)
        try:
            os.kill(mesh.service_pid("nats-server"), signal.SIGKILL)
            down = time.monotonic()
            time.sleep(2 * WORKER_TIMEOUT_S)  # the fault itself: an outage this long
            at_restart = list(received)
        finally:
            os.kill(mesh.proc.pid, signal.SIGCONT)
        outcomes = [f.result(timeout=120) for f in futures]
    _tally("nats-server down 2x the worker timeout", outcomes, reference)
    TIMES["nats-server down 2x the worker timeout"] = _serves(mesh, reference[0], down + RECOVERY_S) - down
    assert min(at_restart) < MAX_TOKENS / 2, f"the outage came late: {at_restart} chunks received"
    log = mesh.log.read_bytes()[start:].decode(errors="replace")
    assert "silent for" not in log, log[-4000:]  # no worker declared dead, no blocks reclaimed
    assert "retired" not in log, log[-4000:]
    assert _holders(mesh) == before
    _no_seat_held(mesh, time.monotonic() + 30)
    for (kind, text), want in zip(outcomes, reference):
        assert (kind, text) == ("ok", want), f"a stream ended {kind}: {text[:200]!r}\n{log[-4000:]}"


async def _drop_first_attempts(mesh: Mesh, workers: list[str], resubmitted: set[str], stop: asyncio.Event) -> None:
    """Watches the token chunks on the bus; every worker drops attempt 0 of each request streamed,
    without a word to anyone: what a message lost on the way would leave (the scheduler and the
    gateway still think it runs). Again every 5 ms until the request streams as a later attempt
    (`resubmitted`), so one in a handoff is dropped where it lands."""
    import nats

    from meshserve.shared.schemas import Abort, TokenChunk
    from meshserve.shared.subjects import Subjects

    names = Subjects(mesh.namespace)
    subjects = [names.worker(w, "abort") for w in workers]
    dropping: set[str] = set()

    async def on_chunk(msg):
        c = TokenChunk.decode(msg.data)
        (resubmitted if c.attempt > 0 else dropping).add(c.request_id)

    nc = await nats.connect(mesh.nats_url, **mesh.nats_options())
    try:
        await nc.subscribe(names.tokens("*"), cb=on_chunk)  # every gateway's
        while not stop.is_set():
            for rid in dropping - resubmitted:
                for subject in subjects:
                    await nc.publish(subject, Abort(request_id=rid, reason="dropped", attempt=0).encode())
            await asyncio.sleep(0.005)
    finally:
        await nc.close()


def test_a_request_lost_without_a_word_is_submitted_again(tiny_llama, tmp_path):
    """Whoever holds a request without streaming its tokens says so every KEEPALIVE_S (here 1 s),
    so a gateway that hears nothing of one for STALL_S knows it was lost and re-submits it from
    the tokens sent: the request goes on to the undisturbed text instead of waiting for the
    no-token timeout (300 s) and failing."""
    import threading

    llm = LLM(str(tiny_llama), "float32")
    tokens = 200
    want = [llm.generate([p], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0].text
            for p in PROMPTS]
    with Mesh(tiny_llama, tmp_path, prefill=1, decode=1, env={"MESHSERVE_KEEPALIVE_S": "1"}) as mesh:
        workers = [w["id"] for w in mesh.ask("scheduler.status")["workers"]]
        resubmitted: set[str] = set()
        loop, stop = asyncio.new_event_loop(), asyncio.Event()
        watching = threading.Thread(target=loop.run_until_complete,
                                    args=(_drop_first_attempts(mesh, workers, resubmitted, stop),))
        watching.start()
        try:
            client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=60, max_retries=0)
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
                outcomes = list(ex.map(lambda p: client.completions.create(
                    model=mesh.model, prompt=p, max_tokens=tokens, temperature=0,
                    extra_body={"ignore_eos": True}), PROMPTS))
        finally:
            loop.call_soon_threadsafe(stop.set)
            watching.join()
            loop.close()
        log = mesh.log.read_text()
        for out, ref in zip(outcomes, want):
            rid = out.id.split("-", 1)[1]
            assert rid in resubmitted and f"request {rid}: nothing heard of it" in log, log[-4000:]
            assert out.choices[0].text == ref


def test_a_request_sent_to_a_frozen_scheduler_is_served_by_its_replacement(mesh, reference):
    """The scheduler stops answering (SIGSTOP: its connection stays open, so the submission is
    delivered and never answered), then dies. The gateway's submission times out; the request must
    not fail with a 503 but go again, as a new attempt, to the restarted scheduler."""
    _all_back(mesh, time.monotonic() + RECOVERY_S)
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=90, max_retries=0)
    pid = mesh.service_pid("scheduler")
    os.kill(pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            future = ex.submit(client.completions.create, model=mesh.model, prompt=PROMPTS[1],
                               max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
            deadline = time.monotonic() + 30
            while "sending it again as attempt 1" not in mesh.log.read_text() and time.monotonic() < deadline:
                assert not future.done(), future.result()
                time.sleep(0.1)
            assert "sending it again as attempt 1" in mesh.log.read_text(), mesh.log.read_text()[-3000:]
            os.kill(pid, signal.SIGKILL)
            assert future.result(timeout=80).choices[0].text == reference[1]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _all_back(mesh, time.monotonic() + RECOVERY_S)


def test_sigterm_rolling_restart_loses_nothing(mesh, reference):
    """SIGTERM to each worker in turn, mid-load: it takes nothing new, hands its sequences on (or
    finishes those nobody else can take), exits cleanly and the launcher starts it again at once.
    Unlike kill -9, no stream may end with an error."""
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=90, max_retries=0)
    for service in ("prefill", "decode"):
        _all_back(mesh, time.monotonic() + RECOVERY_S)
        received = [0] * len(PROMPTS)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
            futures = [ex.submit(_stream, client, mesh.model, p, received, i) for i, p in enumerate(PROMPTS)]
            wait_streams_started(received)
            pid = mesh.service_pid(service)
            os.kill(pid, signal.SIGTERM)
            termed = time.monotonic()
            at_term = list(received)
            outcomes = [f.result(timeout=120) for f in futures]
        _tally(f"SIGTERM {service}", outcomes, reference)
        assert min(at_term) < MAX_TOKENS / 2, f"the SIGTERM came late: {at_term} chunks received"
        for (kind, text), want in zip(outcomes, reference):
            assert (kind, text) == ("ok", want), f"{service}: a stream ended {kind}: {text[:200]!r}"
        deadline = time.monotonic() + RECOVERY_S
        while mesh.service_pid(service) in (None, pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mesh.service_pid(service) not in (None, pid), "the launcher did not start it again"
        _all_back(mesh, deadline)  # the new worker heard: what "serving again" is for a drained worker
        TIMES[f"SIGTERM {service}"] = time.monotonic() - termed
        log = mesh.log.read_text()
        assert f"{service}-0 exited cleanly" in log  # drained: not counted as a failure
        assert " drained" in log and "left to be re-dispatched" not in log


def test_launcher_restarts_with_backoff_then_gives_up(monkeypatch, tmp_path):
    """A child that keeps dying at once is restarted RESTART_LIMIT times, then the launcher gives up
    saying why; one that ran long enough starts a fresh count."""
    import argparse

    from meshserve.cli import launcher

    monkeypatch.setattr(launcher, "BACKOFF_S", (0.01, 0.02))
    la = launcher.Launcher(argparse.Namespace())
    try:
        la.spawn("flaky", [sys.executable, "-c", "raise SystemExit(3)"])
        deadline = time.monotonic() + 30
        with pytest.raises(launcher.GiveUp, match="flaky exited with code 3 6 times in a row"):
            while time.monotonic() < deadline:
                la.supervise()
                time.sleep(0.01)
        assert la.restart_counts()["flaky"] == launcher.RESTART_LIMIT
    finally:
        la.stop(grace=5)
