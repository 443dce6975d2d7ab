"""A model's worker count follows its traffic (issue 12, docs/models.md "Workers follow traffic").

The policy (services/scheduler/models.py: `rebalance`, `pick_donor`, `ModelTraffic`) on its own, by
example and with hypothesis: hysteresis, no flapping at a steady demand, the hold and the cooldown, a
worker's minimum time between switches, never a model with work (or pinned) left without a worker;
then once through a real mesh: three workers, two tiny models, traffic to the one with one worker
moves another to it, and every request's greedy text is the model's alone.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.services.scheduler.models import (NO_WORKER, TRAFFIC, Demand, ModelDemand, ModelTraffic, Move,
                                                 Placement, TrafficPolicy, model_work, pick_donor, pick_worker,
                                                 rebalance)
from meshserve.services.scheduler.roles import RolePolicy
from meshserve.services.scheduler.routing import WorkerView
from meshserve.shared.schemas import GenerateRequest, Heartbeat

POLICY = TrafficPolicy(margin=1.5, min_per_worker=1.0, window_s=5.0, hold_s=2.0, cooldown_s=5.0)


def m(name: str, demand: float, workers: int, keep: bool = True, movable: int | None = None, **kw) -> ModelDemand:
    return ModelDemand(name, demand, workers, workers if movable is None else movable, keep, **kw)


def test_the_busy_model_gets_a_worker_of_the_idle_one_within_the_margin():
    # 90% of the requests on a, two workers each: one of b's moves; then b keeps its last one.
    assert rebalance([m("a", 9, 2), m("b", 1, 2)], POLICY) == Move("b", "a", "a: 9.0 requests on 2 workers, "
                                                                             "b: 1.0 on 2")
    assert rebalance([m("a", 9, 3), m("b", 1, 1)], POLICY) is None
    # 75/25 at 2/2: 3.75 against 1.25 per worker, and after the move b's 2.5 on one is not above
    # 1.5 x a's 2.5 on three, so it would not come back: it moves.
    assert rebalance([m("a", 7.5, 2), m("b", 2.5, 2)], POLICY).dst == "a"
    # 60/40: within the margin, nothing moves.
    assert rebalance([m("a", 6, 2), m("b", 4, 2)], POLICY) is None
    # Light traffic moves nothing: a's workers would hold fewer than one request each.
    assert rebalance([m("a", 1.5, 1), m("b", 0, 2, keep=False)], POLICY) is None
    assert rebalance([m("a", 2.0, 1), m("b", 0, 2, keep=False)], POLICY) == Move("b", "a", "a: 2.0 requests on 1 "
                                                                                       "workers, b: 0.0 on 2")
    # Of two donors, the one with the least demand per worker; of two takers, the busiest per worker.
    got = rebalance([m("a", 8, 1), m("b", 6, 1), m("c", 1, 2), m("d", 0, 2)], POLICY)
    assert (got.src, got.dst) == ("d", "a")


def test_a_model_with_work_or_pinned_keeps_its_last_worker_a_cold_one_does_not():
    assert rebalance([m("a", 4, 1), m("b", 0, 1, keep=True)], POLICY) is None  # running work, or pinned
    assert rebalance([m("a", 4, 1), m("b", 0, 1, keep=False)], POLICY).src == "b"  # cold: its worker goes
    # a model nothing may be given (a switch to it in flight, its loads failing) and one without
    # workers (the "no worker" path's) receive nothing; a donor without a movable worker gives nothing
    assert rebalance([m("a", 4, 1, receives=False), m("b", 0, 2)], POLICY) is None
    assert rebalance([m("a", 4, 0), m("b", 0, 2)], POLICY) is None
    assert rebalance([m("a", 4, 1), m("b", 0, 2, movable=0)], POLICY) is None


def test_work_not_the_count_of_requests_decides_which_model_is_busier():
    """Three long prompts outweigh twelve short chats: by requests b is the busier (6 per worker
    against 1.5), by the work they hold a is (4500 token-equivalents per worker against 1260), and
    the work decides; after the move the same rule would not move it back."""
    a, b = m("a", 3, 2, work=9000.0), m("b", 12, 2, work=2520.0)
    assert rebalance([m("a", 3, 2), m("b", 12, 2)], POLICY).dst == "b"  # requests alone
    mv = rebalance([a, b], POLICY)
    assert (mv.src, mv.dst) == ("b", "a") and "9000 token-equivalents" in mv.reason
    assert rebalance([m("a", 3, 3, work=9000.0), m("b", 12, 1, work=2520.0)], POLICY) is None
    # However much work one sequence holds, it runs on one worker: a model is never given more
    # workers than it has requests.
    assert rebalance([m("a", 1, 1, work=50000.0), m("b", 0, 2, keep=False, work=0.0)], POLICY) is None
    assert rebalance([m("a", 2, 1, work=50000.0), m("b", 0, 2, keep=False, work=0.0)], POLICY).dst == "a"


def test_model_work_adds_what_workers_report_to_what_no_worker_holds():
    ws = [hb("w0", "a", pending_prefill_tokens=100, pending_decode_tokens=10),
          hb("w1", "a", pending_prefill_tokens=0, pending_decode_tokens=5), hb("w2", "b")]

    def req(model, prompt, out, max_tokens):
        return GenerateRequest(request_id=f"{model}{prompt}", model=model, prompt_token_ids=list(range(prompt)),
                               output_token_ids=list(range(out)), sampling={"max_tokens": max_tokens},
                               stream_subject="s", arrival_time=0.0)

    got = model_work(ws, [req("a", 30, 0, 4), req("c", 7, 2, 3)], RolePolicy(decode_token_cost=8.0))
    assert got == {"a": 100 + 8 * 10 + 8 * 5 + 30 + 8 * 4, "b": 0.0, "c": 9 + 8 * 1}
    # Rates the model's workers measured: an output token of a weighs 2000 / 100 = 20 prompt tokens.
    ws[0].hb = ws[0].hb.model_copy(update={"prefill_tokens_per_s": 2000.0, "decode_tokens_per_s": 100.0})
    got = model_work(ws, [req("a", 30, 0, 4)], RolePolicy(decode_token_cost=8.0))
    assert got == {"a": 100 + 20 * 10 + 20 * 5 + 30 + 20 * 4, "b": 0.0}


def assert_settles(models: list[ModelDemand]) -> None:
    """Applying the moves one after another under a fixed load ends, never revisits a placement (no
    flapping), never takes a keeping model's last worker, never gives a model more workers than its
    requests, and never undoes the last move."""
    seen, last = set(), None
    for _ in range(sum(x.workers for x in models) * len(models) + 1):
        placement = tuple(x.workers for x in models)
        assert placement not in seen
        seen.add(placement)
        mv = rebalance(models, POLICY)
        if mv is None:
            return
        assert last is None or (mv.src, mv.dst) != (last.dst, last.src)
        src, dst = (next(x for x in models if x.name == n) for n in (mv.src, mv.dst))
        assert dst.workers >= 1 and src.workers >= (2 if src.keep else 1)
        assert dst.demand / (dst.workers + 1) >= POLICY.min_per_worker
        models = [m(x.name, x.demand, x.workers + (x is dst) - (x is src), x.keep, work=x.work) for x in models]
        last = mv
    raise AssertionError(f"no end to the moves from {models}")


demands = st.lists(st.tuples(st.floats(0, 50, allow_nan=False), st.integers(0, 5), st.booleans()), min_size=1,
                   max_size=5)
work_demands = st.lists(st.tuples(st.floats(0, 50, allow_nan=False), st.floats(0, 5e4, allow_nan=False),
                                  st.integers(0, 5), st.booleans()), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(demands)
def test_steady_demand_settles_without_flapping_or_stranding(ms):
    assert_settles([m(f"m{i}", d, n, keep) for i, (d, n, keep) in enumerate(ms)])


@settings(max_examples=300, deadline=None)
@given(work_demands)
def test_steady_work_settles_without_flapping_or_stranding(ms):
    """As with requests alone, when the work decides and the requests bound the receiver."""
    assert_settles([m(f"m{i}", d, n, keep, work=w) for i, (d, w, n, keep) in enumerate(ms)])


def test_hold_cooldown_and_one_move_at_a_time():
    t = ModelTraffic(POLICY)
    busy = [m("a", 9, 2), m("b", 1, 2)]
    assert t.observe(busy, False, now=0.0) is None  # a wish, not yet held
    assert t.observe(busy, False, now=1.0) is None
    assert t.observe(busy, False, now=2.0).dst == "a"
    assert t.observe(busy, True, now=3.0) is None  # that move still runs (it ends by 4.0)
    for now in (4.0, 5.0, 7.5):  # held afresh, but within the cooldown after it
        assert t.observe(busy, False, now=now) is None
    assert t.observe(busy, False, now=8.0) is None  # cooled down: the wish starts again
    assert t.observe(busy, False, now=10.0) is not None
    # A wish that changes or goes away starts over.
    t = ModelTraffic(POLICY)
    assert t.observe(busy, False, now=0.0) is None
    assert t.observe([m("a", 1, 2), m("b", 1, 2)], False, now=1.0) is None
    assert t.observe(busy, False, now=2.5) is None
    assert t.observe(busy, False, now=4.5) is not None
    off = ModelTraffic(POLICY, enabled=False)
    assert all(off.observe(busy, False, now=x) is None for x in (0.0, 3.0, 9.0))


def test_the_traffic_policy_is_set_by_key_and_a_bad_one_is_refused():
    import argparse

    import pytest

    from meshserve.services.scheduler.main import traffic_policy

    p = TrafficPolicy.parse("margin=2, hold_s=5,cooldown_s=0")
    assert (p.margin, p.hold_s, p.cooldown_s, p.window_s) == (2.0, 5.0, 0.0, TrafficPolicy().window_s)
    assert TrafficPolicy.parse("") == TrafficPolicy()
    for bad, why in (("margin=1", "above 1"), ("hold_s=-1", ">= 0"), ("hold=2", "key one of margin"),
                     ("margin", "key=value"), ("window_s=soon", "not a number"), ("amortize=inf", ">= 0")):
        with pytest.raises(ValueError, match=why):
            TrafficPolicy.parse(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="above 1"):
        traffic_policy("margin=0.5")
    # the hold and the cooldown it sets are the ones observed: a wish seen twice moves at once
    busy = [m("a", 9, 2), m("b", 1, 2)]
    for policy, moves in ((TrafficPolicy.parse("hold_s=0,cooldown_s=0"), [None, "a", None, "a"]),
                          (TrafficPolicy(), [None] * 4)):
        t = ModelTraffic(policy)
        assert [getattr(t.observe(busy, False, now=x), "dst", None) for x in (0.0, 0.1, 0.2, 0.3)] == moves


def test_demand_is_a_moving_average_from_zero():
    d = Demand(window_s=5.0)
    d.observe({"a": 4}, now=0.0)
    assert d.get("a") == 0.0  # the first round only starts the clock
    d.observe({"a": 4}, now=5.0)
    assert abs(d.get("a") - 4 * (1 - 2.718281828 ** -1)) < 1e-6
    for t in range(6, 60):
        d.observe({}, now=float(t))  # it ended: the level decays
    assert d.get("a") < 0.01 and d.get("never") == 0.0


def hb(wid, model, role="decode", node="n0", running=0, waiting=0, **kw) -> WorkerView:
    w = WorkerView(Heartbeat(worker_id=wid, role=role, model=model, node_id=node, num_running=running,
                             num_waiting=waiting, free_blocks=8, held_blocks=8, total_blocks=8, block_size=16,
                             max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, time=0.0, **kw))
    return w


def test_pick_donor_takes_the_idle_then_least_busy_and_keeps_a_decoder():
    ws = [hb("w0", "b", running=3), hb("w1", "b", running=1), hb("w2", "b"), hb("w3", "a")]
    assert pick_donor(ws, "b", set()).hb.worker_id == "w2"  # idle
    assert pick_donor(ws, "b", {"w2"}).hb.worker_id == "w1"  # just switched: the least busy other one
    assert pick_donor(ws, "b", {"w0", "w1", "w2"}) is None
    # the model's only decode worker stays while a prefill worker can go instead
    ws = [hb("p", "b", role="prefill", running=2), hb("d", "b")]
    assert pick_donor(ws, "b", set()).hb.worker_id == "p"
    # on a node that holds the receiving model in the hottest tier
    ws = [hb("x", "b", node="n0"), hb("y", "b", node="n1")]
    assert pick_donor(ws, "b", set(), {"n0": "disk", "n1": "mapped"}).hb.worker_id == "y"


def test_no_worker_switch_takes_a_busy_worker_only_of_a_model_that_keeps_another():
    ws = [hb("w0", "a", running=2), hb("w1", "b", running=1)]
    assert pick_worker(ws, {"c": 1}, {}, set()) is None  # each busy and its model's only one: c waits
    ws.append(hb("w2", "b", running=3))
    assert pick_worker(ws, {"c": 1}, {}, set()).hb.worker_id == "w1"  # b keeps w2; w1 has less to finish
    assert pick_worker(ws, {"c": 1}, {}, {"w1"}) is None  # w1 already switching: b's w2 is its last
    ws.append(hb("w3", "a"))
    assert pick_worker(ws, {"c": 1}, {}, set()).hb.worker_id == "w3"  # an idle one first, as before


def test_placement_keeps_reasons_and_a_failed_traffic_move_fails_nothing():
    p = Placement()
    p.start("w0", "a", TRAFFIC)
    assert p.traffic_in_flight()
    p.finished("w0", "a", "b", False, 0.5, None, "KV shape differs", detail="a: 4.0 requests on 1 workers")
    assert p.failure("a") is None and not p.traffic_in_flight()  # still served where it was
    assert "w0" in p.settling(POLICY)  # failed: it stays failed_stay_s
    assert "w0" not in p.settling(TrafficPolicy(failed_stay_s=0.0))
    p.start("w1", "c", NO_WORKER)
    p.finished("w1", "c", "b", False, 0.5, None, "SafetensorError")
    assert p.failure("c") == "SafetensorError"
    p.start("w1", "a", TRAFFIC)
    p.finished("w1", "a", "b", True, 0.2, "mapped", None, detail="x")
    assert p.by_reason == {TRAFFIC: 1} and p.switches == 1
    # A worker stays `amortize` times as long as its switch took, at least min_stay_s.
    assert POLICY.stay_s(0.2) == 2.0 and POLICY.stay_s(1.5) == 15.0 and POLICY.stay_s(None) == 30.0
    assert "w1" in p.settling(POLICY) and "w1" not in p.settling(TrafficPolicy(amortize=0.0, min_stay_s=0.0))
    assert [(h["reason"], h["ok"]) for h in p.history] == [(TRAFFIC, False), (NO_WORKER, False), (TRAFFIC, True)]


# -- through the mesh

PROMPTS = ["The quick brown fox", "Hello world", "Once upon a time", "What is the capital"]
TOKENS = 8


def test_traffic_to_one_model_moves_workers_to_it(tiny_llama, tmp_path_factory):
    from mesh_util import Mesh
    from openai import OpenAI
    from tiny_model import make_tiny_llama

    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    root = tmp_path_factory.mktemp("traffic")
    paths = {"alpha": tiny_llama, "beta": make_tiny_llama(root / "beta", seed=12, intermediate_size=96)}
    oracle = {n: [o.text for o in LLM(str(p), "float32").generate(PROMPTS, SamplingParams(max_tokens=TOKENS,
                                                                                          temperature=0))]
              for n, p in paths.items()}
    manifest = root / "models.yaml"
    manifest.write_text("".join(f"- {{name: {n}, path: '{p}'}}\n" for n, p in paths.items()))
    # Worker i starts on model i mod 2: alpha has two workers, beta one. Only beta is asked for.
    with Mesh(paths["alpha"], root, prefill=0, decode=3,
              extra=["--models", str(manifest), "--model-traffic-policy", "hold_s=1,cooldown_s=3"]) as mesh:
        policy = mesh.ask("scheduler.status")["model_traffic_policy"]
        assert (policy["hold_s"], policy["cooldown_s"], policy["margin"]) == (1.0, 3.0, 1.5), policy

        def workers() -> dict[str, int]:
            return {n: s["workers"] for n, s in mesh.ask("scheduler.status")["models"].items()}

        assert workers() == {"alpha": 2, "beta": 1}
        stop, got = threading.Event(), []

        def client(k: int) -> None:
            c = OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            i = k
            while not stop.is_set():
                r = c.completions.create(model="beta", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=TOKENS,
                                         temperature=0)
                got.append((i % len(PROMPTS), r.choices[0].text))
                i += 1

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(client, k) for k in range(4)]
            deadline = time.monotonic() + 60
            try:
                while workers()["beta"] < 2:  # the traffic moves one of alpha's workers to beta
                    assert time.monotonic() < deadline and not any(c.done() for c in clients), \
                        (mesh.ask("scheduler.status"), [c.exception() for c in clients if c.done()])
                    time.sleep(0.2)
            finally:
                stop.set()
            for c in clients:
                c.result()  # every request completed
        assert len(got) > 8 and all(text == oracle["beta"][i] for i, text in got), got
        status = mesh.ask("scheduler.status")
        moves = [s for s in status["recent_model_switches"] if s["reason"] == "traffic"]
        assert moves and all(s["ok"] and (s["from"], s["to"]) == ("alpha", "beta") for s in moves), status
        assert "beta:" in moves[0]["detail"] and status["model_switches_by_reason"]["traffic"] == len(moves)
        # alpha still answers with its own tokens (from its worker, or one that switches back to it)
        c = OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        texts = [c.completions.create(model="alpha", prompt=p, max_tokens=TOKENS, temperature=0).choices[0].text
                 for p in PROMPTS[:2]]
        assert texts == oracle["alpha"][:2]
        metrics = httpx.get(mesh.url + "/metrics", timeout=10).text
        n = re.search(r'^meshserve:model_switches_total\{[^}]*reason="traffic"[^}]*\} (\S+)$', metrics, re.M)
        assert n and float(n.group(1)) >= 1, metrics
