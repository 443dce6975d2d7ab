"""`meshserve plan`: the worked example of docs/planning.md against a hand calculation, the queueing
formulas against textbook cases, the sensitivity table, and where the inputs come from (a decode
curve, bench reports, a workload, a request log)."""

from __future__ import annotations

import json
import math

import numpy as np
import orjson
import pytest

from meshserve.bench import plan as P

# The worked example (docs/planning.md):
#   rate R = 10 req/s, every prompt 1000 tokens, every output 250 tokens;
#   a prefill worker does 8000 prompt tokens/s, target utilization 0.8;
#   a decode worker's TPOT is 0.010 s at batch 1, 0.020 s at 16, 0.050 s at 64;
#   SLOs: p99 TTFT <= 0.3 s, TPOT <= 0.04 s; KV: 2000 blocks of 16 tokens per decode worker.
EXAMPLE = ["--prefill-tps", "8000", "--decode-curve", "1:0.010,16:0.020,64:0.050", "--rate", "10",
           "--input-len", "1000", "--output-len", "250", "--slo-ttft", "0.3", "--slo-tpot", "0.04",
           "--kv-blocks-per-worker", "2000", "--block-size", "16"]


def test_worked_example_matches_the_hand_calculation(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert P.main(EXAMPLE + ["--json", str(out)]) == 0
    assert "workers needed" in capsys.readouterr().out
    r = json.loads(out.read_text())
    pre, dec = r["prefill"], r["decode"]

    # Prefill, throughput: 10 req/s * 1000 tokens = 10,000 tokens/s;
    #   P = ceil(10,000 / (8000 * 0.8)) = ceil(1.5625) = 2.
    assert pre["tokens_per_s"] == 10_000 and pre["throughput_workers"] == 2
    # TTFT at P = 2. Service time S = 1000 / 8000 = 0.125 s (fixed: cs2 = 0), a = R * S = 1.25,
    #   rho = a / 2 = 0.625. Erlang C for c = 2: C = 2 rho^2 / (1 + rho) = 0.78125 / 1.625 = 0.480769.
    #   Conditional wait mean m = (1 + cs2) / 2 / (c / S - R) = 0.5 / (16 - 10) = 0.083333 s.
    #   p99 wait = m * ln(C / 0.01) = 0.083333 * ln(48.0769) = 0.083333 * 3.872802 = 0.322734 s;
    #   + the p99 prompt's prefill 1000 / 8000 = 0.125 s -> TTFT p99 = 0.447734 s > 0.3: not enough.
    at2 = pre["at_throughput_workers"]
    assert at2["workers"] == 2 and at2["rho"] == pytest.approx(0.625)
    assert at2["p_wait"] == pytest.approx(0.480769, abs=1e-6)
    assert at2["wait_q"] == pytest.approx(0.322734, abs=1e-6) and at2["ttft_q"] == pytest.approx(0.447734, abs=1e-6)
    # P = 3: rho = 1.25 / 3 = 0.416667. Erlang B by recursion: B1 = 1.25 / 2.25 = 0.555556,
    #   B2 = 1.25 * B1 / (2 + 1.25 * B1) = 0.694444 / 2.694444 = 0.257732,
    #   B3 = 1.25 * B2 / (3 + 1.25 * B2) = 0.322165 / 3.322165 = 0.096974;
    #   C = B3 / (1 - rho (1 - B3)) = 0.096974 / (1 - 0.416667 * 0.903026) = 0.096974 / 0.623739 = 0.155473.
    #   m = 0.5 / (24 - 10) = 0.035714; p99 wait = 0.035714 * ln(15.5473) = 0.035714 * 2.743884 = 0.097996 s;
    #   TTFT p99 = 0.097996 + 0.125 = 0.222996 s <= 0.3: P = 3, set by the TTFT SLO.
    at3 = pre["at_workers"]
    assert pre["workers"] == r["P"] == 3 and pre["limited_by"] == "slo_ttft"
    assert at3["p_wait"] == pytest.approx(0.155473, abs=1e-6)
    assert at3["wait_q"] == pytest.approx(0.097996, abs=1e-6) and at3["ttft_q"] == pytest.approx(0.222996, abs=1e-6)

    # Decode: TPOT 0.04 s lies between batch 16 (0.020) and 64 (0.050):
    #   B* = 16 + (0.04 - 0.02) / (0.05 - 0.02) * (64 - 16) = 16 + 32 = 48, TPOT(48) = 0.04 s,
    #   48 / 0.04 = 1200 output tokens/s per worker. Output: 10 * 250 = 2500 tokens/s;
    #   D = ceil(2500 / 1200) = ceil(2.083) = 3.
    assert r["inputs"]["decode_point"]["batch"] == 48 and dec["tps_per_worker"] == pytest.approx(1200)
    assert dec["tokens_per_s"] == 2500 and dec["throughput_workers"] == 3
    # KV: sequences decoding (Little) = 10 * 250 * 0.04 = 100. Each holds, over its decode,
    #   TPOT * (in*out + out(out+1)/2 + out*(16-1)/2) = 0.04 * (250,000 + 31,375 + 1,875) token-seconds,
    #   so KV in use = 10 * 0.04 * 283,250 = 113,300 tokens; a worker holds 2000 * 16 = 32,000:
    #   ceil(113,300 / 32,000) = ceil(3.54) = 4 > 3: D = 4, set by KV.
    assert dec["sequences_in_flight"] == pytest.approx(100)
    assert dec["kv_tokens_in_use"] == pytest.approx(113_300) and dec["kv_workers"] == 4
    assert dec["workers"] == r["D"] == 4 and dec["limited_by"] == "kv"
    assert r["P_to_D"] == pytest.approx(0.75)

    # Sensitivity, E[in] + E[out] = 1250 kept, ratio 1: 625 and 625.
    #   Prefill: ceil(10 * 625 / 6400) = 1; at P = 1 (M/D/1): rho = C = 10 * 625 / 8000 = 0.78125,
    #   m = 0.5 / (12.8 - 10) = 0.178571, p99 wait = 0.178571 * ln(78.125) = 0.778270 s: too slow;
    #   P = 2: a = 0.78125, C = a^2 / (2 + a) = 0.219453, m = 0.5 / (25.6 - 10) = 0.032051,
    #   p99 wait = 0.032051 * ln(21.9453) = 0.098993; + 625 / 8000 = 0.078125 -> 0.177118 <= 0.3: P = 2.
    #   Decode: ceil(6250 / 1200) = 6 by throughput; KV: 10 * 0.04 * (625 * 625 + 625 * 626 / 2 + 625 * 7.5)
    #   = 0.4 * 590,937.5 = 236,375 tokens -> ceil(7.39) = 8.
    row = next(x for x in r["sensitivity"] if x["ratio"] == 1)
    assert (row["mean_input"], row["mean_output"]) == (625, 625)
    assert (row["P"], row["P_limited_by"], row["D"], row["D_limited_by"]) == (2, "slo_ttft", 8, "kv")
    assert [x["current"] for x in r["sensitivity"]].count(True) == 1
    assert next(x for x in r["sensitivity"] if x["current"])["ratio"] == 4


def test_queueing_formulas():
    # M/M/1: C = rho; mean wait rho / (mu - lambda)
    assert P.erlang_c(1, 0.7) == pytest.approx(0.7)
    w = P.prefill_wait(1, rate=7, mean_s=0.1, cs2=1.0, q=0.99)
    assert w["mean_wait"] == pytest.approx(0.7 / (10 - 7))
    # and its exact p99: P(W > t) = rho exp(-(mu - lambda) t)
    assert w["wait_q"] == pytest.approx(math.log(0.7 / 0.01) / 3)
    # M/M/2 closed form, and the textbook c = 5, a = 4: C = 0.5541
    assert P.erlang_c(2, 1.5) == pytest.approx(2 * 0.75 ** 2 / 1.75)
    assert P.erlang_c(5, 4.0) == pytest.approx(0.55411, abs=1e-5)
    # deterministic service halves the M/M/c wait (Allen-Cunneen); no queue below 1 - q
    assert P.prefill_wait(3, 10, 0.125, 0.0, 0.99)["mean_wait"] == pytest.approx(
        P.prefill_wait(3, 10, 0.125, 1.0, 0.99)["mean_wait"] / 2)
    assert P.prefill_wait(50, 1, 0.1, 1.0, 0.99)["wait_q"] == 0
    assert P.prefill_wait(2, 30, 0.1, 1.0, 0.99)["wait_q"] == math.inf  # overloaded


def test_decode_points():
    curve = P.parse_curve("16:0.020,1:0.010,64:0.050")
    assert curve[0] == (1, 0.010)
    pt, _ = P.point_from_curve(curve, 0.015)  # between 1 and 16: 1 + 0.5 * 15 = 8.5 -> batch 8
    assert pt.batch == 8 and pt.tpot == pytest.approx(0.010 + 7 / 15 * 0.010)
    assert P.point_from_curve(curve, 0.005)[0] is None  # even batch 1 is too slow
    assert P.point_from_curve(curve, 1.0)[0].batch == 64  # not extrapolated
    assert P.point_from_curve(curve, None)[0].tps == pytest.approx(64 / 0.05)
    pts = [P.DecodePoint(900, 0.03), P.DecodePoint(1500, 0.06), P.DecodePoint(700, None)]
    assert P.pick_point(pts, 0.04)[0].tps == 900
    assert P.pick_point(pts, None)[0].tps == 1500
    assert P.pick_point(pts[:2], 0.01)[0] is None


def bench_report(output_tps: float, tpot_p99: float, ttft_p50: float) -> dict:
    """The shape `meshserve bench --json` writes (bench/report.py), trimmed."""
    stats = lambda x: {"mean": x, "p50": x, "p90": x, "p99": x}  # noqa: E731
    return {"command": "meshserve bench ...", "requests": 4, "completed": 4, "prompt_tokens": 2000,
            "output_tokens": 800, "output_throughput": output_tps, "ttft": stats(ttft_p50),
            "tpot": stats(tpot_p99), "itl": stats(0.02), "e2e": stats(5.0),
            "classes": {"default": {"output_throughput": output_tps, "tpot": stats(9.9)}},
            "per_request": [{"prompt_tokens": 500, "ttft": t, "output_tokens": 200} for t in (0.1, 0.2, 0.25, 1.0)]}


def test_from_bench(tmp_path, capsys):
    a, b = tmp_path / "low.json", tmp_path / "high.json"
    a.write_text(json.dumps(bench_report(1800, 0.03, 0.2)))
    b.write_text(json.dumps(bench_report(3000, 0.06, 0.5)))
    points, prefill, used = P.from_bench([str(a), str(b)], decode_workers=2, tpot_stat="p99")
    assert [p.tps for p in points] == [900, 1500] and [p.tpot for p in points] == [0.03, 0.06]
    # per-request prompt tokens / TTFT: 5000, 2500, 2000, 500 -> median 2250
    assert prefill == pytest.approx(2250) and len(used) == 2
    out = tmp_path / "plan.json"
    assert P.main(["--from-bench", str(a), "--from-bench", str(b), "--decode-workers-in-bench", "2",
                   "--slo-tpot", "0.04", "--rate", "2", "--input-len", "500", "--output-len", "200",
                   "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    # the 1500 tok/s run misses the TPOT SLO: 900 per worker; ceil(2 * 200 / 900) = 1;
    # prefill ceil(2 * 500 / (2250 * 0.8)) = ceil(0.556) = 1
    assert r["decode"]["tps_per_worker"] == 900 and r["D"] == 1 and r["P"] == 1
    assert r["inputs"]["prefill_tps"] == pytest.approx(2250)
    # nothing meets the SLO: an error, not a plan
    assert P.main(["--from-bench", str(b), "--slo-tpot", "0.01", "--prefill-tps", "1000", "--rate", "1",
                   "--input-len", "10", "--output-len", "10"]) == 1
    assert "no decode operating point" in capsys.readouterr().err


def test_lengths():
    u = P.parse_length("uniform:32:256")
    assert u.min() == 32 and u.max() == 256 and u.mean() == pytest.approx(144, rel=0.01)
    assert P.parse_length("{dist: fixed, value: 7}").tolist() == [7]
    ln = P.parse_length("{dist: lognormal, median: 200, sigma: 1.0, max: 1000}")
    assert np.median(ln) == pytest.approx(200, rel=0.02) and ln.max() == 1000
    assert P.parse_length("normal:-5:1").min() == 1  # clipped to min 1
    for bad in ("ten", "uniform:1", "{dist: trace, file: x, field: y}", "zipf:3"):
        with pytest.raises(ValueError):
            P.parse_length(bad)
    # independent lengths: E[in * out] = E[in] E[out]; paired ones (a log, a workload) use the pairs
    L = P.Lengths(np.array([1.0, 3.0]), np.array([3.0, 1.0]), paired=True)
    assert L.e_xy() == 3.0 and P.Lengths(L.x, L.y).e_xy() == 4.0


def test_from_log(tmp_path):
    log = tmp_path / "requests.jsonl"
    recs = [{"arrival": 1e9 + i, "prompt_tokens": 100 * (i + 1), "output_tokens": 10, "e2e": 1.0, "ttft": 0.1,
             "finish_reason": "stop"} for i in range(4)]
    recs.append({"arrival": 1e9 + 9, "prompt_tokens": 99999, "output_tokens": 0, "e2e": 1.0,
                 "finish_reason": None, "error": {"status": 499}})  # not finished: left out
    log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    L = P.lengths_from_log([str(log)])
    assert L.paired and L.x.tolist() == [100, 200, 300, 400] and L.mean_y == 10
    out = tmp_path / "plan.json"
    assert P.main(["--from-log", str(log), "--rate", "1", "--prefill-tps", "1000", "--decode-tps", "100",
                   "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["inputs"]["lengths"]["input"]["mean"] == 250 and r["P"] == 1 and r["D"] == 1


def test_from_workload(tmp_path):
    pytest.importorskip("meshserve.bench.workload")
    out = tmp_path / "plan.json"
    # mixed-chat: Poisson at 2 req/s, so no --rate is needed
    assert P.main(["--workload", "mixed-chat", "--prefill-tps", "4000", "--decode-tps", "500",
                   "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["inputs"]["rate"] == 2.0 and r["inputs"]["lengths"]["paired"]
    assert r["prefill"]["tokens_per_s"] == pytest.approx(2.0 * r["inputs"]["lengths"]["input"]["mean"])


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        P.main(["--prefill-tps", "1", "--decode-tps", "1", "--rate", "1", "--input-len", "10"])
    with pytest.raises(SystemExit):
        P.main(["--decode-tps", "1", "--rate", "1", "--input-len", "10", "--output-len", "10"])  # no prefill
    # a p99 prompt that alone exceeds the TTFT SLO: infeasible, exit 1
    assert P.main(["--prefill-tps", "1000", "--decode-tps", "100", "--rate", "1", "--input-len", "5000",
                   "--output-len", "10", "--slo-ttft", "1", "--json", "-"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["P"] is None and "no number of workers" in r["prefill"]["note"]
