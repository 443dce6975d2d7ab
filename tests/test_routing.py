"""The scheduler's routing rules on their own: cache-aware prefill choice, load balancing, decode choice."""

from __future__ import annotations

import time

from meshserve.services.scheduler.routing import (LOAD_WEIGHT, WorkerView, pick_decode,
                                                   pick_idle_for_short_prompt, pick_prefill, uncached_blocks)
from meshserve.shared.prefix_hash import prompt_block_hashes
from meshserve.shared.schemas import Heartbeat


def view(wid: str, role: str = "prefill", waiting: int = 0, running: int = 0, free: int = 100,
         cached: set[int] | None = None) -> WorkerView:
    hb = Heartbeat(worker_id=wid, role=role, model="m", node_id="n", num_running=running, num_waiting=waiting,
                   free_blocks=free, held_blocks=free, total_blocks=1000, block_size=16, max_model_len=4096,
                   time=time.time())
    return WorkerView(hb, cached=cached or set())


def test_prefix_of_cached_blocks_counts_until_the_first_miss():
    hashes = prompt_block_hashes(list(range(64)), 16, "m")
    assert len(hashes) == 4
    assert uncached_blocks(hashes, set(hashes)) == 0
    assert uncached_blocks(hashes, {hashes[0], hashes[2]}) == 3  # the chain breaks at block 1
    assert prompt_block_hashes(list(range(64)), 16, "other") != hashes  # keys name the model too


def test_shared_system_prompt_goes_where_it_is_cached_until_that_worker_is_busy():
    system = list(range(1000, 1000 + 16 * 20))  # 20 blocks shared by every request
    hashes = prompt_block_hashes(system + [1, 2, 3] * 6, 16, "m")
    warm, cold = view("warm", cached=set(hashes[:20])), view("cold")
    assert pick_prefill([cold, warm], hashes) is warm
    # Each queued request costs LOAD_WEIGHT blocks: once the warm worker's queue outweighs the
    # 20 blocks it saves, new requests spill over to the cold worker.
    warm.assigned = {f"r{i}" for i in range(int(20 / LOAD_WEIGHT) + 1)}
    assert pick_prefill([cold, warm], hashes) is cold


def test_decode_goes_to_free_blocks_then_fewest_running():
    a, b, c = view("a", "decode", free=50), view("b", "decode", free=200, running=9), view("c", "decode", free=200)
    assert pick_decode([a, b, c]) is c
    assert pick_decode([]) is None


def test_idle_decode_worker_takes_short_prompts_only():
    idle, busy = view("idle", "decode"), view("busy", "decode", waiting=2)
    assert pick_idle_for_short_prompt([busy, idle], 20, 32, []) is idle
    assert pick_idle_for_short_prompt([busy, idle], 200, 32, []) is None  # long: a prefill worker's job
    idle.assigned = {"r1"}
    assert pick_idle_for_short_prompt([busy, idle], 20, 32, []) is None  # nobody is idle now


def test_admission_room_counts_requests_sent_since_the_last_heartbeat():
    """A worker's room for a class: a free seat and less than `depth` steps of prompt tokens of that
    class waiting, where waiting counts what its heartbeat said plus what was sent since, and a
    seat frees as soon as a request there is done (no waiting for the next heartbeat)."""
    from meshserve.services.scheduler.routing import free_seats, has_room, pick_admission, pick_soonest, waiting_there

    w = view("w", "decode")
    w.hb.max_num_seqs, w.hb.max_num_batched_tokens = 8, 100
    assert has_room(w, "background", depth=2)
    for rid, n in (("a", 150), ("b", 60)):  # sent, not yet in a heartbeat
        w.assigned.add(rid)
        w.admitted[rid] = ("background", n)
        w.sent["background"] = w.sent.get("background", 0) + 1
        assert has_room(w, "background", depth=2) == (rid == "a")  # 150 < 2 steps of 100 tokens, 210 is not
    assert waiting_there(w, "background") == 2 and has_room(w, "normal", 2)  # normal has its own room
    w.hb.max_num_seqs = 2
    assert free_seats(w) == 0 and not has_room(w, "normal", 2)
    w.hb.received_by_priority = {"background": 2}  # the heartbeat: both running now
    w.hb.num_running, w.hb.waiting_by_priority = 2, {"background": 0}
    assert waiting_there(w) == 0 and free_seats(w) == 0
    w.assigned.discard("a")  # "a" is done
    del w.admitted["a"]
    w.left_since_heartbeat = 1
    assert free_seats(w) == 1 and has_room(w, "background", 2)
    other = view("other", "decode")
    other.hb.max_num_seqs = 2
    other.hb.num_running = 2
    assert pick_admission([other, w], "normal", [], depth=2) is w  # the one with a free seat
    w.hb.num_running = 3
    assert pick_admission([other, w], "normal", [], depth=2) is None  # the request waits in the scheduler
    other.assigned.add("i0")
    other.admitted["i0"] = ("interactive", 10)
    other.sent["interactive"] = 1
    assert pick_soonest([other, w], []) is w  # interactive: no seat anywhere, fewest interactive ahead


