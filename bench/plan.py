"""`meshserve plan`: how many prefill and decode workers a workload needs at a request rate and SLOs.

    meshserve plan --prefill-tps 8000 --decode-curve 1:0.010,16:0.020,64:0.050 --rate 10 \\
                   --input-len 1000 --output-len 250 --slo-ttft 0.3 --slo-tpot 0.04 \\
                   [--kv-blocks-per-worker 2000 --block-size 16] [--json OUT]

The model, its assumptions and a worked example are in docs/planning.md. In short:

- prefill: P = ceil(R * E[in] / (prefill_tps * utilization)), then more workers until the TTFT of
  the --ttft-quantile prompt (queueing in an M/G/c approximation + its own prefill time) meets
  --slo-ttft;
- decode: the operating point is the fastest measured one whose time per output token meets
  --slo-tpot (from --decode-curve, interpolated in the batch size; from bench runs; or
  --decode-tps as given); D = ceil(R * E[out] / (decode_tps * decode_utilization)), then more
  workers if the KV the decoding sequences hold (Little's law) exceeds --kv-blocks-per-worker;
- sensitivity: P, D and P:D as the input/output ratio moves (--sweep total: E[in] + E[out] fixed;
  input: E[out] fixed; output: E[in] fixed).

Where the numbers come from: --prefill-tps / --decode-tps given, or --from-bench with the JSON of
`meshserve bench --json` (several files: several operating points); lengths from --input-len and
--output-len (a number, `uniform:LOW:HIGH`, `normal:MEAN:STD`, `lognormal:MEDIAN:SIGMA`,
`exp:MEAN`, or a workload-style mapping such as "{dist: uniform, low: 32, high: 256}"), a
--workload (a file or a shipped name, bench/workloads/) or a gateway request log
(--from-log, see `meshserve analyze`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshserve.cli.errors import ArgumentParser

SAMPLES = 100_000  # draws per parametric length distribution (seed 0: the plan is deterministic)
DEFAULT_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
BENCH_TPOT_STATS = ("p99", "p90", "p50", "mean")


# ------------------------------------------------------------------ lengths


@dataclass
class Lengths:
    """Prompt (x) and output (y) lengths, tokens. `paired`: x[i] and y[i] are one request's."""

    x: np.ndarray
    y: np.ndarray
    paired: bool = False
    source: str = ""

    def scaled(self, sx: float, sy: float) -> "Lengths":
        return Lengths(self.x * sx, self.y * sy, self.paired, self.source)

    @property
    def mean_x(self) -> float:
        return float(np.mean(self.x))

    @property
    def mean_y(self) -> float:
        return float(np.mean(self.y))

    def e_xy(self) -> float:
        return float(np.mean(self.x * self.y)) if self.paired else self.mean_x * self.mean_y

    def describe(self) -> dict:
        out = {"source": self.source, "paired": self.paired}
        for name, v in (("input", self.x), ("output", self.y)):
            out[name] = {"mean": float(np.mean(v)), "cv2": _cv2(v),
                         **{f"p{q}": float(x) for q, x in zip((50, 95, 99), np.percentile(v, [50, 95, 99]))}}
        return out


def _cv2(v: np.ndarray) -> float:
    m = float(np.mean(v))
    return float(np.var(v)) / (m * m) if m > 0 else 0.0


