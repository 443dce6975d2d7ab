"""Preemption by swap or recompute, the classes' guarantees under sustained load, and the mesh's
own queues. Engine level on the tiny model with a fake clock (time counted in steps), then real
meshes (nats-server, `meshserve up`)."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest
import torch

from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.policy import BACKGROUND, INTERACTIVE, Policy, PreemptionCosts
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams, Sequence, SequenceStatus
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 30, 12, 45, 20, 9, 26, 15)]
    return model, prompts


def engine(model, clock=None, blocks=4096, block_size=16, max_seqs=64, chunk=512, **sched) -> LLMEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=max(chunk, 64), prefill_chunk_size=chunk, max_num_seqs=max_seqs,
                          **sched)
    eng = LLMEngine(model, EngineConfig(block_size=block_size, num_kv_blocks=blocks, scheduler=cfg))
    if clock is not None:
        eng.scheduler.clock = clock
    return eng


def step(eng, clock, first, i):
    for out in eng.step():
        first.setdefault(out.request_id, i)
    clock.t += 1


# -- swap and recompute


def test_the_cheaper_way_is_chosen_from_measured_rates():
    c = PreemptionCosts(copy_bytes_per_s=1e9, prefill_tokens_per_s=1000.0)
    assert c.choose("auto", nbytes=10_000_000, tokens=100, can_swap=True) == "swap"  # 2 x 10 ms vs 100 ms
    c = PreemptionCosts(copy_bytes_per_s=1e8, prefill_tokens_per_s=1000.0)
    assert c.choose("auto", nbytes=10_000_000, tokens=100, can_swap=True) == "recompute"  # 200 ms vs 100 ms
    for _ in range(20):
        c.observe_copy(10_000_000, 0.001)  # copies turn out fast: 10 GB/s
    assert c.choose("auto", nbytes=10_000_000, tokens=100, can_swap=True) == "swap"
    assert c.choose("auto", nbytes=10_000_000, tokens=100, can_swap=False) == "recompute"
    assert c.choose("swap", nbytes=10**12, tokens=1, can_swap=True) == "swap"
    assert c.choose("recompute", nbytes=1, tokens=10**6, can_swap=True) == "recompute"
    assert c.choose("swap", nbytes=0, tokens=0, can_swap=True) == "recompute"  # nothing computed yet


def test_the_engine_measures_its_prefill_and_decode_rates(tiny):
    """Mostly-prefill steps give the prompt rate (what a recompute costs, and, through the
    heartbeats, the elastic roles' weight of an output token), decode-only steps the output rate;
    until a prefill step ran, recompute costs use the assumed rate."""
    model, prompts = tiny
    eng = engine(model)
    rates = eng.scheduler.costs.rates
    assert rates.prefill_tokens_per_s == rates.decode_tokens_per_s == 0.0
    assert eng.scheduler.costs.prefill_tokens_per_s == 2000.0  # assumed
    eng.generate(prompts[:3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert rates.prefill_tokens_per_s > 0 and rates.decode_tokens_per_s > 0
    assert eng.scheduler.costs.prefill_tokens_per_s == rates.prefill_tokens_per_s
    assert eng.scheduler.costs.recompute_s(1000) == 1000 / rates.prefill_tokens_per_s


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_seeded_sampled_stream_continues_its_sequence_through_preemptions(tiny, mode):
    """A seeded, sampled background request preempted again and again by interactive ones (one
    seat) samples the same tokens as when it runs alone."""
    model, prompts = tiny
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine(model).generate([prompts[1]], params)[0]
    clock = Clock()
    eng = engine(model, clock, max_seqs=1, preemption_mode=mode, min_run_s=0)
    bg = eng.add_request("bg", prompts[1], params, priority="background")
    first: dict[str, int] = {}
    for i in range(200):
        if i % 6 == 3 and i < 60:
            eng.add_request(f"i{i}", prompts[i % 8], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                            priority="interactive")
        if not eng.has_unfinished():
            break
        step(eng, clock, first, i)
    assert bg.output_token_ids == alone
    assert bg.num_preemptions >= 5 and eng.stats["preemptions_by_mode"][mode] == bg.num_preemptions


def test_blocks_lost_from_host_memory_are_recomputed(tiny):
    """A swap-in that finds only some of the blocks (in the mesh the host tier may have dropped
    them) resumes from there and recomputes the rest: still the undisturbed greedy tokens."""
    model, prompts = tiny
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = engine(model, block_size=4).generate([prompts[3]], params)[0]
    clock = Clock()
    eng = engine(model, clock, block_size=4, max_seqs=1, preemption_mode="swap")
    bg = eng.add_request("bg", prompts[3], params, priority="background")
    first: dict[str, int] = {}
    for i in range(4):
        step(eng, clock, first, i)
    eng.add_request("i", prompts[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                    priority="interactive")
    step(eng, clock, first, 4)
    assert bg.swapped_tokens == 45 + 3 and len(bg.swap_keys) == 12  # 48 tokens in 12 blocks of 4
    store = eng.scheduler.swapper.store
    del store[bg.swap_keys[7]]  # blocks 7.. must be recomputed (the prefix cache may still hold 0-6)
    i = 5
    while eng.has_unfinished():
        step(eng, clock, first, i)
        i += 1
    assert bg.output_token_ids == alone and not store


# -- the guarantees under sustained interactive load


def test_normal_gets_its_share_and_a_bounded_wait_under_a_steady_interactive_stream(tiny):
    """Two interactive requests arrive every step, more than four seats serve: interactive
    requests wait all the time. Normal requests arriving among them are still admitted within a
    bounded number of steps and get about their 20% of the output tokens; background ones do not
    start until the interactive stream stops, then finish. With no guaranteed share normal waits
    as long as background does (the contrast)."""
    model, prompts = tiny

    def run(share):
        clock = Clock()
        eng = engine(model, clock, max_seqs=4, min_normal_share=share)
        short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        normal = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        arrived, first, tokens = {}, {}, {"normal": 0, "interactive": 0}
        i, bg = 0, None
        while i < 150 or eng.has_unfinished():
            if i < 150:
                for k in range(2):
                    eng.add_request(f"i{i}.{k}", prompts[(i + k) % 8], short, priority="interactive")
                if i == 1:  # the seats are taken by then
                    bg = eng.add_request("bg", prompts[2], normal, priority="background")
                if i % 15 == 5:
                    arrived[f"n{i}"] = i
                    eng.add_request(f"n{i}", prompts[i % 8], normal, priority="normal")
            if i == 150:
                assert bg.first_scheduled_time is None  # background: only on idle capacity
            for out in eng.step():
                first.setdefault(out.request_id, i)
                if 20 <= i < 150:
                    tokens["normal" if out.request_id.startswith("n") else "interactive"] += 1
            clock.t += 1
            i += 1
        assert bg.is_finished and bg.num_output_tokens == 12
        waits = [first[r] - a for r, a in arrived.items()]
        return max(waits), tokens["normal"] / (tokens["normal"] + tokens["interactive"])

    bound, share = run(0.2)
    print(f"normal under a steady interactive stream: longest wait {bound} steps, output share {share:.2f}")
    assert bound <= 3, bound  # admitted at once (it preempts an interactive one past its first token)
    assert 0.15 <= share <= 0.35, share
    starved, _ = run(0.0)
    assert starved > 50  # without the guarantee: until the interactive stream ends


def test_shorter_prompts_first_within_a_class_and_overtaking_is_bounded(tiny):
    """A long background prompt waiting behind nothing but a stream of short ones: the short ones
    go first, but it starts once later short prompts of overtake_factor times its own tokens (plus
    64) went ahead of it: a bound in work, not in a count of requests."""
    model, prompts = tiny
    long_prompt = (prompts[3] * 6)[:200]  # 200 tokens: two buckets above the short ones
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    factor = 0.5
    eng = engine(model, max_seqs=1, overtake_factor=factor)
    g = torch.Generator().manual_seed(11)
    shorts = [torch.randint(3, 200, (len(prompts[i % 8]),), generator=g).tolist() for i in range(41)]
    eng.add_request("s0", shorts[0], params, priority="background")
    eng.add_request("long", long_prompt, params, priority="background")
    order = []
    for i in range(40):
        eng.add_request(f"s{i + 1}", shorts[i + 1], params, priority="background")
        for out in eng.step():
            if out.request_id not in order:
                order.append(out.request_id)
    # s0 was there first; then later short ones until their prompts add up to the bound, then it.
    done, k = 0, 0
    while done < factor * (200 + 64):
        k += 1
        done += len(shorts[k])
    assert order.index("long") == k + 1, (order, k)
    assert k >= 4  # more than the old bound of 3 overtakes would have allowed: short prompts weigh little
    fcfs = engine(model, max_seqs=1, policy="fcfs")
    for rid, p in (("s0", prompts[0]), ("long", long_prompt), ("s1", prompts[1])):
        fcfs.add_request(rid, p, params, priority="background")
    order = []
    while fcfs.has_unfinished():
        order += [o.request_id for o in fcfs.step() if o.request_id not in order]
    assert order == ["s0", "long", "s1"]


def test_a_preempted_sequence_keeps_the_head_of_its_class_while_it_recomputes():
    """Short prompts of its class go before a long running prompt, but not before one that was
    preempted: waiting again, or running again to recompute what it lost, it has already waited its
    turn once (a later short prompt would otherwise take each chunk's budget from it)."""
    pol = Policy(SchedulerConfig(), Clock())
    params = SamplingParams(max_tokens=8)
    short = Sequence("short", list(range(3, 13)), params, priority=BACKGROUND)
    fresh = Sequence("fresh", list(range(3, 403)), params, priority=BACKGROUND)
    fresh.status, fresh.num_computed_tokens = SequenceStatus.RUNNING, 32
    assert pol.outranks(short, fresh)
    resumed = Sequence("resumed", list(range(3, 403)), params, priority=BACKGROUND)
    resumed.num_preemptions = 1
    assert pol.rank(resumed) < pol.rank(short)  # waiting to resume
    resumed.status, resumed.num_computed_tokens = SequenceStatus.RUNNING, 32
    assert not pol.outranks(short, resumed)  # recomputing its prompt in chunks
    urgent = Sequence("urgent", list(range(3, 13)), params, priority=INTERACTIVE)
    assert pol.outranks(urgent, resumed)  # the head of its class only


def test_batch_prompts_take_small_chunks_while_interactive_requests_come(tiny):
    """No decodes running (a prefill worker): a long background prompt takes the whole step budget,
    unless an interactive request came in the last interactive_guard_s; then it takes at most
    max_prefill_tokens_near_interactive a step, and the interactive prompt all it needs, alone in
    its step (the batch prompt's chunk would delay its first token)."""
    model, prompts = tiny
    long_prompt = (prompts[3] * 6)[:200]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def chunks(with_interactive: bool) -> list[list[tuple[str, int]]]:
        clock = Clock()
        eng = engine(model, clock, max_prefill_tokens_near_interactive=64, interactive_guard_s=5)
        batches, schedule = [], eng.scheduler.schedule

        def recorded():
            batch = schedule()
            batches.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
            clock.t += 2
            return batch

        eng.scheduler.schedule = recorded
        if with_interactive:
            eng.add_request("i", prompts[0], one, priority="interactive")
        eng.add_request("bg", long_prompt, one, priority="background")
        while eng.has_unfinished():
            eng.step()
        return batches

    assert chunks(False) == [[("bg", 200)]]
    # the interactive prompt alone, then 64 a step while it is 2 and 4 s old, then the rest at once
    assert chunks(True) == [[("i", 7)], [("bg", 64)], [("bg", 64)], [("bg", 72)]]


def test_an_urgent_request_ends_a_batch_step_early_and_nothing_is_lost(tiny):
    """LLMEngine.urgent set while a step with no interactive sequence runs: the pass stops between
    layers, the step returns nothing and advances nothing, and the batch later continues exactly
    (greedy output equal to an undisturbed run). A step with an interactive sequence runs on."""
    import threading

    model, prompts = tiny
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    undisturbed = engine(model, chunk=16).generate([prompts[3], prompts[1]], params)
    eng = engine(model, chunk=16)
    eng.urgent = threading.Event()
    bg = [eng.add_request(f"bg{i}", prompts[k], params, priority="background") for i, k in enumerate((3, 1))]
    eng.step()  # a first chunk of each
    done = [s.num_computed_tokens for s in bg]
    layers = []
    real = eng.model.__call__

    def arrives_mid_pass(*args, stop=None, **kw):  # the request comes while the embedding computes
        def stop_at(i):
            layers.append(i)
            if i == 0:
                eng.urgent.set()
            return stop(i)
        return real(*args, stop=stop_at, **kw)

    eng.runner.model = _Calls(eng.model, arrives_mid_pass)
    shares = list(eng.scheduler.policy.shares.tokens)
    assert eng.step() == [] and eng.interrupted_steps == 1
    assert layers == [0] and [s.num_computed_tokens for s in bg] == done  # stopped before layer 0
    assert eng.scheduler.policy.shares.tokens == pytest.approx(shares)  # no output credited to a step that made none
    eng.runner.model = eng.model
    i = eng.add_request("i", prompts[0], SamplingParams(max_tokens=1, temperature=0), priority="interactive")
    assert eng.urgent.is_set()  # still set: a step with an interactive sequence runs on regardless
    eng.step()
    assert eng.interrupted_steps == 1 and i.is_finished
    done = [s.num_computed_tokens for s in bg]
    eng.step()  # the batch's step after an interrupted one runs to its end, urgent or not
    assert eng.interrupted_steps == 1 and [s.num_computed_tokens for s in bg] != done
    eng.runner.model = _Calls(eng.model, arrives_mid_pass)
    assert eng.step() == [] and eng.interrupted_steps == 2  # and then it may be interrupted again
    eng.runner.model = eng.model
    eng.urgent.clear()
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in bg] == undisturbed


def test_an_urgent_step_ends_unless_what_is_left_of_it_is_shorter_than_min_left(tiny, monkeypatch):
    """The pass stops at a layer while the layers to come, at the pace of those done, would take
    more than MIN_LEFT_S: late in a long step too (its last quarter of a second-long step was a
    0.3 s wait), never for the last few milliseconds of a short one."""
    import threading

    from meshserve.shared.engine import llm_engine

    model, prompts = tiny
    eng = engine(model, chunk=16)
    eng.urgent = threading.Event()
    eng.add_request("bg", prompts[3], SamplingParams(max_tokens=4, temperature=0), priority="background")
    batch = eng.scheduler.schedule()
    now = [100.0]
    monkeypatch.setattr(llm_engine.time, "perf_counter", lambda: now[0])
    stop = eng._stop(batch)
    layers, left = model.cfg.num_hidden_layers, llm_engine.MIN_LEFT_S
    assert not stop(0)  # nothing asked
    eng.urgent.set()
    assert stop(0)  # nothing done yet
    per_layer = 4 * left  # a long step: even its last layer is worth ending
    now[0] += per_layer * (layers - 1)
    assert stop(layers - 1)
    now[0] = 100.0 + (left / 4) * (layers - 1)  # a short one: its last layer is not
    assert not stop(layers - 1)


class _Calls:
    """Calls `fn` in place of a model, and reads every other attribute from the model."""

    def __init__(self, model, fn):
        self._model, self._fn = model, fn

    def __call__(self, *args, **kw):
        return self._fn(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_fcfs_ignores_priorities(tiny):
    """--scheduling fcfs: an interactive request waits its turn behind running and waiting
    background ones, and nothing is preempted for it."""
    model, prompts = tiny
    eng = engine(model, max_seqs=2, policy="fcfs")
    long = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"bg{i}", prompts[i], long, priority="background")
    first: dict[str, int] = {}
    clock = Clock()
    step(eng, clock, first, 0)
    eng.add_request("inter", prompts[5], long, priority="interactive")
    i = 1
    while eng.has_unfinished():
        step(eng, clock, first, i)
        i += 1
    assert first["inter"] > max(first[f"bg{k}"] for k in range(4))
    assert eng.scheduler.num_preemptions == 0


# -- the mesh


def stream_events(url: str, model: str, prompt: str, n: int, priority: str, events: list, name: str,
                  ids: dict | None = None) -> str:
    """One streaming completion; appends ("first"/"tok"/"done", name, time) to events (and puts the
    request's id, as the request log has it, in ids[name])."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    text = ""
    for c in client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "priority": priority}):
        if ids is not None:
            ids[name] = c.id.removeprefix("cmpl-")
        piece = c.choices[0].text if c.choices else ""
        if piece:
            events.append(("first" if not text else "tok", name, time.monotonic()))
        text += piece
    events.append(("done", name, time.monotonic()))
    return text


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_mesh_interactive_preempts_background_by_swap_and_both_resume_exactly(tiny_llama, tmp_path, kv_cache_dtype):
    """One worker with two seats, both taken by long background streams: an interactive request
    preempts one of them (its KV goes to the kv-pool's host tier, block ids only on the bus) long
    before either finishes; the background streams resume and still give the engine's tokens.
    /metrics counts the preemption by mode. With `--kv-cache-dtype int8` the node's arena holds
    int8 rows with their scales, and the host tier's copies carry them."""
    from mesh_util import Mesh
    from meshserve.shared.engine.llm import LLM

    prompts = ["The quick brown fox", "Once upon a time"]
    llm = LLM(str(tiny_llama), "float32", kv_cache_dtype=kv_cache_dtype)
    want = [c.text for c in llm.generate(prompts + ["Tell me a joke"],
                                         [SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)] * 2
                                         + [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])]
    with Mesh(tiny_llama, tmp_path, prefill=0, decode=1,
              extra=["--max-num-seqs", "2", "--preemption-mode", "swap", "--kv-cache-dtype", kv_cache_dtype]) as mesh:
        # The background streams last about a second on this tiny model, so a hiccup of the loaded
        # machine while the interactive request is on its way can let them finish first: the
        # scenario gets three tries; every try must give the engine's texts, one the ordering.
        for attempt in range(3):
            events: list = []
            with concurrent.futures.ThreadPoolExecutor(3) as ex:
                bg = [ex.submit(stream_events, mesh.url, mesh.model, p, 200, "background", events, f"bg{i}")
                      for i, p in enumerate(prompts)]
                deadline = time.monotonic() + 60
                while sum(e[0] == "first" for e in list(events)) < 2 and time.monotonic() < deadline:
                    time.sleep(0.002)
                sent = len(events)
                inter = ex.submit(stream_events, mesh.url, mesh.model, "Tell me a joke", 8, "interactive", events, "i")
                texts = [f.result(timeout=120) for f in bg] + [inter.result(timeout=120)]
            assert texts == want
            at_first = next(k for k, e in enumerate(events) if e[:2] == ("first", "i"))
            bg_tokens_meanwhile = sum(e[1] != "i" for e in events[sent:at_first])
            finished_first = any(e[0] == "done" for e in events[:at_first])
            if not finished_first and bg_tokens_meanwhile < 100:  # waiting for a seat would be ~200
                break
        assert not finished_first, "the background streams finished first"
        assert bg_tokens_meanwhile < 100, bg_tokens_meanwhile
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the worker's next heartbeat carries its counters
            status = mesh.ask("scheduler.status")
            if status["preemptions_by_mode"].get("swap", 0) >= 1:
                break
            time.sleep(0.1)
        assert status["preemptions_by_mode"]["swap"] >= 1 and status["num_priority_preemptions"] >= 1
        metrics = httpx.get(mesh.url + "/metrics").text
        swapped = re.search(r'^meshserve:preemptions_total\{[^}]*mode="swap"[^}]*\} (\S+)$', metrics, re.M)
        assert swapped and float(swapped.group(1)) >= 1, metrics
        pool = mesh.ask("kv.node0.status")
        # Out to the host tier; back from it, or from the prefix cache when its blocks were still there.
        assert pool["swap"]["swapped_out"] > 0, pool
        assert mesh.ask("kv.node0.arena")["dtype"] == ("int8" if kv_cache_dtype == "int8" else "float32")


def test_mesh_queues_requests_instead_of_parking_them_behind_a_busy_worker(tiny_llama, tmp_path):
    """Two workers of one seat each. On the idle mesh, requests one after another start at once
    (admission does not wait for a heartbeat). With one worker busy on a long request, short
    requests wait in the scheduler's queue and go to a worker as it frees up: no worker is ever
    assigned more than its one seat (the scheduler's status, polled throughout), and the request
    log names the worker of each (the shorts run on the other one while the long one runs)."""
    import threading

    import orjson
    from mesh_util import Mesh

    log = tmp_path / "requests.jsonl"
    with Mesh(tiny_llama, tmp_path, prefill=0, decode=2, extra=["--max-num-seqs", "1"],
              env={"MESHSERVE_REQUEST_LOG": str(log)}) as mesh:
        deadline = time.monotonic() + 60
        while len(mesh.ask("scheduler.status")["workers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        for k in range(5):
            stream_events(mesh.url, mesh.model, f"Hello {k}", 2, "background", [], "r")
        wait = mesh.ask("scheduler.status")["queue_wait"]
        assert wait["count"] == 5 and wait["max_s"] < 0.05, wait  # a heartbeat is every 0.5 s

        events, ids, assigned, done = [], {}, [], threading.Event()

        def poll() -> None:
            while not done.is_set():
                assigned.append({w["id"]: w["assigned"] for w in mesh.ask("scheduler.status")["workers"]})

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            long = ex.submit(stream_events, mesh.url, mesh.model, "Once upon a time", 230, "background", events,
                             "long", ids)
            while not any(e[0] == "first" for e in list(events)) and time.monotonic() < deadline + 180:
                time.sleep(0.002)
            poller = ex.submit(poll)
            shorts = [ex.submit(stream_events, mesh.url, mesh.model, f"Numbers: {k}", 10, "background", events,
                                f"s{k}", ids) for k in range(4)]
            try:
                for f in shorts + [long]:
                    f.result(timeout=120)
            finally:
                done.set()
            poller.result(timeout=30)
        assert len(assigned) >= 3 and max(n for a in assigned for n in a.values()) == 1, assigned
        by_id = {r["id"]: r for r in (orjson.loads(line) for line in log.read_text().splitlines())}
        worker = {name: by_id[rid]["workers"] for name, rid in ids.items()}
        assert all(len(w) == 1 for w in worker.values()), worker
        assert any(worker[n] != worker["long"] for n in worker if n != "long"), worker
        status = mesh.ask("scheduler.status")
        assert status["queued_by_priority"] == {"interactive": 0, "normal": 0, "background": 0}


def test_mesh_normal_wait_is_bounded_under_a_sustained_interactive_flood_and_background_finishes(tiny_llama,
                                                                                                 tmp_path):
    """One worker with two seats and more interactive requests in flight than seats, all the time
    (each of eight clients sends its next one as its last ends): a normal request sent into that
    flood completes while the flood goes on (its guaranteed share of the output tokens; without it
    the flood outranks it until the flood stops, 30 s later, and the test fails), and a background
    request sent before the flood completes once the flood stops. Both give the in-process engine's
    greedy tokens."""
    from mesh_util import Mesh
    from meshserve.shared.engine.llm import LLM

    with Mesh(tiny_llama, tmp_path, prefill=0, decode=1, extra=["--max-num-seqs", "2"]) as mesh:
        stop = False
        flood_done: list[float] = []  # when each interactive request ended

        def flood(k: int) -> None:
            i = 0
            while not stop:
                # Long enough that eight clients keep six waiting behind the two seats.
                stream_events(mesh.url, mesh.model, f"Question {k}.{i}: why?", 200, "interactive", [], "i")
                flood_done.append(time.monotonic())
                i += 1

        with concurrent.futures.ThreadPoolExecutor(10) as ex:
            bg = ex.submit(stream_events, mesh.url, mesh.model, "Once upon a time", 48, "background", [], "bg")
            clients = [ex.submit(flood, k) for k in range(8)]
            deadline = time.monotonic() + 120
            while len(flood_done) < 16 and time.monotonic() < deadline:  # the flood is on
                time.sleep(0.01)
            sent = time.monotonic()
            normal = ex.submit(stream_events, mesh.url, mesh.model, "The normal request", 16, "normal", [], "n")
            concurrent.futures.wait([normal], timeout=30)  # about 1.4 s: 1 s in the scheduler's queue
            finished, stopped = time.monotonic(), normal.done()
            stop = True
            for c in clients:
                c.result(timeout=120)
            normal_text, bg_text = normal.result(timeout=120), bg.result(timeout=120)
        assert stopped, "the normal request did not complete while the interactive flood went on"
        # Interactive requests kept ending while it ran, and after it was done.
        assert any(sent <= t <= finished for t in flood_done) and any(t > finished for t in flood_done)
        status = mesh.ask("scheduler.status")
        assert status["queued_by_priority"] == {"interactive": 0, "normal": 0, "background": 0}
    llm = LLM(str(tiny_llama), "float32")
    want = [c.text for c in llm.generate(["The normal request", "Once upon a time"],
                                         [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                                          SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)])]
    assert [normal_text, bg_text] == want
