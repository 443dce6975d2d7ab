"""`meshserve bench` against servers with known timing: a fake OpenAI server (real HTTP on a free
port) and a fake responder on meshserve's NATS API (real nats-server); and `meshserve compare`'s
engine and Transformers paths on the tiny model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from meshserve.bench import loadgen
from meshserve.bench.report import RequestResult, summarize
from meshserve.bench.workload import load_workload
from mesh_util import free_port

FIRST, GAP = 0.25, 0.04  # the fakes' first-token delay and inter-token delay, seconds


class FakeOpenAI:
    """Streams max_tokens chunks of one token each: the first after FIRST, then one every GAP.
    Refuses "background" requests (400), fails max_tokens == 7 (500), and breaks off
    max_tokens == 9 after two chunks with an error event. Records the most requests in flight."""

    def __init__(self):
        app = FastAPI()
        self.in_flight = self.max_in_flight = 0
        self.received: list[tuple[float, dict]] = []

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.received.append((time.perf_counter(), body))
            n = body["max_tokens"]
            if body.get("priority") == "background":
                return JSONResponse({"error": {"message": "background is refused here", "type": "invalid_request_error",
                                               "param": "priority", "code": None}}, status_code=400)
            if n == 7:
                return PlainTextResponse("internal boom", status_code=500)

            async def events():
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    for i in range(n):
                        await asyncio.sleep(FIRST if i == 0 else GAP)
                        if n == 9 and i == 2:
                            yield 'data: {"error": {"message": "the worker was lost", "code": 500}}\n\n'
                            return
                        chunk = {"object": "text_completion", "choices": [
                            {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                             "total_tokens": len(body["prompt"]) + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake():
    """The fake server runs in this process, whose heap holds everything the suite imported (torch,
    Transformers): a full garbage collection there stalled the server's thread for about a third of a
    second now and then, which the timing checks below read as the server's latency. Frozen, the
    objects that exist now are no longer scanned."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        with FakeOpenAI() as f:
            yield f
    finally:
        gc.unfreeze()


WORKLOAD = {"name": "fake-mix", "num_requests": 16, "prompt_len": {"dist": "uniform", "low": 4, "high": 20},
            "output_len": 10,
            "classes": [{"name": "ok", "share": 0.5},
                        {"name": "refused", "share": 0.125, "priority": "background"},
                        {"name": "boom", "share": 0.125, "output_len": 7},
                        {"name": "broken", "share": 0.125, "output_len": 9},
                        {"name": "slow-slo", "share": 0.125, "slo": {"ttft": 0.05}}]}


