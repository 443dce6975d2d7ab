"""Node-level compute priority (services/worker/compute_claims.py): the pure decision (class
comparison, lease expiry, the bound on a run of waits, fcfs and the off switch, cores), the NATS
side on a real nats-server (a wait ends with the claim's end message or a dead claimant's lease,
not at its bound; a live claim is refreshed), and a real `meshserve up` of one prefill and one
decode worker: while interactive prompts are prefilled, the decode worker running background
streams holds its steps back, and every stream's greedy text equals an undisturbed run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import subprocess
import threading
import time

import httpx
import pytest

from mesh_util import Mesh, free_port
from meshserve.services.worker.compute_claims import LEASE_S, ClaimTable, ComputeClaims
from meshserve.shared.schemas import ComputeClaim

L1, L2, L3 = 0, 1, 2


# -- the decision, pure

def test_a_claim_holds_back_only_steps_of_a_lower_class():
    t = ClaimTable(max_yield_s=1.0)
    assert t.wait_until(L3, (), now=0.0) is None  # no claim
    t.claim("prefill", L1, expires=5.0)
    assert t.wait_until(L1, (), now=0.0) is None  # a step with interactive sequences never waits
    assert t.wait_until(L2, (), now=0.0) == 1.0  # normal and background wait, up to the bound
    assert t.wait_until(L3, (), now=0.1) == 1.0
    assert t.wait_until(None, (), now=0.1) is None  # nothing to run
    t.release("prefill")
    assert t.wait_until(L3, (), now=0.2) is None
    t.stepped()
    t.claim("other", L2, expires=5.0)  # a claim of class normal holds back background only
    assert t.wait_until(L2, (), now=0.3) is None
    assert t.wait_until(L3, (), now=0.3) == pytest.approx(1.3)


def test_an_interactive_claim_elsewhere_on_the_cores_is_seen():
    """What a worker's guard reads (another worker claims the cores for interactive prompts):
    live, of that class, on overlapping cores."""
    t = ClaimTable()
    assert not t.claimed(L1, (), now=0.0)
    t.claim("w2", L1, expires=1.0, cores=(0,))
    assert t.claimed(L1, (), now=0.5) and t.claimed(L1, (0, 1), now=0.5) and not t.claimed(L2, (), now=0.5)
    assert not t.claimed(L1, (1,), now=0.5)  # other cores
    assert not t.claimed(L1, (), now=1.5)  # expired


def test_a_claim_not_refreshed_expires_by_itself():
    t = ClaimTable(max_yield_s=10.0)
    t.claim("dead", L1, expires=0.5)
    t.claim("alive", L1, expires=0.8)
    assert t.wait_until(L3, (), now=0.1) == 0.5  # the earliest moment the answer may change
    assert t.wait_until(L3, (), now=0.6) == 0.8  # one expired, the other still holds
    t.claim("alive", L1, expires=1.6)  # refreshed
    assert t.wait_until(L3, (), now=1.0) == 1.6
    assert t.wait_until(L3, (), now=1.7) is None
    assert t.claims == {}


def test_a_run_of_waits_is_bounded_then_one_step_runs_before_the_next_wait():
    t = ClaimTable(max_yield_s=1.0)
    t.claim("prefill", L1, expires=100.0)
    assert t.wait_until(L3, (), now=10.0) == 11.0
    assert t.wait_until(L3, (), now=10.7) == 11.0  # the same run: the bound does not move
    assert t.wait_until(L3, (), now=11.0) is None  # bound reached: the step runs
    assert t.wait_until(L3, (), now=11.2) is None  # ... and it is owed until it ran
    t.stepped()
    assert t.wait_until(L3, (), now=11.3) == pytest.approx(12.3)  # a new run


@pytest.mark.parametrize("table", [ClaimTable(scheduling="fcfs"), ClaimTable(enabled=False)], ids=["fcfs", "off"])
def test_nothing_waits_under_fcfs_or_when_turned_off(table):
    assert not table.enabled
    table.claim("prefill", L1, expires=100.0)
    assert table.wait_until(L3, (), now=0.0) is None


def test_only_workers_that_share_cores_yield_to_each_other():
    t = ClaimTable()
    t.claim("pinned", L1, expires=100.0, cores=[0, 1])
    assert t.wait_until(L3, [2, 3], now=0.0) is None  # its own cores (a manifest partition)
    assert t.wait_until(L3, [1, 2], now=0.0) is not None
    assert t.wait_until(L3, [], now=0.0) is not None  # cores unknown: the whole node
    t.claim("pinned", L1, expires=100.0, cores=[])
    assert t.wait_until(L3, [2, 3], now=0.0) is not None


# -- over a real nats-server

@pytest.fixture(scope="module")
def nats_url():
    from meshserve.cli.launcher import nats_server_binary

    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "not within the deadline"
        await asyncio.sleep(0.005)


def test_a_wait_ends_with_the_claim_and_a_live_claim_is_refreshed(nats_url):
    from meshserve.shared.bus import Bus

    async def go():
        buses = [await Bus.connect(nats_url, namespace="cc") for _ in range(3)]
        prefill = ComputeClaims(buses[0], "w.prefill-n0-1", "n0")
        decode = ComputeClaims(buses[1], "w.decode-n0-2", "n0", max_yield_s=30.0)
        elsewhere = ComputeClaims(buses[2], "w.decode-n1-3", "n1", max_yield_s=30.0)
        for c in (prefill, decode, elsewhere):
            await c.start()
        await buses[0].nc.flush()
        await prefill.hold(L1)
        await until(lambda: decode.wait_until(L3) is not None)
        assert elsewhere.wait_until(L3) is None  # another node's cores
        assert prefill.wait_until(L3) is None  # its own claim does not hold it back
        # Refreshed every REFRESH_S: still live well past one lease.
        t0 = time.monotonic()
        await asyncio.sleep(LEASE_S * 1.5)
        waiter = asyncio.ensure_future(decode.wait(L3, asyncio.Event()))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await prefill.hold(None)  # the end message wakes it, long before its 30 s bound
        await asyncio.wait_for(waiter, 2.0)
        assert decode.wait_until(L3) is None
        assert decode.yields == 1 and 0.04 < decode.yield_s < time.monotonic() - t0
        # The worker's own inbox wakes it too.
        await prefill.hold(L1)
        await until(lambda: decode.wait_until(L3) is not None)
        wake = asyncio.Event()
        waiter = asyncio.ensure_future(decode.wait(L3, wake))
        await asyncio.sleep(0.05)
        wake.set()
        await asyncio.wait_for(waiter, 1.0)
        assert decode.yields == 1  # the same run of waits: no step ran in between
        decode.stepped()
        await prefill.close()
        for b in buses:
            await b.close()
    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_dead_workers_claim_expires_within_its_lease(nats_url):
    from meshserve.shared.bus import Bus

    async def go():
        dead, live = await Bus.connect(nats_url, namespace="cc"), await Bus.connect(nats_url, namespace="cc")
        decode = ComputeClaims(live, "w.decode-n0-2", "n0", max_yield_s=30.0)
        await decode.start()
        await live.nc.flush()
        # A claim announced once, then its worker died: no refresh, no end. The lease is long enough
        # for a loaded machine to see the claim before it expires; it runs from the claim's arrival,
        # before it is seen, so the wait ends within a lease of seeing it, long before max_yield_s.
        lease = 2.0
        deadline = time.monotonic() + 20
        while decode.wait_until(L3) is None:  # announced until seen (a loaded machine once missed the
            assert time.monotonic() < deadline  # first within 5 s), then never again: it died
            await dead.publish(dead.subjects.compute("claim", "n0"),
                               ComputeClaim(worker_id="w.prefill-n0-9", lease_s=lease))
            try:
                await until(lambda: decode.wait_until(L3) is not None, timeout=0.5)
            except AssertionError:
                continue
        seen = time.monotonic()
        await asyncio.wait_for(decode.wait(L3, asyncio.Event()), 2 * lease)
        assert time.monotonic() - seen < lease + 0.5
        assert decode.wait_until(L3) is None
        for b in (dead, live):
            await b.close()
    asyncio.run(asyncio.wait_for(go(), 30))


# -- through the mesh

def _series(metrics: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^{name}\{{[^}}]*worker="([^"]+)"[^}}]*\}} (\S+)$', metrics, re.M)}


def test_mesh_decode_worker_yields_while_interactive_prompts_are_prefilled(tiny_llama, tmp_path):
    """One prefill and one decode worker on one node, steps of at most 8 tokens (so an interactive
    prompt takes many prefill steps): background streams decode on the decode worker while
    interactive prompts are prefilled. The decode worker held its steps back (metric > 0), the
    prefill worker never did, no claim is left, and every text equals an undisturbed greedy run."""
    from openai import OpenAI

    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    background = ["The quick brown fox", "Hello world! Hello there", "def add(a, b):"]
    interactive = [" ".join(f"{w} {i}" for w in ("alpha", "beta", "gamma", "delta", "river")) * 4 for i in range(3)]
    mesh = Mesh(tiny_llama, tmp_path, prefill=1, decode=1, extra=["--max-num-batched-tokens", "8"]).wait_ready()
    try:
        client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        started = [0] * len(background)
        busy = [False] * len(background)  # a background stream of that client is under way
        stop = threading.Event()

        def one(prompt, n, priority, i=None):
            text = ""
            for c in client.completions.create(model=mesh.model, prompt=prompt, max_tokens=n, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True, "priority": priority}):
                text += c.choices[0].text if c.choices else ""
                if i is not None:
                    started[i] += 1
            return text

        def background_client(i):
            """Streams its prompt again and again until the interactive requests are done, so the
            decode worker has sequences to hold back whatever the machine's speed."""
            done = []
            while not done or not stop.is_set():
                busy[i] = True
                done.append(one(background[i], 200, "background", i))
                busy[i] = False
            return done

        with concurrent.futures.ThreadPoolExecutor(len(background)) as ex:
            bg = [ex.submit(background_client, i) for i in range(len(background))]
            deadline = time.monotonic() + 60
            while min(started) < 2 and time.monotonic() < deadline:  # every stream decodes
                time.sleep(0.005)
            inter = [one(interactive[0], 4, "interactive")]
            running = sum(busy)
            inter += [one(p, 4, "interactive") for p in interactive[1:]]  # one after another
            stop.set()
            texts = [f.result(timeout=120) for f in bg]
        assert running, "the background streams ended before an interactive prompt was prefilled: nothing to yield"
        deadline, workers = time.monotonic() + 10, []
        while time.monotonic() < deadline:  # the heartbeats carry the counters (every 0.5 s)
            workers = httpx.get(mesh.url + "/health", timeout=5).json()["scheduler"]["workers"]
            if any(w["compute_yields"] for w in workers) and not any(w["compute_claim"] for w in workers):
                break
            time.sleep(0.1)
        by_role = {w["role"]: w for w in workers}
        assert by_role["decode"]["compute_yields"] >= 1, workers
        assert by_role["prefill"]["compute_yields"] == 0 and not any(w["compute_claim"] for w in workers), workers
        metrics = httpx.get(mesh.url + "/metrics", timeout=5).text
        assert _series(metrics, "meshserve:compute_yields_total")[by_role["decode"]["id"]] >= 1
        assert _series(metrics, "meshserve:compute_yield_seconds_total")[by_role["decode"]["id"]] > 0
        assert set(_series(metrics, "meshserve:interrupted_steps_total")) == {w["id"] for w in workers}
    finally:
        mesh.stop()
    llm = LLM(str(tiny_llama), "float32")
    want = [c.text for c in llm.generate(background + interactive,
                                         [SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)] * 3
                                         + [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 3)]
    assert all(set(runs) == {w} for runs, w in zip(texts, want)) and inter == want[3:]