def parse_length(spec: str) -> np.ndarray:
    """A length distribution as samples: `N`, `uniform:LOW:HIGH`, `normal:MEAN:STD`,
    `lognormal:MEDIAN:SIGMA`, `exp:MEAN`, or a YAML mapping in the workload files' format
    ({dist: fixed|uniform|normal|lognormal, ..., min, max}). Rounded and clipped to [min (1), max]."""
    s = spec.strip()
    lo, hi = 1, None
    if s.startswith("{"):
        import yaml

        d = yaml.safe_load(s)
        if not isinstance(d, dict) or "dist" not in d:
            raise ValueError(f"length {spec!r}: a mapping needs 'dist'")
        d = dict(d)
        kind = d.pop("dist")
        lo, hi = d.pop("min", 1), d.pop("max", None)
        if kind == "fixed":
            args = [d.pop("value")]
        elif kind == "uniform":
            args = [d.pop("low"), d.pop("high")]
        elif kind == "normal":
            args = [d.pop("mean"), d.pop("std")]
        elif kind == "lognormal":
            median = d.pop("median", None)
            mu = d.pop("mu", None)
            if (median is None) == (mu is None):
                raise ValueError(f"length {spec!r}: lognormal takes median or mu")
            args = [median if median is not None else math.exp(mu), d.pop("sigma")]
        else:
            raise ValueError(f"length {spec!r}: dist must be fixed, uniform, normal or lognormal (a 'trace' "
                             "needs its workload file: use --workload)")
        if d:
            raise ValueError(f"length {spec!r}: unknown keys {sorted(d)}")
    else:
        parts = s.split(":")
        kind, args = (("fixed", parts) if len(parts) == 1 else (parts[0], parts[1:]))
        try:
            args = [float(a) for a in args]
        except ValueError:
            raise ValueError(f"length {spec!r}: not a number, uniform:LOW:HIGH, normal:MEAN:STD, "
                             "lognormal:MEDIAN:SIGMA or exp:MEAN") from None
    want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
    if kind not in want or len(args) != want[kind]:
        raise ValueError(f"length {spec!r}: {kind} takes {want.get(kind, '?')} number(s)")
    rng = np.random.default_rng(0)
    if kind == "fixed":
        x = np.array([float(args[0])])
    elif kind == "uniform":
        x = rng.integers(int(args[0]), int(args[1]) + 1, SAMPLES).astype(float)
    elif kind == "normal":
        x = rng.normal(args[0], args[1], SAMPLES)
    elif kind == "lognormal":
        x = rng.lognormal(math.log(args[0]), args[1], SAMPLES)
    else:
        x = rng.exponential(args[0], SAMPLES)
    x = np.clip(np.rint(x), lo, hi if hi is not None else np.inf)
    if x.size == 0 or np.any(x < 0):
        raise ValueError(f"length {spec!r}: lengths must be non-negative")
    return x


def lengths_from_cli(input_len: str, output_len: str) -> Lengths:
    x, y = parse_length(input_len), parse_length(output_len)
    return Lengths(x, y, paired=False, source=f"--input-len {input_len} --output-len {output_len}")


def lengths_from_workload(name: str, max_model_len: int, n: int = 4000) -> tuple[Lengths, dict]:
    """The workload's requests (n of them, its own generator: classes, traces, clipping and context
    scaling as `meshserve bench` sends them); prompt lengths include shared prefixes. Also what the
    workload says about rate and SLOs."""
    from meshserve.bench.workload import generate, load_workload

    spec = load_workload(name)
    reqs = generate(spec, vocab_size=64, max_model_len=max_model_len, num_requests=max(n, spec.num_requests))
    x = np.array([q.prompt_len for q in reqs], float)
    y = np.array([q.output_len for q in reqs], float)
    hints: dict = {}
    arr = spec.arrival
    if arr.pattern in ("poisson", "constant") and arr.rate and all(c.arrival is None for c in spec.classes):
        hints["rate"] = arr.rate
    for key in ("ttft", "tpot"):
        vals = [c.slo[key] for c in spec.classes if key in c.slo]
        if vals:
            hints[f"slo_{key}"] = min(vals)  # the strictest class
    return Lengths(x, y, paired=True, source=f"workload {spec.name}"), hints


