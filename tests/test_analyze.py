"""`meshserve analyze` on synthetic request logs: percentiles equal numpy's, the peak of tokens in
flight equals a brute-force count, the rate buckets, the mix, rotated files, and the command itself
(tables, JSON, plots)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import orjson
import pytest

from meshserve.bench import analyze as A

CLASSES = ("interactive", "normal", "background")


def synthetic(n: int = 400, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    arrivals = 1.7e9 + np.cumsum(rng.exponential(0.1, n))
    recs = []
    for i, t in enumerate(arrivals):
        prompt, out = int(rng.lognormal(5, 1)) + 1, int(rng.integers(1, 300))
        ttft = float(rng.uniform(0.01, 0.5))
        ok = i % 25 != 7  # every 25th a failure: 504, no tokens
        recs.append({"arrival": float(t), "id": f"r{i}", "model": "a" if i % 4 else "b", "class": CLASSES[i % 3],
                     "endpoint": "chat" if i % 2 else "completions", "stream": bool(i % 2),
                     "prompt_tokens": prompt, "output_tokens": out if ok else 0,
                     "ttft": ttft if ok else None, "e2e": ttft + out * 0.02 if ok else 2.0,
                     "finish_reason": ("stop" if i % 5 else "length") if ok else None,
                     "error": None if ok else {"status": 504, "message": "timeout"}})
    return recs


def write(path, recs, opener=open):
    with opener(path, "wb") as f:
        for r in recs:
            f.write(orjson.dumps(r) + b"\n")


def brute_force_peak(recs) -> tuple[float, float]:
    """The most tokens (and requests) held at any instant, by checking every arrival: a sum of
    intervals [arrival, arrival + e2e) is largest right at some arrival."""
    best_tokens = best_requests = 0.0
    for r in recs:
        t = r["arrival"]
        live = [x for x in recs if x["arrival"] <= t < x["arrival"] + x["e2e"]]
        best_tokens = max(best_tokens, sum(x["prompt_tokens"] + x["output_tokens"] for x in live))
        best_requests = max(best_requests, len(live))
    return best_tokens, best_requests


def test_percentiles_match_numpy():
    recs = synthetic()
    s = A.analyze(recs)
    ok = [r for r in recs if r["finish_reason"]]
    assert s["requests"] == {"total": 400, "finished": 384, "failed": 16, "errors_by_status": {"504": 16},
                             "finish_reasons": {"stop": sum(1 for r in ok if r["finish_reason"] == "stop"),
                                                "length": sum(1 for r in ok if r["finish_reason"] == "length")}}
    for key in ("prompt_tokens", "output_tokens", "ttft", "e2e"):
        v = np.array([r[key] for r in ok], float)
        got = s[key if key.endswith("tokens") else key + "_s"]
        want = np.percentile(v, [50, 95, 99])
        assert [got["p50"], got["p95"], got["p99"]] == pytest.approx(want.tolist(), rel=1e-12, abs=0)
        assert got["n"] == len(ok) and got["mean"] == pytest.approx(v.mean()) and got["max"] == v.max()
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    assert s["tpot_s"]["p99"] == pytest.approx(np.percentile(tpot, 99))


def test_in_flight_peak_equals_brute_force():
    recs = synthetic(300, seed=1)
    # a few exact coincidences: one ends exactly when the next arrives (not both in flight), and a
    # zero-length one (never in flight)
    recs[10]["e2e"] = recs[11]["arrival"] - recs[10]["arrival"]
    recs[20]["e2e"] = 0.0
    s = A.analyze(recs)
    tokens, requests = brute_force_peak(recs)
    assert s["in_flight"]["peak_tokens"] == pytest.approx(tokens)
    assert s["in_flight"]["peak_requests"] == requests
    t = recs[0]["arrival"] + s["in_flight"]["peak_tokens_t_s"]  # and the peak is where it says
    live = [x for x in recs if x["arrival"] <= t < x["arrival"] + x["e2e"]]
    assert sum(x["prompt_tokens"] + x["output_tokens"] for x in live) == pytest.approx(tokens)
    span = s["span_s"]
    assert s["in_flight"]["mean_tokens"] == pytest.approx(
        sum((r["prompt_tokens"] + r["output_tokens"]) * r["e2e"] for r in recs) / span)


def test_sweep_by_hand():
    # [0, 10) 5 tokens, [2, 4) 3, [4, 6) 7, [4, 4) 100 (empty): levels 5, 8, 12 from 4 to 6, then 5, then 0
    times, levels = A.sweep([0, 2, 4, 4], [10, 4, 6, 4], [5, 3, 7, 100])
    assert times.tolist() == [0, 2, 4, 6, 10] and levels.tolist() == [5, 8, 12, 5, 0]
    assert A.peak(times, levels) == (12, 4)


def test_rate_peaks_troughs_and_mix():
    # 10 s at 1 req/s, 10 s at 5 req/s, 10 s at 1 req/s: buckets of 5 s
    arrivals = np.r_[np.arange(0, 10, 1.0), np.arange(10, 20, 0.2), np.arange(20, 30, 1.0)]
    recs = [{"arrival": 1e9 + float(t), "model": "m", "class": CLASSES[i % 3], "prompt_tokens": 10,
             "output_tokens": 1, "ttft": 0.1, "e2e": 0.1, "finish_reason": "stop", "error": None}
            for i, t in enumerate(arrivals)]
    s = A.analyze(recs, bucket=5)
    r = s["rate"]
    assert r["buckets"] == 6 and r["peak_rps"] == 5 and r["trough_rps"] == 1
    assert {p["t_s"] for p in r["peaks"][:1]} <= {10.0, 15.0} and r["peaks"][0]["rps"] == 5
    assert r["troughs"][0]["rps"] == 1
    assert r["mean_rps"] == pytest.approx((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
    mix = s["mix"]["class"]
    assert {k: v["count"] for k, v in mix.items()} == {"interactive": 24, "normal": 23, "background": 23}
    assert sum(v["share"] for v in mix.values()) == pytest.approx(1)
    assert s["mix"]["model"] == {"m": {"count": 70, "share": 1.0}}


def test_rotated_files_and_the_command(tmp_path, capsys):
    recs = synthetic(200, seed=2)
    logdir = tmp_path / "logs"
    logdir.mkdir()
    write(logdir / "requests.jsonl.2", recs[:50], gzip.open)  # rotations, one compressed
    (logdir / "requests.jsonl.2").rename(logdir / "requests.jsonl.2.gz")
    write(logdir / "requests.jsonl.1", recs[50:120])
    write(logdir / "requests.jsonl", recs[120:])
    with open(logdir / "requests.jsonl", "ab") as f:
        f.write(b'{"arrival": 1, "cut sho')  # a line a crash cut short

    files = A.find_files([str(logdir / "requests.jsonl")])
    assert [f.name for f in files] == ["requests.jsonl.2.gz", "requests.jsonl.1", "requests.jsonl"]
    assert [f.name for f in A.find_files([str(logdir / "requests.jsonl")], rotated=False)] == ["requests.jsonl"]
    assert len(A.find_files([str(logdir / "requests.jsonl*")])) == 3 == len(A.find_files([str(logdir)]))

    out = tmp_path / "summary.json"
    plots = tmp_path / "plots"
    assert A.main([str(logdir / "requests.jsonl"), "--json", str(out), "--plots", str(plots)]) == 0
    printed = capsys.readouterr().out
    assert "200 requests" in printed and "prompt tokens" in printed and "in flight" in printed
    s = json.loads(out.read_text())
    assert s["requests"]["total"] == 200 and s["bad_lines"] == 1 and len(s["files"]) == 3
    ok = [r for r in recs if r["finish_reason"]]
    assert s["prompt_tokens"]["p95"] == pytest.approx(np.percentile([r["prompt_tokens"] for r in ok], 95))
    for name in ("lengths.png", "rate.png", "inflight.png", "mix.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # JSON on stdout, no tables
    assert A.main([str(logdir), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"]["total"] == 200
    # nothing there
    assert A.main([str(tmp_path / "nowhere.jsonl")]) == 2
    (tmp_path / "empty.jsonl").write_text("")
    assert A.main([str(tmp_path / "empty.jsonl")]) == 1


def test_by_worker_groups_requests_by_the_worker_that_finished_them(capsys, tmp_path):
    recs = synthetic(100, seed=3)
    for i, r in enumerate(recs):  # every 3rd handed from the prefill worker to a decode worker
        if r["finish_reason"] is None:
            r["workers"] = []
        elif i % 3 == 0:
            r["workers"] = ["p0", f"d{i % 2}"]
        else:
            r["workers"] = [f"d{i % 2}"]
    recs.append({k: v for k, v in recs[1].items() if k != "workers"})  # a line from before `workers`
    s = A.analyze(recs)
    by = s["by_worker"]
    want = {w: [r for r in recs if (r.get("workers") or ["(none)"])[-1] == w] for w in ("d0", "d1", "(none)")}
    assert set(by) == set(want) and all(by[w]["requests"] == len(rs) for w, rs in want.items())
    assert by["(none)"]["failed"] == 4 and by["(none)"]["finished"] == 1
    assert by["d0"]["handed_over"] == sum(1 for r in want["d0"] if len(r["workers"]) == 2) > 0
    ttfts = [r["ttft"] for r in want["d1"]]
    assert by["d1"]["ttft_s"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    path = tmp_path / "requests.jsonl"
    write(path, recs)
    assert A.main([str(path)]) == 0
    assert "by worker" in capsys.readouterr().out
