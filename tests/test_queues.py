"""The mesh scheduler's own queues (services/scheduler/queues.py): class order, shorter prompts
first, and the stretch bound on overtaking, as pure bookkeeping."""

from __future__ import annotations

from meshserve.services.scheduler.queues import ClassQueues
from meshserve.shared.engine.policy import OVERTAKE_FACTOR
from meshserve.shared.schemas import GenerateRequest, Sampling


def req(rid: str, n: int, priority: str = "normal") -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="m", prompt_token_ids=[5] * n, sampling=Sampling(max_tokens=4),
                           priority=priority, stream_subject="s", arrival_time=0.0)


def drain(q: ClassQueues, arrivals: list[GenerateRequest], per_pop: int = 1, backlog: int = 0) -> list[str]:
    """Pops the head after every `per_pop` arrivals beyond the first `backlog` (then the rest): the
    order requests leave."""
    out = []
    for r in arrivals[:backlog]:
        q.push(r)
    arrivals = arrivals[backlog:]
    for i, r in enumerate(arrivals):
        q.push(r)
        if (i + 1) % per_pop == 0:
            head = q.heads()[0]
            q.pop(head)
            out.append(head.req.request_id)
    while q:
        head = q.heads()[0]
        q.pop(head)
        out.append(head.req.request_id)
    return out


def test_classes_first_then_shorter_prompts():
    q = ClassQueues()
    for r in (req("bg", 10, "background"), req("long", 3000), req("short", 20), req("i", 500, "interactive")):
        q.push(r)
    order = []
    while q:
        head = q.heads()[0]
        q.pop(head)
        order.append(head.req.request_id)
    assert order == ["i", "short", "long", "bg"]


def test_a_long_prompt_leaves_once_overtaken_by_its_bound_in_tokens():
    """Behind a steady stream of short prompts (one leaves per arrival), a 2000-token prompt leaves
    when the short ones that went first add up to OVERTAKE_FACTOR x (2000 + 64) tokens; a count of
    16 overtakes would have let it go after 16 of them and, with many such, back to FIFO."""
    q = ClassQueues()
    arrivals = [req("s0", 50), req("long", 2000)] + [req(f"s{i}", 50) for i in range(1, 1200)]
    order = drain(q, arrivals, backlog=2)
    bound = OVERTAKE_FACTOR * (2000 + 64)
    shorts_before = order.index("long") - 1  # s0 was there first
    assert (shorts_before - 1) * 50 < bound <= shorts_before * 50, shorts_before
    assert shorts_before > 16


def test_fcfs_and_a_request_put_back_first():
    q = ClassQueues(fcfs=True)
    assert drain(q, [req("long", 3000), req("short", 10), req("i", 5, "interactive")], per_pop=10) == \
        ["long", "short", "i"]
    q = ClassQueues()
    q.push(req("a", 10))
    q.push(req("back", 4000), first=True)  # a worker did not take it: ahead of its class
    assert q.heads()[0].req.request_id == "back"


def test_queue_sim_on_mixed_chat_short_prompts_go_first_and_nobody_is_left_behind():
    """bench/queue_sim.py drives these queues over a shipped workload: at 4x over capacity short
    prompts' simulated TTFT p99 is far better than fcfs (the count bound gave 1.1x), and every
    request leaves the queue (its TTFT is finite and at most the fcfs drain time plus the longest
    wait overtaking may add)."""
    from meshserve.bench.queue_sim import run

    r = run("mixed-chat", 500.0, None, 200, 0.05)
    assert r["offered_load"] > 2
    assert r["short_ttft_p99_fcfs_over_priority"] >= 10, r
    assert r["priority"]["ttft_max_s"] < 1.5 * r["fcfs"]["ttft_max_s"], r


def test_tenants_fair_share_within_a_class():
    """With virtual token counters (FairShare), the waiting tenant served least (per its weight)
    goes first, whatever came before: a tenant that queued many requests does not hold back
    another's one; a tenant that starts waiting is lifted to the others' least, banking no credit;
    what a request did not generate is given back. fcfs ignores it."""
    from meshserve.services.scheduler.admission import FairShare

    def of(rid: str, tenant: str, n: int = 10) -> GenerateRequest:
        return req(rid, n).model_copy(update={"tenant": tenant})

    fair = FairShare({"big": 1.0, "small": 1.0, "paid": 4.0})
    q = ClassQueues()
    for i in range(5):
        fair.waiting("big", {x.req.tenant for x in q})
        q.push(of(f"big{i}", "big"))
    order = []

    def serve() -> None:
        head = q.heads(fair.share)[0]
        q.pop(head)
        order.append(head.req.request_id)
        fair.charge(head.req.tenant, 100)

    serve()  # big0: big's counter 100
    for rid, tenant in (("small0", "small"), ("small1", "small"), ("paid0", "paid"), ("paid1", "paid")):
        fair.waiting(tenant, {x.req.tenant for x in q})  # lifted to the least waiting: big's 100
        q.push(of(rid, tenant))
    assert fair.share("small") == fair.share("paid") == 100
    assert q.tenants == {"big": 4, "small": 2, "paid": 2}  # who waits, kept as requests come and go
    while q:
        serve()
    assert q.tenants == {}
    # by arrival on ties; paid's weight 4 makes each of its requests cost a quarter
    assert order == ["big0", "big1", "small0", "paid0", "paid1", "big2", "small1", "big3", "big4"], order
    before = fair.share("big")
    fair.refund("big", 60)  # a request that ended 60 tokens short of what it was charged
    assert fair.share("big") == before - 60
    fcfs = ClassQueues(fcfs=True)  # first come, first served: counters do not reorder it
    for r in (of("big-first", "big"), of("small-later", "small")):
        fcfs.push(r)
    assert [x.req.request_id for x in fcfs.heads(fair.share)] == ["big-first"]