def lengths_from_log(paths: list[str]) -> Lengths:
    """Finished requests of gateway request logs (with their rotations)."""
    from meshserve.bench.analyze import find_files, load

    records, _ = load(find_files(paths))
    ok = [r for r in records if r.get("finish_reason") is not None
          and isinstance(r.get("prompt_tokens"), (int, float)) and isinstance(r.get("output_tokens"), (int, float))]
    if not ok:
        raise ValueError(f"no finished requests in {', '.join(paths)}")
    return Lengths(np.array([r["prompt_tokens"] for r in ok], float), np.array([r["output_tokens"] for r in ok], float),
                   paired=True, source=f"request log ({len(ok)} finished requests)")


# ------------------------------------------------------------------ decode operating points


@dataclass
class DecodePoint:
    tps: float  # output tokens/s one decode worker produces here
    tpot: float | None  # seconds per output token of a sequence here (None: unknown)
    batch: float | None = None  # sequences per worker here, when known
    source: str = ""


def parse_curve(text: str) -> list[tuple[float, float]]:
    """`B:TPOT,B:TPOT,...` (batch size, seconds per token) -> sorted points."""
    pts = []
    for item in text.split(","):
        b, t = item.split(":")
        pts.append((float(b), float(t)))
    pts.sort()
    if not pts or any(b < 1 or t <= 0 for b, t in pts):
        raise ValueError("--decode-curve: batch sizes >= 1 and positive TPOTs, e.g. 1:0.010,16:0.020,64:0.050")
    if any(t2 < t1 for (_, t1), (_, t2) in zip(pts, pts[1:])):
        raise ValueError("--decode-curve: TPOT must not fall as the batch grows")
    return pts


def point_from_curve(pts: list[tuple[float, float]], slo_tpot: float | None) -> tuple[DecodePoint | None, str]:
    """The largest (integer) batch whose interpolated TPOT meets the SLO; no extrapolation."""
    bs, ts = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if slo_tpot is None:
        b, note = bs[-1], "no TPOT SLO: the largest measured batch"
    elif ts[0] > slo_tpot:
        return None, f"even batch {bs[0]:g} takes {ts[0]:g} s per token > the TPOT SLO {slo_tpot:g} s"
    elif ts[-1] <= slo_tpot:
        b, note = bs[-1], "the largest measured batch meets the SLO (the curve is not extrapolated)"
    else:
        j = int(np.searchsorted(ts, slo_tpot, side="right"))  # ts[j-1] <= slo < ts[j]
        b = bs[j - 1] + (slo_tpot - ts[j - 1]) / (ts[j] - ts[j - 1]) * (bs[j] - bs[j - 1])
        b = max(bs[j - 1], math.floor(b + 1e-9))
        note = f"TPOT({b:g}) <= {slo_tpot:g} s, interpolated between batches {bs[j - 1]:g} and {bs[j]:g}"
    t = float(np.interp(b, bs, ts))
    return DecodePoint(tps=b / t, tpot=t, batch=float(b), source=f"--decode-curve: {note}"), note


def pick_point(points: list[DecodePoint], slo_tpot: float | None) -> tuple[DecodePoint | None, str]:
    """The highest-throughput point whose TPOT meets the SLO (points with an unknown TPOT count as
    meeting it, said so in the note)."""
    if slo_tpot is None:
        best = max(points, key=lambda p: p.tps)
        return best, "no TPOT SLO: the fastest point"
    ok = [p for p in points if p.tpot is None or p.tpot <= slo_tpot]
    if not ok:
        return None, f"no decode operating point meets the TPOT SLO {slo_tpot:g} s " \
                     f"(best: {min(p.tpot for p in points):g} s)"
    best = max(ok, key=lambda p: p.tps)
    note = "TPOT unknown: the SLO is not checked" if best.tpot is None else f"TPOT {best.tpot:g} s <= {slo_tpot:g} s"
    return best, note


# ------------------------------------------------------------------ bench reports