def test_an_interactive_short_prompt_skips_an_idle_decode_worker_with_long_steps():
    """Its first token would wait for the long step in progress and ride in the next one."""
    slow, fast = view("slow", "decode"), view("fast", "decode")
    slow.hb.step_s, fast.hb.step_s = 0.4, 0.03
    assert pick_idle_for_short_prompt([slow], 20, 32, [], "interactive") is None
    assert pick_idle_for_short_prompt([slow], 20, 32, [], "normal") is slow  # throughput: it saves the handoff
    assert pick_idle_for_short_prompt([slow, fast], 20, 32, [], "interactive") is fast


def test_a_burst_of_interactive_prompts_alternates_between_the_prefill_and_a_busy_decode_worker():
    """Each interactive prompt goes where the fewest interactive prompts wait ahead of it, counting
    decode workers with short steps (it is computed beside their decodes); ties go to the prefill
    worker. A long prompt, or a decode worker with long steps, is not spilled."""
    from meshserve.services.scheduler.routing import pick_soonest, spill_candidates

    pre, dec = view("p", "prefill"), view("d", "decode", running=30)
    dec.hb.step_s, dec.hb.max_num_seqs, pre.hb.max_num_seqs = 0.05, 64, 64
    sent = []
    for i in range(6):
        w = pick_soonest([pre], [], spill=spill_candidates([dec], 150))
        w.admitted[f"i{i}"] = ("interactive", 150)
        w.sent["interactive"] = w.sent.get("interactive", 0) + 1
        sent.append(w.hb.worker_id)
    assert sent == ["p", "d", "p", "d", "p", "d"]
    assert spill_candidates([dec], 2000) == []
    dec.hb.step_s = 0.4
    assert spill_candidates([dec], 150) == []
    assert pick_soonest([pre], [], spill=[]) is pre


def test_a_superseded_attempt_ending_frees_its_seat_where_it_ran():
    """A re-submitted request (a new attempt after a nats restart or a lost chunk) may run on
    another worker than its old attempt: the old one's Done frees the seat it held there, or the
    worker would count one more sequence for good (and a model switch, which waits for its worker
    to have nothing assigned, would wait for ever); the new attempt's seat stays."""
    import asyncio
    import types

    from meshserve.services.scheduler.main import Scheduler, Tracked
    from meshserve.shared.schemas import Done, GenerateRequest, Sampling

    s = Scheduler(None, types.SimpleNamespace())
    s.workers.update({wid: view(wid, "decode") for wid in ("a", "b")})
    req = GenerateRequest(request_id="r", model="m", prompt_token_ids=[5], sampling=Sampling(max_tokens=1),
                          stream_subject="x", arrival_time=0.0)
    s.workers["a"].assigned.add("r")  # attempt 0 ran on a; attempt 1 was sent to b
    s.workers["b"].assigned.add("r")
    s.requests["r"] = Tracked(req.model_copy(update={"attempt": 1}), "b")
    asyncio.run(s.done(Done(request_id="r", worker_id="a", attempt=0)))
    assert not s.workers["a"].assigned and s.workers["b"].assigned == {"r"} and "r" in s.requests
    asyncio.run(s.done(Done(request_id="r", worker_id="b", attempt=1)))
    assert not s.workers["b"].assigned and "r" not in s.requests
