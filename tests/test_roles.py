"""The elastic-roles policy (services/scheduler/roles.py) on its own: targets, hysteresis, hold,
cooldown, and the floor of one decode worker."""

from __future__ import annotations

from hypothesis import given, strategies as st

from meshserve.services.scheduler.roles import ElasticRoles, Load, RolePolicy, target_prefill_workers, wanted

POLICY = RolePolicy(decode_token_cost=8.0, min_work=1000.0, hysteresis=0.25, hold_s=0.5, cooldown_s=2.0)


def node(roles: str, prefill: list[int], decode: list[int]) -> list[Load]:
    """roles like "PD": one prefill and one decode worker; per-worker pending tokens."""
    return [Load(f"w{i}", {"P": "prefill", "D": "decode"}[r], p, d) for i, (r, p, d) in
            enumerate(zip(roles, prefill, decode))]


def test_target_splits_by_weighted_work():
    assert target_prefill_workers(0, 100, 4, POLICY) == 0.0
    assert target_prefill_workers(800, 100, 4, POLICY) == 2.0  # equal work: half the workers
    assert target_prefill_workers(10_000, 0, 4, POLICY) == 3.0  # never all: one decodes
    assert target_prefill_workers(0, 0, 4, POLICY) == 0.0


def test_decode_heavy_switches_a_prefill_worker_and_keeps_a_decoder():
    s = wanted(node("PD", [0, 0], [40, 400]), POLICY)
    assert s is not None and (s.worker_id, s.from_role, s.to_role) == ("w0", "prefill", "decode")
    assert "pending prefill 0 tokens" in s.reason
    # Prefill-heavy with one decoder: it stays (nothing would decode).
    assert wanted(node("PD", [5000, 0], [5, 0]), POLICY) is None


def test_prefill_heavy_switches_the_least_busy_decoder():
    loads = [Load("a", "decode", 3000, 10, num_running=5), Load("b", "decode", 0, 10, num_running=1)]
    s = wanted(loads, POLICY)
    assert s is not None and (s.worker_id, s.to_role) == ("b", "prefill")


def test_hysteresis_band_and_light_traffic():
    # 1P:1D. The target must leave [1 - 0.75, 1 + 0.75] to move: just inside the band, nothing.
    p, d = 150, 100  # target = 2 * 150 / 950 = 0.32 > 0.25
    assert wanted(node("PD", [p, 0], [0, d]), POLICY) is None
    assert wanted(node("PD", [100, 0], [0, 200]), POLICY) is not None  # 2*100/1700 = 0.12 < 0.25
    # 0P:2D back to 1P needs a target above 0.75, not merely above 0.5.
    assert wanted(node("DD", [600, 0], [0, 100]), POLICY) is not None  # 2*600/1400 = 0.86 > 0.75
    assert wanted(node("DD", [300, 0], [0, 100]), POLICY) is None  # 2*300/1100 = 0.55: inside the band
    # Below min_work, even a lopsided node stays.
    assert wanted(node("PD", [0, 0], [0, 100]), POLICY) is None


def test_hold_and_cooldown_prevent_flapping():
    roles = ElasticRoles(POLICY)
    heavy_decode = node("PDD", [0, 0, 0], [0, 300, 300])
    assert roles.observe("n", heavy_decode, now=0.0) is None  # a wish, not yet held
    assert roles.observe("n", heavy_decode, now=0.3) is None
    s = roles.observe("n", heavy_decode, now=0.6)
    assert s is not None and s.to_role == "decode"
    assert roles.role_of("w0", "prefill") == "decode"  # routed as a decoder at once
    assert roles.observe("n", heavy_decode, now=5.0) is None  # in flight: nothing else on the node
    assert roles.reported("n", "w0", "prefill", now=0.7) is None  # an old heartbeat
    assert roles.reported("n", "w0", "decode", now=0.8) == s and roles.switches == 1
    assert roles.history[-1]["seconds"] == 0.2 and roles.history[-1]["reason"] == s.reason
    heavy_prefill = [Load("w0", "decode", 9000, 0), Load("w1", "decode", 0, 10), Load("w2", "decode", 0, 10)]
    for t in (1.0, 1.6, 2.4):  # held, but within the cooldown after the switch at 0.8
        assert roles.observe("n", heavy_prefill, now=t) is None
    assert roles.observe("n", heavy_prefill, now=2.9) is None  # cooled down (2.8): the wish starts afresh
    s = roles.observe("n", heavy_prefill, now=3.4)
    assert s is not None and (s.worker_id, s.to_role) == ("w0", "prefill")  # the least decode work


def test_fixed_roles_never_switch():
    roles = ElasticRoles(POLICY, enabled=False)
    loads = node("PD", [0, 0], [0, 5000])
    assert all(roles.observe("n", loads, now=t) is None for t in (0, 1, 2, 3))


def test_unconfirmed_switch_is_given_up():
    roles = ElasticRoles(POLICY)
    loads = node("PD", [0, 0], [0, 5000])
    roles.observe("n", loads, now=0.0)
    assert roles.observe("n", loads, now=0.6) is not None
    assert roles.role_of("w0", "prefill") == "decode"
    roles.observe("n", loads, now=0.6 + POLICY.switch_timeout_s + 0.1)
    assert roles.role_of("w0", "prefill") == "prefill"


@given(st.lists(st.tuples(st.sampled_from("PD"), st.integers(0, 20_000), st.integers(0, 2_000)),
                min_size=1, max_size=6))
def test_never_zero_decoders_and_prefill_demand_keeps_a_prefill_capable_worker(ws):
    loads = [Load(f"w{i}", {"P": "prefill", "D": "decode"}[r], p, d) for i, (r, p, d) in enumerate(ws)]
    s = wanted(loads, POLICY)
    if s is None:
        return
    after = [w.role if w.worker_id != s.worker_id else s.to_role for w in loads]
    assert s.from_role != s.to_role and len(loads) >= 2
    assert after.count("decode") >= 1  # decode workers also prefill, so prompts always have a worker
    if s.to_role == "decode":  # only when the prompts' share of the work is small
        p, d = sum(w.pending_prefill_tokens for w in loads), sum(w.pending_decode_tokens for w in loads)
        assert target_prefill_workers(p, d, len(loads), POLICY) < after.count("prefill") + 1 - 0.5


def test_bench_roles_configurations_and_the_traffic_shift_workload():
    from meshserve.bench.roles_bench import configurations
    from meshserve.bench.workload import load_workload

    assert configurations(2) == [("elastic", 1, 1, True), ("fixed-0:2", 0, 2, False), ("fixed-1:1", 1, 1, False)]
    reqs = load_workload("traffic-shift").generate(vocab_size=1000, max_model_len=8192)
    first, second = [q for q in reqs if q.arrival < 24.0], [q for q in reqs if q.arrival >= 24.0]
    assert {q.cls for q in first} == {"prefill_heavy"} and {q.cls for q in second} == {"decode_heavy"}
    assert min(q.prompt_len for q in first) > 10 * max(q.prompt_len for q in second)
    assert max(q.output_len for q in first) * 10 < min(q.output_len for q in second)