def _bench_reports(data) -> list[dict]:
    """Run reports inside a bench JSON: dicts with an output_throughput and a tpot dict (not the
    per-class or per-model breakdowns inside a report)."""
    found = []
    if isinstance(data, dict):
        if isinstance(data.get("output_throughput"), (int, float)) and isinstance(data.get("tpot"), dict):
            return [data]
        for k, v in data.items():
            if k not in ("classes", "models", "per_request"):
                found += _bench_reports(v)
    elif isinstance(data, list):
        for v in data:
            found += _bench_reports(v)
    return found


def from_bench(paths: list[str], decode_workers: int, tpot_stat: str) -> tuple[list[DecodePoint], float | None, list]:
    """Decode points (output tokens/s per decode worker, the run's TPOT statistic) and a prefill
    estimate (the median over requests of prompt tokens / TTFT, the best run's) from
    `meshserve bench --json` files. What was read, per run, is returned too."""
    points, prefill, used = [], None, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        reports = _bench_reports(data)
        if not reports:
            raise ValueError(f"{path}: no bench run found (expected `meshserve bench --json` output: "
                             "output_throughput and a tpot dict)")
        for i, rep in enumerate(reports):
            tpot = rep.get("tpot") or {}
            stat = next((s for s in (tpot_stat, *BENCH_TPOT_STATS) if isinstance(tpot.get(s), (int, float))), None)
            name = f"{path}" + (f"[{i}]" if len(reports) > 1 else "")
            tps = rep["output_throughput"] / decode_workers
            points.append(DecodePoint(tps=tps, tpot=tpot.get(stat) if stat else None,
                                      source=f"bench {name}: output {rep['output_throughput']:.4g} tok/s / "
                                             f"{decode_workers} worker(s), TPOT {stat or 'unknown'}"))
            est = _prefill_estimate(rep)
            if est is not None:
                prefill = est if prefill is None else max(prefill, est)
            used.append({"file": name, "output_throughput": rep["output_throughput"], "tpot_stat": stat,
                         "tpot": tpot.get(stat) if stat else None, "decode_tps_per_worker": tps,
                         "prefill_tps_estimate": est})
    return points, prefill, used


def _prefill_estimate(rep: dict) -> float | None:
    per = [r for r in rep.get("per_request") or [] if isinstance(r, dict)
           and isinstance(r.get("ttft"), (int, float)) and r["ttft"] > 0 and isinstance(r.get("prompt_tokens"), int)]
    if per:
        return float(np.median([r["prompt_tokens"] / r["ttft"] for r in per]))
    ttft = (rep.get("ttft") or {}).get("p50")
    completed = rep.get("completed")
    if isinstance(ttft, (int, float)) and ttft > 0 and completed and isinstance(rep.get("prompt_tokens"), int):
        return rep["prompt_tokens"] / completed / ttft
    return None


# ------------------------------------------------------------------ the model


def erlang_c(c: int, a: float) -> float:
    """Probability of waiting in M/M/c with offered load a = lambda * E[S] (< c), by Erlang B's
    recursion B(k) = a B(k-1) / (k + a B(k-1)), C = B / (1 - (a/c)(1 - B))."""
    if a <= 0:
        return 0.0
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho * (1 - b))


def prefill_wait(c: int, rate: float, mean_s: float, cs2: float, q: float) -> dict:
    """Queueing before prefill with c workers: M/G/c by the Allen-Cunneen approximation. The
    waiting time is 0 with probability 1 - C and otherwise exponential with mean
    ((1 + cs2) / 2) / (c / E[S] - rate) (exact for M/M/c, cs2 = 1); its q-quantile is
    m * ln(C / (1 - q)) when C > 1 - q, else 0."""
    a = rate * mean_s
    if a >= c:
        return {"rho": a / c, "p_wait": 1.0, "mean_wait": math.inf, "wait_q": math.inf}
    pc = erlang_c(c, a)
    m = (1 + cs2) / 2 / (c / mean_s - rate)
    wq = m * math.log(pc / (1 - q)) if pc > 1 - q else 0.0
    return {"rho": a / c, "p_wait": pc, "mean_wait": pc * m, "wait_q": wq}