def test_bench_command_measures_the_delays_it_was_given(fake, tmp_path):
    wl = tmp_path / "fake.yaml"
    wl.write_text(yaml.safe_dump(WORKLOAD))
    out, plots = tmp_path / "out.json", tmp_path / "plots"
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "bench", "--url", fake.url,
                        "--workload", str(wl), "--seed", "3", "--vocab-size", "300", "--json", str(out),
                        "--plots", str(plots), "--slo-ttft", "1.0", "--slo-tpot", "0.1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert json.loads(r.stdout) == {k: v for k, v in report.items() if k != "per_request"}
    assert "TTFT p99, ms" in r.stderr  # the table, for people
    for m in ("ttft", "tpot", "itl", "e2e"):
        assert set(report[m]) == {"mean", "p50", "p90", "p99"} and all(v is not None for v in report[m].values())
    assert report["requests"] == 16 and report["completed"] == 10 and report["failed"] == 6
    # timing: the fake's delays, plus a little (16 connections opened at once by a cold client on a
    # loaded machine; test_arrivals_and_max_concurrency_are_honoured checks TTFT more tightly)
    timing = {m: report[m] for m in ("ttft", "itl", "tpot", "e2e")}
    assert FIRST <= report["ttft"]["p50"] < FIRST + 0.2 and report["ttft"]["p99"] < FIRST + 0.5, timing
    assert abs(report["itl"]["p50"] - GAP) < 0.015 and abs(report["itl"]["mean"] - GAP) < 0.015, timing
    # one token per chunk here, so TPOT (over tokens, after the first) is the mean gap
    assert abs(report["tpot"]["mean"] - report["itl"]["mean"]) < 0.003, timing
    assert FIRST + 9 * GAP <= report["e2e"]["p50"] < FIRST + 9 * GAP + 0.3, timing
    assert report["output_tokens"] == 100 and report["prompt_tokens"] > 0
    assert abs(report["output_throughput"] - 100 / report["duration_s"]) < 1e-6
    # failures, with their reasons
    reasons = report["failures"]["reasons"]
    assert reasons == {"HTTP 400: background is refused here": 2, "HTTP 500: internal boom": 2,
                       "stream error: the worker was lost": 2}
    classes = report["classes"]
    assert classes["ok"]["completed"] == 8 and classes["ok"]["failed"] == 0
    assert classes["refused"]["failures"]["count"] == 2 and classes["boom"]["failed"] == 2
    # goodput: "slow-slo" asks TTFT <= 50 ms, which the fake never gives; the others meet 1 s / 100 ms
    assert classes["slow-slo"]["good_requests"] == 0 and classes["ok"]["good_requests"] == 8
    assert report["good_requests"] == 8 and abs(report["goodput"] - 8 / report["duration_s"]) < 1e-6
    # the bodies the server got: token ids, the workload's lengths, streaming with usage
    bodies = [b for _, b in fake.received[-16:]]
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 and b["stream_options"]["include_usage"]
               and all(isinstance(t, int) and 0 <= t < 300 for t in b["prompt"]) for b in bodies)
    want = load_workload(wl).generate(3, vocab_size=300)
    assert sorted(json.dumps(b["prompt"]) for b in bodies) == sorted(json.dumps(q.prompt) for q in want)
    assert len(report["per_request"]) == 16
    for name in ("latency_cdf.png", "throughput.png", "concurrency.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arrivals_and_max_concurrency_are_honoured(fake):
    spec = load_workload_from({"name": "c", "num_requests": 8, "prompt_len": 5, "output_len": 3,
                               "arrival": {"pattern": "constant", "rate": 10.0, "max_concurrency": 2}})
    reqs = spec.generate(0, vocab_size=100)
    bodies = [loadgen.build_body(q, "m") for q in reqs]
    fake.max_in_flight = 0
    results = asyncio.run(_run(loadgen.HTTPTarget(fake.url), reqs, bodies, 2))
    assert all(r.ok for r in results) and fake.max_in_flight == 2
    # each request waits for its arrival (0.1 s apart) and for a free slot (a request lasts ~0.33 s)
    for r in results:
        assert r.start >= r.arrival - 1e-3
    assert results[1].arrival - results[0].arrival == pytest.approx(0.1)
    # the second went at its arrival, not later (a slot was free); the first may start a few ms late
    # (its send imports a little), so the gap between the two starts can be under 0.1 s
    assert results[1].start - results[1].arrival < 0.2
    assert results[2].start >= results[0].end - 0.01  # the third waited for the first to finish
    s = summarize(results)
    assert FIRST <= s["ttft"]["p50"] < FIRST + 0.035  # not at the second chunk (FIRST + GAP)
    assert all(FIRST <= r.ttft < FIRST + 0.2 for r in results)


def test_a_while_running_class_stops_arriving_when_the_other_class_is_done(fake):
    """`while_running: batch`: the chat requests arriving after the batch's last one finished are
    not sent (skipped, not failed); those before are."""
    spec = load_workload_from({"name": "w", "num_requests": 12, "prompt_len": 5, "output_len": 3, "classes": [
        {"name": "batch", "share": 2 / 12, "arrival": {"pattern": "all_at_once"}},
        {"name": "chat", "share": 10 / 12, "while_running": "batch",
         "arrival": {"pattern": "constant", "rate": 10.0}}]})
    reqs = spec.generate(0, vocab_size=100)
    results = asyncio.run(_run(loadgen.HTTPTarget(fake.url), reqs, [loadgen.build_body(q, "m") for q in reqs], None))
    batch_end = max(r.end for r in results if r.cls == "batch")  # 3 tokens: FIRST + 2 GAP, about 0.33 s
    chat = [r for r in results if r.cls == "chat"]
    assert all(r.ok for r in results) and 2 <= len(chat) < 10
    assert all(r.arrival <= batch_end + 0.05 for r in chat)
    with pytest.raises(ValueError, match="while_running"):
        load_workload_from({"name": "x", "num_requests": 2, "prompt_len": 1, "output_len": 1,
                            "classes": [{"name": "a", "while_running": "nope"}]})


def test_unreachable_server_is_a_failure_with_its_reason():
    reqs = load_workload_from({"name": "u", "num_requests": 2, "prompt_len": 4, "output_len": 2}).generate(
        0, vocab_size=50)
    results = asyncio.run(_run(loadgen.HTTPTarget(f"http://127.0.0.1:{free_port()}"), reqs,
                               [loadgen.build_body(q, "m") for q in reqs], None))
    s = summarize(results)
    assert s["failed"] == 2 and "ConnectError" in next(iter(s["failures"]["reasons"]))
    assert s["ttft"]["p50"] is None and s["output_throughput"] == 0


def test_nats_api_target(tmp_path):
    """The NATS API as docs/nats-api.md describes it: chunks on the request's reply inbox, then [DONE];
    errors as a chunk with an `error` key (status in the Meshserve-Status header)."""
    import nats
    import orjson

    from meshserve.cli.launcher import nats_server_binary

    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"

    async def main():
        for _ in range(100):
            try:
                nc = await nats.connect(url, max_reconnect_attempts=0)
                break
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.05)
        seen = []

        async def answer(msg):
            body = orjson.loads(msg.data)
            seen.append((msg.subject, body))
            if body["max_tokens"] == 7:
                await nc.publish(msg.reply, orjson.dumps({"error": {"message": "no worker"}}),
                                 headers={"Meshserve-Status": "503"})
            else:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(FIRST if i == 0 else GAP)
                    await nc.publish(msg.reply, orjson.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}))
                await nc.publish(msg.reply, orjson.dumps({"choices": [], "usage": {
                    "prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}}))
            await nc.publish(msg.reply, b"[DONE]")

        async def handler(msg):
            asyncio.get_running_loop().create_task(answer(msg))

        await nc.subscribe("testns.v1.completions", cb=handler)
        await nc.flush()
        spec = load_workload_from({"name": "n", "num_requests": 6, "prompt_len": 6, "output_len": 8,
                                   "classes": [{"name": "ok", "share": 0.5}, {"name": "bad", "share": 0.5, "output_len": 7}]})
        reqs = spec.generate(0, vocab_size=100)
        results = await _run(loadgen.NATSTarget(url, "testns"), reqs, [loadgen.build_body(q, "m") for q in reqs], None)
        await nc.drain()
        return seen, results

    try:
        seen, results = asyncio.run(main())
    finally:
        server.terminate()
        server.wait(10)
    assert len(seen) == 6 and {s for s, _ in seen} == {"testns.v1.completions"}
    s = summarize(results)
    assert s["completed"] == 3 and s["failures"]["reasons"] == {"NATS 503: no worker": 3}
    assert s["ttft"]["p50"] == pytest.approx(FIRST, abs=0.08) and s["itl"]["p50"] == pytest.approx(GAP, abs=0.015)
    assert s["output_tokens"] == 24


def test_compare_engine_and_transformers_on_the_tiny_model(tiny_llama, tmp_path):
    out, wl = tmp_path / "compare.json", tmp_path / "small.yaml"
    wl.write_text(yaml.safe_dump({"name": "small", "num_requests": 6, "prompt_len": {"dist": "uniform", "low": 8, "high": 300},
                                  "output_len": {"dist": "uniform", "low": 4, "high": 12}}))
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "compare", "--workload", str(wl),
                        "--model", str(tiny_llama), "--dtype", "float32", "--skip-mesh",
                        "--hf-batch", "4", "--out", str(out), "--quiet", "--per-request"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["systems"]) == {"meshserve_engine", "transformers"}
    assert res["workload"]["max_model_len"] == 256  # the tiny model's context: lengths clamped to it
    for s in res["systems"].values():
        assert all(q["prompt_tokens"] + q["output_tokens"] <= 256 for q in s["per_request"])
    assert res["workload"]["prompt_len"]["max"] > 200  # (so some were clamped)
    for s in res["systems"].values():
        assert s["completed"] == 6 and s["failed"] == 0
        assert s["output_tokens"] == res["workload"]["output_tokens"]  # ignore_eos: every token asked for
        for m in ("ttft", "tpot", "itl", "e2e"):
            assert s[m]["p50"] > 0
    ratio = res["ratios"]["engine_vs_transformers"]["output_throughput"]
    e, t = res["systems"]["meshserve_engine"], res["systems"]["transformers"]
    assert ratio == pytest.approx(e["output_throughput"] / t["output_throughput"])


def test_bench_tenants_runs_both_policies_on_the_tiny_model(tiny_llama, tmp_path):
    """`meshserve bench-tenants` end to end on a small flood: both runs complete every request and
    report light's latencies, the flood's throughput and the ratios (the figures are docs/benchmarks')."""
    out = tmp_path / "tenants.json"
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "bench-tenants", "--model", str(tiny_llama),
                        "--dtype", "float32", "--flood-requests", "6", "--light-requests", "2", "--max-num-seqs", "2",
                        "--prompt-tokens", "8", "--output-tokens", "8", "--light-gap-s", "0.05", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for run in ("fair", "arrival"):
        got = res["runs"][run]
        assert got["light"]["failed"] == got["flood"]["failed"] == 0 and got["light"]["ttft_s"]["n"] == 2
        assert got["flood"]["output_tokens_per_s"] > 0 and got["all_output_tokens_per_s"] > 0
    assert res["summary"]["light_ttft_p99_fair_over_arrival"] > 0


# --- helpers

def load_workload_from(data: dict):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "w.json"
        p.write_text(json.dumps(data))
        return load_workload(p)


async def _run(target, reqs, bodies, cap) -> list[RequestResult]:
    async with target:
        return await loadgen.run(target, reqs, bodies, cap)


def test_request_bodies_ids_text_and_chat(tmp_path):
    from tiny_model import tiny_tokenizer_json

    from meshserve.shared.models_repo import load_tokenizer

    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(384))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    tok = load_tokenizer(tmp_path)
    special = loadgen.special_ids(tok)
    assert {0, 1, 2} <= special
    reqs = load_workload("priority-mix").generate(0, vocab_size=tok.vocab_size, special_ids=special, num_requests=8)
    q = next(r for r in reqs if r.cls == "interactive")
    ids = loadgen.build_body(q, "m", model_map={"m": "served"})
    assert ids["prompt"] == q.prompt and ids["model"] == "served" and ids["priority"] == "interactive"
    assert ids["max_tokens"] == q.output_len and ids["ignore_eos"] is True and ids["stream"] is True
    text = loadgen.build_body(q, "m", prompt_format="text", tokenizer=tok)
    assert text["prompt"] == tok.decode(q.prompt) and isinstance(text["prompt"], str)
    chat = loadgen.build_body(q, "m", endpoint="chat", tokenizer=tok)
    assert chat["messages"] == [{"role": "user", "content": tok.decode(q.prompt)}] and "prompt" not in chat


def test_engine_adds_requests_at_their_arrival_times(tiny_llama):
    from meshserve.bench.compare import engine_run
    from meshserve.shared.engine.llm import LLM

    llm = LLM(str(tiny_llama), "float32")
    spec = load_workload_from({"name": "e", "num_requests": 4, "prompt_len": 6, "output_len": 5,
                               "arrival": {"pattern": "constant", "rate": 4.0}})
    reqs = spec.generate(0, vocab_size=384, special_ids={0, 1, 2})
    results = engine_run(llm, reqs)
    assert [r.start for r in results] == [0.0, 0.25, 0.5, 0.75]
    for r in results:  # not before it arrived, and not long after (a tiny model's steps are short)
        assert r.ok and r.output_tokens == 5 and r.arrival <= r.chunk_times[0] < r.arrival + 0.5
    capped = engine_run(llm, load_workload_from({"name": "e", "num_requests": 3, "prompt_len": 6, "output_len": 5}
                                                ).generate(0, vocab_size=384), max_concurrency=1)
    for a, b in zip(capped, capped[1:]):  # one at a time: each starts when the one before ended
        assert b.start == a.end and b.chunk_times[0] > a.end


def test_transformers_static_batches_take_what_has_arrived(monkeypatch):
    from meshserve.bench import compare, engine_bench

    batches = []

    def fake_generate(m, prompts, max_new):
        batches.append((time.monotonic(), len(prompts), max_new))
        t = time.monotonic()
        return [t + 0.01 * (i + 1) for i in range(max_new)]

    monkeypatch.setattr(engine_bench, "hf_generate", fake_generate)
    spec = load_workload_from({"name": "h", "num_requests": 7, "prompt_len": 4, "output_len": {"dist": "uniform", "low": 2, "high": 9},
                               "arrival": {"pattern": "bursts", "burst_size": 3, "burst_interval": 0.2}})
    reqs = spec.generate(0, vocab_size=50)
    results = compare.hf_run(None, reqs, batch=2)
    assert [n for _, n, _ in batches] == [2, 1, 2, 1, 1]  # bursts of 3, 3, 1 in batches of at most 2
    assert [m for _, _, m in batches] == [max(q.output_len for q in g) for g in (reqs[0:2], reqs[2:3], reqs[3:5],
                                                                                  reqs[5:6], reqs[6:7])]
    assert batches[2][0] - batches[0][0] >= 0.19  # the second burst was waited for
    for q, r in zip(reqs, results):
        assert r.output_tokens == q.output_len and len(r.chunk_times) == q.output_len and r.start == q.arrival


def test_soak_report_counts_every_outcome_and_flags_the_bad_ones():
    """bench-soak's verdict: a wrong text, a cut stream or a hang fails the run; a lost connection
    counts as allowed only when a gateway kill happened during the request."""
    import argparse

    from meshserve.bench.soak_bench import report

    a = argparse.Namespace(window=30.0, argv=[], minutes=1, fault_every=20, rate=1)
    refs = [{"text": "abc"}, {"text": "xyz"}]
    faults = [{"fault": "kill9:decode", "at": 10.0, "pid": 1}, {"fault": "kill9:gateway", "at": 100.0, "pid": 2}]

    def r(start, e2e, outcome, ref=0, text="abc"):
        return {"start": start, "e2e": e2e, "ttft": 0.1, "outcome": outcome, "ref": ref, "text": text}

    good = [r(0, 1, "ok"), r(11, 2, "ok", 1, "xyz"), r(50, 1, "ok"), r(99, 5, "connection_lost"), r(12, 1, "failed")]
    out = report(a, refs, good, faults, 0.0, {}, {})
    assert out["ok"] and out["accepted"] == 5
    assert out["outcomes"] == {"identical": 3, "different": 0, "failed": 1, "connection_lost": 1, "cut": 0, "hung": 0,
                               "refused": 0}
    assert [out["latency"][p]["n"] for p in ("before", "during", "after")] == [1, 1, 1]
    assert out["faults"][0]["serving_again_after_s"] == 3.0  # the request started at 11 ended at 13
    assert [(u["outcome"], u["start_s"], u["nearest_fault"]["fault"]) for u in out["not_identical"]] == [
        ("connection_lost", 99, "kill9:gateway"), ("failed", 12, "kill9:decode")]  # each named, to look into
    for bad in (r(20, 1, "ok", 1, "abc"), r(20, 1, "cut"), r(20, 1, "hung"), r(20, 1, "connection_lost")):
        assert not report(a, refs, good + [bad], faults, 0.0, {}, {})["ok"], bad


def test_soak_counts_a_request_sent_to_a_dying_gateway_as_its_client():
    """A request sent between a gateway's kill and the moment its process is gone reaches the dying
    process's socket: it is that gateway's client, not an unexplained loss; one sent after is not.
    A mesh that stopped during the run fails it. Memory is followed per process, so a restarted
    service is not read as a grown one."""
    import argparse

    from meshserve.bench.soak_bench import memory_by_process, report

    a = argparse.Namespace(window=30.0, argv=[], minutes=1, fault_every=20, rate=1)
    refs = [{"text": "abc"}]
    faults = [{"fault": "kill9:gateway", "at": 100.0, "gone": 100.05, "pid": 2}]

    def lost(start):
        return {"start": start, "e2e": 0.001, "ttft": None, "outcome": "connection_lost", "ref": 0, "text": ""}

    out = report(a, refs, [lost(100.01)], faults, 0.0, {}, {})
    assert out["ok"] and out["faults"][0]["exited_after_s"] == 0.05
    assert report(a, refs, [lost(100.2)], faults, 0.0, {}, {})["connection_lost_not_at_a_gateway_kill"] == 1
    stopped = report(a, refs, [lost(100.01)], faults, 0.0, {}, {}, stopped=130.0)  # the launcher gave up
    assert not stopped["ok"] and stopped["mesh_stopped_at_s"] == 130.0

    m = lambda pid, anon: {"pid": pid, "rss_mb": 10.0 + anon, "anon_mb": anon}  # noqa: E731
    samples = [(0.0, {"gateway": m(7, 1.0)}), (60.0, {"gateway": m(7, 3.0)}), (120.0, {"gateway": m(8, 1.5)})]
    assert memory_by_process(samples, 0.0) == [
        {"name": "gateway", "pid": 7, "from_s": 0.0, "to_s": 60.0, "rss_mb": [11.0, 13.0], "anon_mb": [1.0, 3.0]},
        {"name": "gateway", "pid": 8, "from_s": 120.0, "to_s": 120.0, "rss_mb": [11.5, 11.5], "anon_mb": [1.5, 1.5]}]
