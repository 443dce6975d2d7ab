"""The elastic-roles policy (services/scheduler/roles.py) on its own: sharing against a split by
drain time, hysteresis, hold, cooldown, and the floor of one decode worker."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, strategies as st

from meshserve.services.scheduler.roles import (ElasticRoles, Load, RolePolicy, drain_time, split_score,
                                               target_prefill_workers, token_cost, wanted)

POLICY = RolePolicy(decode_token_cost=8.0, min_work=1000.0, split_worth=0.5, hysteresis=0.15, hold_s=0.5, cooldown_s=2.0)


def node(roles: str, prefill: list[int], decode: list[int]) -> list[Load]:
    """roles like "PD": one prefill and one decode worker; per-worker pending tokens."""
    return [Load(f"w{i}", {"P": "prefill", "D": "decode"}[r], p, d) for i, (r, p, d) in
            enumerate(zip(roles, prefill, decode))]


def test_sharing_drains_no_slower_and_a_split_is_taken_only_near_the_demands_proportion():
    # Sharing is work-conserving: never slower than any split, equal where the split fits the demand.
    for p, d in [(0, 100), (800, 100), (10_000, 0), (3000, 500), (123, 4567)]:
        assert all(drain_time(p, d, 4, 0, POLICY) <= drain_time(p, d, 4, k, POLICY) + 1e-9 for k in (1, 2, 3))
    assert drain_time(800, 100, 4, 2, POLICY) == drain_time(800, 100, 4, 0, POLICY) == 400
    assert target_prefill_workers(800, 100, 4, POLICY) == 2  # prompts and outputs in proportion: half
    assert target_prefill_workers(2400, 100, 4, POLICY) == 3  # three quarters prompts
    assert target_prefill_workers(10_000, 0, 4, POLICY) == 0  # only prompts: every worker prefills
    assert target_prefill_workers(0, 100, 4, POLICY) == 0  # only outputs: every worker decodes
    assert target_prefill_workers(0, 0, 4, POLICY) == 0
    # Two workers: a split drains max(P, 8D) against (P + 8D) / 2, credited by 0.5 x min / max.
    assert target_prefill_workers(1000, 100, 2, POLICY) == 1  # 1000 / 1.4 vs 900
    assert target_prefill_workers(1000, 75, 2, POLICY) == 1  # 1000 / 1.3 vs 800
    assert target_prefill_workers(1000, 65, 2, POLICY) == 0  # 1000 / 1.26 vs 760


def test_one_sided_traffic_shares_every_worker():
    # Decode-heavy: the prefill worker decodes (and prefills the short prompts), one decoder stays.
    s = wanted(node("PD", [0, 0], [40, 400]), POLICY)
    assert s is not None and (s.worker_id, s.from_role, s.to_role) == ("w0", "prefill", "decode")
    assert "pending prefill 0 tokens" in s.reason
    # Prefill-heavy: a batch of long prompts with nothing to decode goes on both workers too.
    s = wanted(node("PD", [5000, 0], [5, 0]), POLICY)
    assert s is not None and (s.worker_id, s.to_role) == ("w0", "decode")
    assert wanted(node("DD", [3000, 2000], [5, 0]), POLICY) is None


def test_mixed_traffic_splits_off_the_least_busy_decoder():
    loads = [Load("a", "decode", 3000, 200, num_running=5), Load("b", "decode", 0, 200, num_running=1)]
    s = wanted(loads, POLICY)  # P 3000 vs 8 x 400: in proportion
    assert s is not None and (s.worker_id, s.to_role) == ("b", "prefill")


def test_an_output_token_weighs_what_the_workers_measured():
    """The weight of an output token is the measured prefill rate over the measured decode rate
    (means over the workers that measured each), within bounds; 8 until both are known. The same
    pending work splits a node where output tokens are dear and shares it where they are cheap."""
    assert token_cost([], [], POLICY) == 8.0
    assert token_cost([3000.0, 0.0], [0.0, 0.0], POLICY) == 8.0  # no decode step measured yet
    assert token_cost([3000.0, 1000.0], [100.0, 0.0], POLICY) == 20.0
    assert token_cost([100.0], [1000.0], POLICY) == 1.0 and token_cost([1e6], [1.0], POLICY) == 64.0

    def measured(prefill_rate, decode_rate):
        return [Load("w0", "decode", 3000, 100, 2, 0, prefill_rate, decode_rate),
                Load("w1", "decode", 0, 100, 1, 0, prefill_rate, decode_rate)]

    # P 3000 against D 200: at the assumed 8 the prompts outweigh the outputs, both workers share;
    # where an output token measured 15 prompt tokens the two are in proportion, one worker splits
    # off to prefill; where it costs 2 (a GPU-like machine) they share again.
    assert wanted(measured(0.0, 0.0), POLICY) is None
    s = wanted(measured(3000.0, 200.0), POLICY)
    assert s is not None and s.to_role == "prefill" and "x 15:" in s.reason
    assert wanted(measured(20000.0, 10000.0), POLICY) is None


def test_hysteresis_and_light_traffic():
    # 0P:2D with P = 1000: a split wins once 8D is near enough P, with a margin of 15% on the score.
    for d, moves in [(125, True), (100, True), (90, True), (80, False), (60, False)]:
        s = wanted(node("DD", [1000, 0], [0, d]), POLICY)
        assert (s is not None) == moves, d
        gain = split_score(1000, d, 2, 0, POLICY) / split_score(1000, d, 2, 1, POLICY)
        assert (gain > 1.15) == moves
    # 1P:1D stays split while sharing would not gain 15% on the score.
    assert wanted(node("PD", [1000, 0], [0, 60]), POLICY) is None
    assert wanted(node("PD", [1000, 0], [0, 40]), POLICY) is not None
    # Below min_work, even a lopsided node stays.
    assert wanted(node("PD", [0, 0], [0, 100]), POLICY) is None


def test_interactive_requests_beside_long_prompts_keep_a_prefill_worker():
    # A batch of long prompts, nothing to decode: shared, unless interactive requests are on the node.
    assert wanted(node("PD", [5000, 0], [5, 0]), POLICY) is not None
    assert wanted(node("PD", [5000, 0], [5, 0]), POLICY, interactive=True) is None
    s = wanted(node("DD", [3000, 2000], [5, 0]), POLICY, interactive=True)
    assert s is not None and s.to_role == "prefill" and "interactive" in s.reason
    # Interactive chat with short prompts (under min_work of them): roles follow the demand as before.
    s = wanted(node("PD", [200, 0], [0, 400]), POLICY, interactive=True)
    assert s is not None and s.to_role == "decode"
    # ElasticRoles remembers the node's interactive requests for interactive_window_s.
    roles = ElasticRoles(POLICY)
    seen = [Load("w0", "prefill", 5000, 0), Load("w1", "decode", 0, 5, interactive=1)]
    batch = [Load("w0", "prefill", 5000, 0), Load("w1", "decode", 0, 5)]
    assert roles.observe("n", seen, now=0.0) is None
    assert all(roles.observe("n", batch, now=t) is None for t in (0.6, 3.0, 6.0, 9.9))
    assert roles.observe("n", batch, now=10.1) is None  # the window has passed: a wish, held from here
    s = roles.observe("n", batch, now=10.7)
    assert s is not None and (s.worker_id, s.to_role) == ("w0", "decode")


def test_hold_and_cooldown_prevent_flapping():
    roles = ElasticRoles(replace(POLICY, smooth_s=0.01))  # each observation as it is: the timing alone
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
    mixed = [Load("w0", "decode", 9000, 0), Load("w1", "decode", 0, 300), Load("w2", "decode", 0, 300)]
    for t in (1.0, 1.6, 2.4):  # held, but within the cooldown after the switch at 0.8
        assert roles.observe("n", mixed, now=t) is None
    assert roles.observe("n", mixed, now=2.9) is None  # cooled down (2.8): the wish starts afresh
    s = roles.observe("n", mixed, now=3.4)
    assert s is not None and (s.worker_id, s.to_role) == ("w0", "prefill")  # the least decode work


def test_the_policy_weighs_pending_tokens_averaged_not_single_heartbeats():
    """Pending prompt tokens sampled many times a second swing between none and a batch's worth (a
    tiny model prefills a prompt in a step). In proportion on average, they ask for a split; a
    decision on single samples would need a run of in-band samples as long as the hold."""
    swing = [node("DD", [0, p], [0, d]) for p, d in ((0, 250), (2400, 10), (0, 260), (2600, 0))]  # mean 1250 : 130
    roles = ElasticRoles(POLICY)
    assert all(wanted(w, POLICY) is None or wanted(w, POLICY).to_role != "prefill" for w in swing[1::2])
    got = [roles.observe("n", swing[i % 4], now=i * 0.05) for i in range(60)]
    s = next(x for x in got if x is not None)
    assert (s.from_role, s.to_role) == ("decode", "prefill") and got.index(s) * 0.05 < 3.0
    # Each sample alone never holds its wish for the hold: switched by no single-sample policy.
    single = ElasticRoles(replace(POLICY, smooth_s=1e-6))
    assert all(single.observe("n", swing[i % 4], now=i * 0.05) is None for i in range(60))


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
def test_never_zero_decoders_and_every_switch_moves_towards_a_better_estimate(ws):
    loads = [Load(f"w{i}", {"P": "prefill", "D": "decode"}[r], p, d) for i, (r, p, d) in enumerate(ws)]
    s = wanted(loads, POLICY)
    if s is None:
        return
    after = [w.role if w.worker_id != s.worker_id else s.to_role for w in loads]
    assert s.from_role != s.to_role and len(loads) >= 2
    assert after.count("decode") >= 1  # decode workers also prefill, so prompts always have a worker
    p, d, n = sum(w.pending_prefill_tokens for w in loads), sum(w.pending_decode_tokens for w in loads), len(loads)
    now, target = [w.role for w in loads].count("prefill"), target_prefill_workers(p, d, n, POLICY)
    assert abs(after.count("prefill") - target) < abs(now - target)
    assert split_score(p, d, n, now, POLICY) > 1.15 * split_score(p, d, n, target, POLICY)


def test_bench_roles_configurations_and_the_traffic_shift_workload():
    from meshserve.bench.roles_bench import configurations
    from meshserve.bench.workload import load_workload

    assert configurations(2) == [("elastic", 1, 1, True), ("fixed-0:2", 0, 2, False), ("fixed-1:1", 1, 1, False)]
    reqs = load_workload("traffic-shift").generate(vocab_size=1000, max_model_len=8192)
    first, second = [q for q in reqs if q.arrival < 24.0], [q for q in reqs if q.arrival >= 24.0]
    assert {q.cls for q in first} == {"prefill_heavy"} and {q.cls for q in second} == {"decode_heavy"}
    assert min(q.prompt_len for q in first) > 10 * max(q.prompt_len for q in second)
    assert max(q.output_len for q in first) * 10 < min(q.output_len for q in second)