def prefill_plan(rate: float, L: Lengths, prefill_tps: float, utilization: float, slo_ttft: float | None,
                 q: float, max_workers: int = 100_000) -> dict:
    mean_x = L.mean_x
    tokens_s = rate * mean_x
    p_thr = max(1, math.ceil(tokens_s / (prefill_tps * utilization) - 1e-9))
    mean_s, cs2 = mean_x / prefill_tps, _cv2(L.x)
    x_q = float(np.percentile(L.x, 100 * q))
    s_q = x_q / prefill_tps
    out = {"tokens_per_s": tokens_s, "throughput_workers": p_thr, "mean_service_s": mean_s, "service_cv2": cs2,
           "prompt_q": x_q, "prefill_q_s": s_q, "quantile": q}
    p = p_thr
    while rate * mean_s >= p:  # utilization 1 (or more) may leave no queue headroom
        p += 1
    w = prefill_wait(p, rate, mean_s, cs2, q)
    out["at_throughput_workers"] = {"workers": p, **w, "ttft_q": w["wait_q"] + s_q}
    if slo_ttft is None:
        out.update(workers=p, limited_by="throughput", feasible=True)
        return out
    if s_q > slo_ttft:
        out.update(workers=None, feasible=False, limited_by="slo_ttft",
                   note=f"the p{100 * q:g} prompt ({x_q:,.0f} tokens) alone takes {s_q:.3g} s to prefill "
                        f"> the TTFT SLO {slo_ttft:g} s: no number of workers meets it")
        return out
    while p <= max_workers:
        w = prefill_wait(p, rate, mean_s, cs2, q)
        if w["wait_q"] + s_q <= slo_ttft:
            break
        p += 1
    out.update(workers=p, feasible=True, limited_by="slo_ttft" if p > p_thr else "throughput",
               at_workers={"workers": p, **w, "ttft_q": w["wait_q"] + s_q})
    return out


def decode_plan(rate: float, L: Lengths, point: DecodePoint, utilization: float,
                kv_tokens_per_worker: float | None, block_size: int) -> dict:
    tokens_s = rate * L.mean_y
    d_thr = max(1, math.ceil(tokens_s / (point.tps * utilization) - 1e-9))
    out = {"tokens_per_s": tokens_s, "tps_per_worker": point.tps, "tpot": point.tpot, "batch": point.batch,
           "throughput_workers": d_thr, "workers": d_thr, "limited_by": "throughput"}
    if point.tpot is not None:
        # Little's law: sequences decoding = rate * E[decode time] = rate * E[out] * TPOT
        seqs = rate * L.mean_y * point.tpot
        out["sequences_in_flight"] = seqs
        # a sequence at its k-th output token holds in + k tokens (+ (block - 1) / 2 of its last block):
        # integrated over its decode, TPOT * (in*out + out(out+1)/2 + out(block-1)/2)
        per_req = L.e_xy() + float(np.mean(L.y * (L.y + 1))) / 2 + L.mean_y * (block_size - 1) / 2
        kv = rate * point.tpot * per_req
        out["kv_tokens_in_use"] = kv
        if kv_tokens_per_worker:
            d_kv = max(1, math.ceil(kv / kv_tokens_per_worker - 1e-9))
            out["kv_workers"] = d_kv
            if d_kv > d_thr:
                out.update(workers=d_kv, limited_by="kv")
        out["sequences_per_worker"] = seqs / out["workers"]
    return out


def plan(rate: float, L: Lengths, prefill_tps: float, point: DecodePoint, *, utilization: float = 0.8,
         decode_utilization: float = 1.0, slo_ttft: float | None = None, ttft_quantile: float = 0.99,
         kv_tokens_per_worker: float | None = None, block_size: int = 16) -> dict:
    pre = prefill_plan(rate, L, prefill_tps, utilization, slo_ttft, ttft_quantile)
    dec = decode_plan(rate, L, point, decode_utilization, kv_tokens_per_worker, block_size)
    ratio = pre["workers"] / dec["workers"] if pre["workers"] else None
    return {"prefill": pre, "decode": dec, "P": pre["workers"], "D": dec["workers"], "P_to_D": ratio}


