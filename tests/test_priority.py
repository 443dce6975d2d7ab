"""Priorities: multi-level queues with preemption at iteration boundaries, and no starvation.

Engine level on the tiny model (steps, not seconds, measure who goes first; the minimum run time
runs on a fake clock), then one mesh test with real processes. test_preemption.py has the rest:
swap and recompute, the guarantees under sustained load, and the mesh's own queues."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch
from oracle import hf_greedy

from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine, RequestError
from meshserve.shared.engine.policy import Policy
from meshserve.shared.engine.scheduler import SchedulerConfig, WaitingQueue
from meshserve.shared.engine.sequence import SamplingParams, Sequence
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir

GREEDY = SamplingParams(max_tokens=12, temperature=0)
LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
               for n in (5, 40, 17, 33, 9, 60, 24, 3, 48, 12, 30, 20)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    return model, prompts, hf_greedy(hf, prompts, GREEDY.max_tokens, cfg.eos_token_ids)


def engine(model, max_seqs=64, blocks=4096, block_size=16, chunk=512, mode="recompute", clock=None,
           **policy) -> LLMEngine:
    """Recompute unless a test is about swapping (the batches then do not depend on measured costs);
    with a Clock, the scheduler's time (the minimum run time) is counted in steps, not seconds."""
    sched = SchedulerConfig(max_num_batched_tokens=max(chunk, 64), prefill_chunk_size=chunk, max_num_seqs=max_seqs,
                            preemption_mode=mode, **policy)
    eng = LLMEngine(model, EngineConfig(block_size=block_size, num_kv_blocks=blocks, scheduler=sched))
    if clock is not None:
        eng.scheduler.clock = clock
    return eng