def sensitivity(rate: float, L: Lengths, prefill_tps: float, point: DecodePoint, ratios, sweep: str, **kw) -> list:
    """P and D as E[in]/E[out] moves: `total` keeps E[in] + E[out], `input` keeps E[out] (the
    input scales), `output` keeps E[in]. The shapes of the distributions are kept (scaled)."""
    mx, my = L.mean_x, L.mean_y
    rows = []
    for r in sorted(set(ratios) | {mx / my}):
        if sweep == "total":
            tx, ty = (mx + my) * r / (1 + r), (mx + my) / (1 + r)
        elif sweep == "input":
            tx, ty = r * my, my
        else:
            tx, ty = mx, mx / r
        p = plan(rate, L.scaled(tx / mx, ty / my), prefill_tps, point, **kw)
        rows.append({"ratio": r, "mean_input": tx, "mean_output": ty, "P": p["P"], "D": p["D"], "P_to_D": p["P_to_D"],
                     "P_limited_by": p["prefill"]["limited_by"], "D_limited_by": p["decode"]["limited_by"],
                     "current": math.isclose(r, mx / my)})
    return rows


# ------------------------------------------------------------------ the command


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:,.0f}"


def render(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    inp = result["inputs"]
    L = inp["lengths"]
    console.print(f"[bold]rate {inp['rate']:g} req/s[/]; lengths from {L['source']}: input mean "
                  f"{L['input']['mean']:.4g} (p99 {L['input']['p99']:.4g}), output mean {L['output']['mean']:.4g} "
                  f"(p99 {L['output']['p99']:.4g}); prefill {inp['prefill_tps']:.4g} tok/s per worker "
                  f"({inp['prefill_source']}); decode point: {inp['decode_point']['source']}")
    pre, dec = result["prefill"], result["decode"]
    t = Table(title="workers needed")
    for col in ("", "workers", "limited by", "details"):
        t.add_column(col, justify="right" if col == "workers" else "left")
    det = [f"{pre['tokens_per_s']:,.0f} prompt tok/s; {pre['throughput_workers']} at "
           f"{inp['utilization']:g} utilization"]
    a = pre.get("at_workers") or pre.get("at_throughput_workers")
    if a:
        det.append(f"with {a['workers']}: utilization {a['rho']:.3g}, P(wait) {a['p_wait']:.3g}, "
                   f"p{100 * pre['quantile']:g} wait {_fmt(a['wait_q'])} s + prefill {_fmt(pre['prefill_q_s'])} s "
                   f"= TTFT {_fmt(a['ttft_q'])} s")
    if pre.get("note"):
        det.append(pre["note"])
    t.add_row("prefill (P)", _fmt(pre["workers"]) if pre["workers"] else "infeasible", pre["limited_by"],
              "\n".join(det))
    det = [f"{dec['tokens_per_s']:,.0f} output tok/s at {_fmt(dec['tps_per_worker'])} per worker "
           f"(TPOT {_fmt(dec['tpot'])} s): {dec['throughput_workers']}"]
    if "kv_tokens_in_use" in dec:
        det.append(f"{_fmt(dec['sequences_in_flight'])} sequences decoding, {dec['kv_tokens_in_use']:,.0f} KV tokens"
                   + (f": {dec['kv_workers']} worker(s) by KV" if "kv_workers" in dec else ""))
    t.add_row("decode (D)", _fmt(dec["workers"]), dec["limited_by"], "\n".join(det))
    t.caption = f"P:D = {_fmt(result['P_to_D'], 3)}"
    console.print(t)

    t = Table(title=f"sensitivity to the input/output ratio ({result['sweep']})")
    for col in (r"E\[in]/E\[out]", r"E\[in]", r"E\[out]", "P", "P by", "D", "D by", "P:D"):
        t.add_column(col, justify="left" if col.endswith(" by") else "right")
    for r in result["sensitivity"]:
        style = "bold" if r["current"] else None
        t.add_row(_fmt(r["ratio"], 3), f"{r['mean_input']:,.0f}", f"{r['mean_output']:,.0f}",
                  _fmt(r["P"]) if r["P"] else "infeasible", r["P_limited_by"], _fmt(r["D"]), r["D_limited_by"],
                  _fmt(r["P_to_D"], 3), style=style)
    t.caption = "bold: the workload's own ratio"
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="meshserve plan", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("capacity per worker")
    g.add_argument("--prefill-tps", type=float, help="prompt tokens/s one prefill worker processes at full load")
    g.add_argument("--decode-tps", type=float, help="output tokens/s one decode worker produces (at --decode-tpot)")
    g.add_argument("--decode-tpot", type=float, help="the TPOT (s) at which --decode-tps was measured")
    g.add_argument("--decode-curve", help="B:TPOT,... measured per-token latency of one decode worker per batch size")
    g.add_argument("--from-bench", action="append", default=[], metavar="JSON",
                   help="`meshserve bench --json` output (repeatable: each run is a decode operating point)")
    g.add_argument("--decode-workers-in-bench", type=int, default=1,
                   help="decode workers the bench runs had (output tokens/s is divided by it)")
    g.add_argument("--bench-tpot-stat", choices=BENCH_TPOT_STATS, default="p99",
                   help="which TPOT of a bench run must meet --slo-tpot (default: %(default)s)")
    g = ap.add_argument_group("workload")
    g.add_argument("--rate", type=float, help="requests/s to plan for (default: the workload's rate, if it has one)")
    g.add_argument("--input-len", help="prompt length: N, uniform:LOW:HIGH, normal:MEAN:STD, lognormal:MEDIAN:SIGMA, "
                                       "exp:MEAN or a {dist: ...} mapping")
    g.add_argument("--output-len", help="output length, same forms")
    g.add_argument("--workload", help="lengths (and rate, SLOs) from a workload file or shipped name")
    g.add_argument("--max-model-len", type=int, default=8192, help="context for --workload (default: %(default)s)")
    g.add_argument("--from-log", action="append", default=[], metavar="LOG", help="lengths from a gateway request log")
    g = ap.add_argument_group("targets")
    g.add_argument("--slo-ttft", type=float, help="TTFT SLO, s, at --ttft-quantile")
    g.add_argument("--ttft-quantile", type=float, default=0.99, help="(default: %(default)s)")
    g.add_argument("--slo-tpot", type=float, help="time per output token SLO, s")
    g.add_argument("--utilization", type=float, default=0.8, help="target prefill utilization (default: %(default)s)")
    g.add_argument("--decode-utilization", type=float, default=1.0,
                   help="fraction of the SLO operating point to plan decode for (default: %(default)s)")
    g.add_argument("--kv-blocks-per-worker", type=int, help="KV blocks a decode worker can hold (KV capacity check)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    g = ap.add_argument_group("output")
    g.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS),
                   help="E[in]/E[out] ratios for the sensitivity table (default: %(default)s)")
    g.add_argument("--sweep", choices=("total", "input", "output"), default="total",
                   help="what the ratio moves: total keeps E[in]+E[out]; input keeps E[out]; output keeps E[in]")
    g.add_argument("--json", metavar="OUT", help="write the plan as JSON here ('-': stdout, no tables)")
    a = ap.parse_args(argv)

    try:
        hints: dict = {}
        sources = sum(bool(x) for x in (a.workload, a.from_log, a.input_len or a.output_len))
        if sources != 1:
            ap.error("lengths from exactly one of: --input-len and --output-len, --workload, --from-log")
        if a.workload:
            L, hints = lengths_from_workload(a.workload, a.max_model_len)
        elif a.from_log:
            L = lengths_from_log(a.from_log)
        else:
            if not (a.input_len and a.output_len):
                ap.error("give both --input-len and --output-len")
            L = lengths_from_cli(a.input_len, a.output_len)
        if L.mean_x <= 0 or L.mean_y <= 0:
            ap.error("mean input and output lengths must be positive")
        rate = a.rate if a.rate is not None else hints.get("rate")
        if not rate or rate <= 0:
            ap.error("--rate is needed (the workload gives no single arrival rate)")
        slo_ttft = a.slo_ttft if a.slo_ttft is not None else hints.get("slo_ttft")
        slo_tpot = a.slo_tpot if a.slo_tpot is not None else hints.get("slo_tpot")
        if not 0 < a.ttft_quantile < 1 or not 0 < a.utilization <= 1 or not 0 < a.decode_utilization <= 1:
            ap.error("--ttft-quantile in (0, 1), utilizations in (0, 1]")

        bench_used, prefill_est, points = [], None, []
        if a.from_bench:
            points, prefill_est, bench_used = from_bench(a.from_bench, a.decode_workers_in_bench, a.bench_tpot_stat)
        if a.prefill_tps:
            prefill_tps, prefill_source = a.prefill_tps, "--prefill-tps"
        elif prefill_est:
            prefill_tps = prefill_est
            prefill_source = "bench: median prompt tokens / TTFT per request (a lower bound: TTFT includes queueing)"
        else:
            ap.error("--prefill-tps is needed (or --from-bench with per-request records or TTFTs)")
        if a.decode_curve:
            point, note = point_from_curve(parse_curve(a.decode_curve), slo_tpot)
        else:
            if a.decode_tps:
                points.append(DecodePoint(tps=a.decode_tps, tpot=a.decode_tpot, source="--decode-tps"
                                          + (f" at TPOT {a.decode_tpot:g} s" if a.decode_tpot else "")))
            if not points:
                ap.error("decode capacity: --decode-tps, --decode-curve or --from-bench")
            point, note = pick_point(points, slo_tpot)
        if point is None:
            print(f"meshserve plan: {note}", file=sys.stderr)
            return 1
    except (ValueError, OSError, KeyError) as e:
        print(f"meshserve plan: error: {e}", file=sys.stderr)
        return 2

    kv = a.kv_blocks_per_worker * a.block_size if a.kv_blocks_per_worker else None
    kw = dict(utilization=a.utilization, decode_utilization=a.decode_utilization, slo_ttft=slo_ttft,
              ttft_quantile=a.ttft_quantile, kv_tokens_per_worker=kv, block_size=a.block_size)
    result = plan(rate, L, prefill_tps, point, **kw)
    ratios = [float(r) for r in a.ratios.split(",") if r.strip()]
    result = {
        "inputs": {"rate": rate, "lengths": L.describe(), "prefill_tps": prefill_tps, "prefill_source": prefill_source,
                   "decode_point": {"tps": point.tps, "tpot": point.tpot, "batch": point.batch,
                                    "source": f"{point.source} ({note})" if note not in point.source else point.source},
                   "slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "ttft_quantile": a.ttft_quantile,
                   "utilization": a.utilization, "decode_utilization": a.decode_utilization,
                   "kv_tokens_per_worker": kv, "block_size": a.block_size, "bench": bench_used},
        **result, "sweep": a.sweep, "sensitivity": sensitivity(rate, L, prefill_tps, point, ratios, a.sweep, **kw)}
    if a.json != "-":
        render(result)
    if a.json:
        text = json.dumps(result, indent=2, default=float)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text + "\n")
    return 0 if result["P"] else 1


if __name__ == "__main__":
    sys.exit(main())