class Clock:
    """One 'second' per step: time measured in steps, whatever the machine's speed."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(eng: LLMEngine, steps: int | None = None, clock: Clock | None = None, on_step=None) -> dict[str, int]:
    """Steps the engine; returns the step at which each request got its first token."""
    first: dict[str, int] = {}
    i = 0
    while eng.has_unfinished() and (steps is None or i < steps):
        if on_step:
            on_step(i)
        for out in eng.step():
            first.setdefault(out.request_id, i)
        i += 1
        if clock:
            clock.t += 1
    return first


# -- the queue on its own


def test_waiting_queue_orders_by_level_then_fifo_with_preempted_at_the_head():
    clock = Clock()
    q = WaitingQueue(Policy(SchedulerConfig(), clock))
    seqs = {name: Sequence(name, [1], SamplingParams(), priority=p)
            for name, p in [("bg1", 2), ("n1", 1), ("bg2", 2), ("i1", 0), ("n2", 1)]}
    for s in seqs.values():
        q.append(s)

    def order() -> list[str]:
        out, taken = [], []
        while q:
            s = q.peek()
            q.pop(s)
            out.append(s.request_id)
            taken.append(s)
        q.seqs.extend(taken)  # put them back as they were
        return out

    q.policy.refresh(normal_has_work=True)
    assert q.policy.normal_behind  # nothing produced yet: normal is below its guaranteed share
    assert order() == ["n1", "n2", "i1", "bg1", "bg2"]
    q.policy.shares.record([8, 2, 0])  # normal has had 20% of the output tokens: interactive first
    q.policy.refresh(normal_has_work=True)
    assert order() == ["i1", "n1", "n2", "bg1", "bg2"]
    for name in ("n1", "bg2"):  # preempted: the head of its class again
        q.remove(seqs[name])
        seqs[name].num_preemptions = 1
        q.appendleft(seqs[name])
    assert order() == ["i1", "n1", "n2", "bg2", "bg1"]
    # No aging: however long a background request waited, a new interactive one goes first.
    clock.t = 1e6
    late = Sequence("late", [1], SamplingParams(), priority=0)
    q.append(late)
    assert order()[:2] == ["i1", "late"]
def test_priority_names_and_bad_values(tiny):
    model, prompts, _ = tiny
    eng = engine(model)
    assert eng.add_request("a", prompts[0], GREEDY, priority="interactive").priority == 0
    assert eng.add_request("b", prompts[1], GREEDY).priority == 1
    assert eng.add_request("c", prompts[2], GREEDY, priority=2).priority == 2
    with pytest.raises(RequestError, match="priority"):
        eng.add_request("d", prompts[3], GREEDY, priority="urgent")
    stats = eng.stats
    assert stats["waiting_by_priority"] == {"interactive": 1, "normal": 1, "background": 1}
    run(eng)
    assert eng.stats["running_by_priority"] == {"interactive": 0, "normal": 0, "background": 0}


# -- (a) interactive first


@pytest.mark.parametrize("late", ["interactive", "background"])
def test_interactive_overtakes_waiting_background_and_preempts_a_running_one(tiny, late):
    """max_num_seqs full of background requests, more waiting: an interactive request submitted
    later preempts a running one (the best victim: the least progress) and gets its first token
    before the waiting ones. The same request as one more background request waits its turn."""
    model, prompts, _ = tiny
    eng = engine(model, max_seqs=3)
    bg = [eng.add_request(f"bg{i}", prompts[i], LONG, priority="background") for i in range(7)]
    first = run(eng, steps=3)
    assert set(first) == {"bg0", "bg1", "bg2"}  # three running, four waiting
    eng.add_request("late", prompts[8], GREEDY, priority=late)
    first.update({k: v + 3 for k, v in run(eng).items()})
    waiting_bg = [first[f"bg{i}"] for i in range(3, 7)]
    if late == "interactive":
        assert first["late"] == 3  # the very next step
        assert first["late"] < min(waiting_bg)
        assert eng.scheduler.num_priority_preemptions == 1
        # bg0's 5-token prompt and 2 tokens are the least done of its 5 + 24 (bg1: 42 of 64, bg2: 19 of 41)
        assert bg[0].num_priority_preemptions == 1
    else:
        assert first["late"] >= max(waiting_bg)  # admitted after the last of them
        assert eng.scheduler.num_priority_preemptions == 0
    assert all(s.num_output_tokens == LONG.max_tokens for s in bg)


def test_interactive_preempts_background_when_blocks_run_out(tiny):
    """The pool (not max_num_seqs) is full: the interactive request frees blocks by preemption."""
    model, prompts, _ = tiny
    eng = engine(model, blocks=16)
    bg = [eng.add_request(f"bg{i}", prompts[i], LONG, priority="background") for i in (1, 3, 5, 8)]
    run(eng, steps=4)
    assert all(s.num_output_tokens > 0 for s in bg) and eng.scheduler.num_preemptions == 0
    assert eng.block_pool.num_free < eng.kv_cache_manager.blocks_needed(len(prompts[0]) + len(prompts[5]))
    eng.add_request("i", prompts[0] + prompts[5], GREEDY, priority="interactive")
    first = run(eng, steps=1)
    assert "i" in first  # admitted and prefilled in the next step
    assert eng.scheduler.num_priority_preemptions >= 1
    run(eng)
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


@pytest.mark.parametrize("late", ["interactive", "background"])
def test_interactive_prompt_gets_the_budget_before_running_background_prompts(tiny, late):
    """Running background prompts still prefilling in chunks do not hold the step's token budget
    against an interactive prompt that arrives: its chunk goes first. (As background, it waits;
    shorter prompts first within a class is off here, test_preemption.py has that on its own.)"""
    model, prompts, _ = tiny
    eng = engine(model, chunk=8, short_first=False)  # 64 tokens a step, 8 per chunk: the prompts take many steps
    for i in range(10):
        eng.add_request(f"bg{i}", prompts[i] * 3, LONG, priority="background")
    run(eng, steps=2)
    eng.add_request("late", prompts[7], GREEDY, priority=late)  # 3 tokens: one chunk
    first = run(eng, steps=1)
    assert ("late" in first) == (late == "interactive")
    assert eng.scheduler.num_priority_preemptions == 0  # it had seats and blocks: only the budget moved


# -- (b) no starvation: guarantees, not aging


def steady_interactive(eng, prompts, clock, steps, until=None, on_step=None):
    """One interactive request arriving every step (more than the seats can serve), for `until`
    steps (default: all of them); returns the step at which each request got its first token."""
    first = {}
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(steps):
        if until is None or i < until:
            eng.add_request(f"i{i}", prompts[i % len(prompts)], short, priority="interactive")
        if on_step:
            on_step(i)
        for out in eng.step():
            first.setdefault(out.request_id, i)
        clock.t += 1
    return first


def test_background_runs_on_idle_capacity_and_finishes_once_interactive_stops(tiny):
    """Two seats, interactive requests always waiting: a background request does not start while
    they keep coming (it is not aged into interactive), then finishes once they stop."""
    model, prompts, _ = tiny
    clock = Clock()
    eng = engine(model, max_seqs=2, clock=clock)
    for k in range(3):  # the seats are taken before the background request arrives
        eng.add_request(f"first{k}", prompts[k], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                        priority="interactive")
    bg = eng.add_request("bg", prompts[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                         priority="background")

    def still_waiting(i):
        assert bg.first_scheduled_time is None, i

    steady_interactive(eng, prompts, clock, steps=40, on_step=still_waiting)
    run(eng, clock=clock)
    assert bg.is_finished and bg.num_output_tokens == 8 and not eng.requests


def test_a_resumed_sequence_runs_its_minimum_time_before_it_is_preempted_again(tiny):
    """One seat: interactive requests arriving one after another preempt a background request,
    but once it has resumed it runs min_run_s (here 5 steps) before the next one may preempt it."""
    model, prompts, _ = tiny
    clock = Clock()
    eng = engine(model, max_seqs=1, clock=clock, min_run_s=5)
    bg = eng.add_request("bg", prompts[1], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                         priority="background")
    two = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    run(eng, steps=3, clock=clock)
    eng.add_request("i0", prompts[0], two, priority="interactive")
    first = run(eng, steps=1, clock=clock)
    assert "i0" in first and bg.num_priority_preemptions == 1  # preempted at once: it had not been before
    run(eng, steps=2, clock=clock)  # i0 done, bg resumed
    assert bg in eng.scheduler.running
    eng.add_request("i1", prompts[2], two, priority="interactive")
    waited = 0
    while "i1" not in run(eng, steps=1, clock=clock):
        waited += 1
    assert bg.num_priority_preemptions == 2
    assert 3 <= waited <= 5, waited  # until bg's 5 s since it resumed were over
    run(eng, clock=clock)
    assert bg.is_finished and bg.num_output_tokens == 60


# -- (c) still the oracle's tokens


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("pool", ["seats", "blocks"])
def test_greedy_with_priorities_and_preemption_matches_transformers(tiny, pool, mode):
    """Preempted by swap or by recompute, any number of times: the same tokens as Transformers."""
    model, prompts, ref = tiny
    eng = (engine(model, max_seqs=3, mode=mode) if pool == "seats"
           else engine(model, blocks=20, block_size=8, chunk=16, mode=mode))
    classes = ["background", "normal", "interactive"]
    # Six background requests, then one request of each class in turn every step while they run.
    seqs = {j: eng.add_request(f"r{j}", prompts[j], GREEDY, priority="background") for j in range(6)}

    def arrive(i):
        if 2 <= i < 8:
            j = i + 4
            seqs[j] = eng.add_request(f"r{j}", prompts[j], GREEDY, priority=classes[j % 3])

    run(eng, on_step=arrive)
    assert [seqs[j].output_token_ids for j in range(len(prompts))] == ref
    assert eng.scheduler.num_priority_preemptions > 0
    assert eng.stats["preemptions_by_mode"][mode] == eng.scheduler.num_preemptions  # that path, every time
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


# -- (d) equal priorities: first come, first served, exactly as before


@pytest.mark.parametrize("priority", ["interactive", "background"])
def test_equal_priorities_schedule_exactly_like_normal(tiny, priority):
    """Same requests, all of one priority: the same batches step by step as all "normal", even with
    a pool small enough to preempt; prompts of one size bucket start first-come-first-served."""
    model, prompts, ref = tiny

    def trace(p):
        clock = Clock()
        eng = engine(model, max_seqs=4, blocks=14, block_size=8, chunk=16, clock=clock)
        batches, schedule = [], eng.scheduler.schedule

        def recorded():
            batch = schedule()
            batches.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
            clock.t += 3
            return batch

        eng.scheduler.schedule = recorded
        seqs = [eng.add_request(f"r{i}", pr, GREEDY, priority=p) for i, pr in enumerate(prompts)]
        run(eng)
        assert [s.output_token_ids for s in seqs] == ref
        return batches, eng.stats["num_preemptions"]

    normal, preemptions = trace("normal")
    assert preemptions > 0
    assert trace(priority) == (normal, preemptions)
    # First come, first served: requests start in arrival order.
    started = dict.fromkeys(rid for batch in normal for rid, _ in batch)
    assert list(started) == [f"r{i}" for i in range(len(prompts))]


def test_the_best_class_and_interactive_prompt_work_a_worker_asks_before_a_step(tiny):
    """Scheduler.top_class and has_prompt_work (compute priority between a node's workers,
    services/worker/compute_claims.py): an interactive prompt waiting or mid-prefill is prompt
    work; once it only decodes it is not, though its steps still have the interactive class."""
    model, prompts, _ = tiny
    eng = engine(model, chunk=16)
    sched = eng.scheduler
    assert sched.top_class() is None and not sched.has_prompt_work(0)
    eng.add_request("b", prompts[1], LONG, priority="background")
    assert sched.top_class() == 2 and not sched.has_prompt_work(0) and sched.has_prompt_work(2)
    eng.add_request("i", prompts[5], LONG, priority="interactive")  # 60 tokens: 4 chunks of 16
    assert sched.top_class() == 0 and sched.has_prompt_work(0)  # waiting
    eng.step()
    assert 0 < eng.requests["i"].num_computed_tokens < 60 and sched.has_prompt_work(0)  # mid-prefill
    while not eng.requests["i"].num_output_tokens:
        eng.step()
    assert not sched.has_prompt_work(0) and sched.top_class() == 0  # it decodes only
    eng.abort("i")
    assert sched.top_class() == 2


# -- the mesh


# Long enough that a pair of them outlasts the interactive request's way through the gateway and
# the scheduler on a loaded machine (64 tokens did not, once, under a parallel test run).
BG_TOKENS = 192


def test_mesh_interactive_request_overtakes_a_background_batch(tiny_llama, tmp_path):
    """One worker that runs 2 sequences at once, 8 background requests: an interactive request
    sent while they occupy it gets its first token before most of them finish (FCFS would put it
    behind all 8), and every output still equals the in-process engine's."""
    from openai import OpenAI

    from mesh_util import Mesh
    from meshserve.shared.engine.llm import LLM

    mesh = Mesh(tiny_llama, tmp_path, prefill=0, decode=1, extra=["--max-num-seqs", "2"]).wait_ready()
    try:
        client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=120)
        prompts = ["The quick brown fox", "Hello world! Hello there", "def add(a, b):", "Once upon a time",
                   "Numbers: 0 1 2 3", "Café, naïve, résumé", "What is the capital of France?", "Attention"]
        events: list[tuple[str, str]] = []  # (what, request), in the order they happened

        def one(name, prompt, n, priority):
            text = ""
            stream = client.completions.create(model=mesh.model, prompt=prompt, max_tokens=n, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True, "priority": priority})
            for c in stream:
                if c.choices and c.choices[0].text and not text:
                    events.append(("first", name))
                text += c.choices[0].text if c.choices else ""
            events.append(("done", name))
            return text

        with concurrent.futures.ThreadPoolExecutor(9) as ex:
            bg = [ex.submit(one, f"bg{i}", p, BG_TOKENS, "background") for i, p in enumerate(prompts)]
            # Sent once two background requests stream: the worker then runs two and holds the rest
            # waiting (a tiny model finishes the batch in about a second on a quiet machine, faster
            # than heartbeats could show the queue, so the streams themselves are the signal).
            deadline = time.monotonic() + 60
            while sum(what == "first" for what, _ in list(events)) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            if not events:
                pytest.fail(f"the background batch never started: {mesh.ask('scheduler.status')}")
            events.append(("sent", "inter"))
            inter = ex.submit(one, "inter", "Tell me a joke about computers.", 8, "interactive")
            texts = [f.result(timeout=120) for f in bg] + [inter.result(timeout=120)]
        done_before = [w for what, w in events[:events.index(("first", "inter"))] if what == "done"]
        assert len(done_before) < 4, events
        deadline, preempted = time.monotonic() + 15, 0
        while time.monotonic() < deadline and not preempted:  # the heartbeats carry the counters (every 0.5 s)
            preempted = mesh.ask("scheduler.status")["num_priority_preemptions"]
            time.sleep(0.1)
        # It took a running background sequence's place (a preemption), or, when one of the two
        # running ones happened to finish as it came, the freed place ahead of the waiting ones.
        freed = [w for what, w in events[events.index(("sent", "inter")):events.index(("first", "inter"))]
                 if what == "done"]
        assert preempted >= 1 or freed, events
    finally:
        mesh.stop()
    llm = LLM(str(tiny_llama), "float32")
    want = [c.text for c in llm.generate(prompts + ["Tell me a joke about computers."],
                                         [SamplingParams(max_tokens=BG_TOKENS, temperature=0, ignore_eos=True)] * 8
                                         + [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])]
    assert texts == want
