"""`meshserve analyze`: what a gateway request log says about the workload, before any tuning.

    meshserve analyze ~/.cache/meshserve/logs/requests.jsonl [--plots DIR] [--json OUT] [--bucket SECONDS]

Reads the JSONL the gateway writes (services/gateway/request_log.py; a file also brings its
rotations `LOG.1`, `LOG.2`, ... unless --no-rotated; a directory brings every `*.jsonl*` in it; a
quoted glob is expanded; `.gz` files are read too) and reports:

- prompt and output lengths (tokens): mean, p50/p95/p99, max; over requests that finished (a
  `finish_reason`), since a failed or cancelled request's output is cut short;
- TTFT, end-to-end latency and time per output token of those requests;
- the request rate over time in buckets of --bucket seconds (all arrivals, failed ones too: that is
  the offered load), its mean ((n - 1) / (last arrival - first)), its peaks and troughs (the last
  bucket, which ends at the last arrival, is not counted as a trough; the peaks, like the troughs,
  are at least 1/20 of the log apart);
- tokens in flight: a request holds prompt + output tokens of KV from its arrival to arrival + e2e
  (an upper bound: the output grows during that time); the peak of their sum over time, found by a
  sweep over arrival and end events, and the peak number of requests in flight;
- the mix of classes (priorities), tenants, models, endpoints, finish reasons and errors;
- traffic by tenant (the `tenant` of each line, from the tenants file's API keys; "(none)" without
  one): requests, finished, refused or failed by status, tokens, TTFT and e2e percentiles.

Percentiles are numpy's (`np.percentile`, linear interpolation). --plots DIR writes lengths.png
(histograms and CDFs), rate.png, inflight.png and mix.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import gzip
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

from meshserve.cli.errors import ArgumentParser

QUANTILES = (50, 95, 99)
NICE_BUCKETS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
MAX_BUCKETS = 240


# ------------------------------------------------------------------ reading


def _rotated(path: Path) -> list[Path]:
    """`path`'s rotations (`path.1`, `path.2`, ...), oldest first."""
    pat = re.compile(re.escape(path.name) + r"\.(\d+)(\.gz)?$")
    found = [(int(m.group(1)), p) for p in path.parent.iterdir() if (m := pat.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def find_files(args: list[str], rotated: bool = True) -> list[Path]:
    out: list[Path] = []
    for a in args:
        p = Path(a).expanduser()
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.is_file() and ".jsonl" in f.name)
        elif p.is_file():
            out += (_rotated(p) if rotated else []) + [p]
        elif glob.has_magic(a):
            out += sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
        else:
            raise FileNotFoundError(f"no such file or directory: {a}")
    seen, unique = set(), []
    for f in out:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def load(files: list[Path]) -> tuple[list[dict], int]:
    """The records (sorted by arrival) and the number of lines that were not records."""
    records, bad = [], 0
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    r = orjson.loads(line)
                except orjson.JSONDecodeError:
                    bad += 1  # e.g. a line cut short by a crash
                    continue
                if not isinstance(r, dict) or not isinstance(r.get("arrival"), (int, float)):
                    bad += 1
                    continue
                records.append(r)
    records.sort(key=lambda r: r["arrival"])
    return records, bad


# ------------------------------------------------------------------ statistics


def _num(r: dict, key: str) -> float | None:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def describe(values) -> dict:
    """n, mean, min, max and the QUANTILES percentiles (numpy's linear interpolation)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"n": 0}
    out = {"n": int(v.size), "mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}
    for q, x in zip(QUANTILES, np.percentile(v, QUANTILES)):
        out[f"p{q}"] = float(x)
    return out


def sweep(starts, ends, weights) -> tuple[np.ndarray, np.ndarray]:
    """Sum of `weights` over the half-open intervals [start, end) that contain t, as a step
    function: (times, levels), the level holding from times[i] until times[i + 1]."""
    starts, ends = np.asarray(starts, float), np.asarray(ends, float)
    w = np.asarray(weights, float)
    if starts.size == 0:
        return np.zeros(0), np.zeros(0)
    t = np.concatenate([starts, ends])
    d = np.concatenate([w, -w])
    order = np.argsort(t, kind="stable")
    t, level = t[order], np.cumsum(d[order])
    last = np.r_[np.nonzero(np.diff(t))[0], t.size - 1]  # the level after every event at a time
    return t[last], level[last]


def peak(times: np.ndarray, levels: np.ndarray) -> tuple[float, float | None]:
    if levels.size == 0:
        return 0.0, None
    i = int(np.argmax(levels))
    return float(levels[i]), float(times[i])


def auto_bucket(span: float) -> float:
    for b in NICE_BUCKETS:
        if span / b <= MAX_BUCKETS:
            return float(b)
    return float(NICE_BUCKETS[-1])


def rate_series(arrivals, bucket: float, start: float | None = None) -> tuple[float, np.ndarray]:
    """(start, requests per second in each bucket [start + i*bucket, start + (i+1)*bucket))."""
    a = np.asarray(arrivals, float)
    start = float(a.min()) if start is None else start
    idx = np.floor((a - start) / bucket).astype(int)
    counts = np.bincount(idx, minlength=int(idx.max()) + 1 if idx.size else 0)
    return start, counts / bucket


def _extremes(values: np.ndarray, k: int, sep: int) -> list[int]:
    """Indices of the k smallest values, no two closer than sep (distinct episodes, not one
    episode's neighbouring buckets)."""
    chosen: list[int] = []
    for i in np.argsort(values, kind="stable"):
        if all(abs(int(i) - j) >= sep for j in chosen):
            chosen.append(int(i))
            if len(chosen) == k:
                break
    return chosen


def _mix(values) -> dict:
    c = Counter("(none)" if v is None else str(v) for v in values)
    n = sum(c.values()) or 1
    return {k: {"count": v, "share": v / n} for k, v in c.most_common()}


def _breakdown(records: list[dict], group_of) -> dict:
    """Per group (`group_of(record)`): requests, finished, errors by status, class mix, tokens (prompt:
    every admitted request's; output: every generated token, failed requests' too), TTFT and e2e of
    finished ones; the largest group first."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(group_of(r), []).append(r)
    out = {}
    for name, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        ok = [r for r in rs if r.get("finish_reason") is not None]
        errors = Counter(str((r.get("error") or {}).get("status", "?")) for r in rs if r.get("finish_reason") is None)
        out[name] = {
            "requests": len(rs), "finished": len(ok), "failed": len(rs) - len(ok),
            "errors_by_status": dict(errors.most_common()),
            "class": dict(Counter("(none)" if r.get("class") is None else str(r["class"]) for r in rs).most_common()),
            "prompt_tokens": int(sum(_num(r, "prompt_tokens") or 0 for r in rs)),
            "output_tokens": int(sum(_num(r, "output_tokens") or 0 for r in rs)),
            "ttft_s": describe([_num(r, "ttft") for r in ok if _num(r, "ttft") is not None]),
            "e2e_s": describe([_num(r, "e2e") for r in ok if _num(r, "e2e") is not None])}
    return out


def by_tenant(records: list[dict]) -> dict:
    """_breakdown per tenant ("(none)": requests without an API key of the tenants file)."""
    return _breakdown(records, lambda r: "(none)" if r.get("tenant") is None else str(r["tenant"]))


def by_worker(records: list[dict]) -> dict:
    """_breakdown per worker that finished the request (the last of its `workers`: the decode worker
    after a handoff); "(none)" for requests that got no token, or logs written before `workers`."""
    def last(r: dict) -> str:
        ws = r.get("workers")
        return str(ws[-1]) if isinstance(ws, list) and ws else "(none)"

    out = _breakdown(records, last)
    for name, row in out.items():  # requests that came to it from another worker (a handoff, a lost worker)
        row["handed_over"] = sum(1 for r in records if last(r) == name and len(r.get("workers") or []) > 1)
    return out


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def analyze(records: list[dict], bucket: float | None = None, top: int = 3) -> dict:
    if not records:
        raise ValueError("no requests in the log")
    ok = [r for r in records if r.get("finish_reason") is not None]
    arrivals = np.array([r["arrival"] for r in records], float)
    t0 = float(arrivals.min())
    end = max(float(r["arrival"]) + (_num(r, "e2e") or 0.0) for r in records)
    span = max(end - t0, 1e-9)

    tpot = []
    for r in ok:
        ttft, e2e, n = _num(r, "ttft"), _num(r, "e2e"), _num(r, "output_tokens")
        if ttft is not None and e2e is not None and n is not None and n > 1:
            tpot.append((e2e - ttft) / (n - 1))

    # rate: all arrivals, fixed buckets from the first arrival
    b = bucket or auto_bucket(float(arrivals.max()) - t0)
    _, rps = rate_series(arrivals, b, t0)
    full = rps[:-1] if rps.size > 1 else rps  # the last bucket ends at the last arrival: partial
    sep = max(1, rps.size // 20)
    peaks = [{"t_s": float(i * b), "time": _iso(t0 + i * b), "rps": float(rps[i])}
             for i in _extremes(-rps, top, sep)]
    troughs = [{"t_s": float(i * b), "time": _iso(t0 + i * b), "rps": float(full[i])}
               for i in _extremes(full, top, sep)]
    window = float(arrivals.max()) - t0
    # (n - 1) arrivals over the time between the first and the last (exact for evenly spaced ones)
    mean_rps = (arrivals.size - 1) / window if window > 0 else float(arrivals.size) / b

    # in flight: prompt + output tokens held from arrival to arrival + e2e
    held = [r for r in records if _num(r, "prompt_tokens") is not None and _num(r, "e2e") is not None]
    starts = np.array([r["arrival"] for r in held], float)
    ends = starts + np.array([_num(r, "e2e") for r in held], float)
    tokens = np.array([_num(r, "prompt_tokens") + (_num(r, "output_tokens") or 0.0) for r in held], float)
    tt, tok_level = sweep(starts, ends, tokens)
    rt, req_level = sweep(starts, ends, np.ones_like(starts))
    peak_tokens, peak_tokens_at = peak(tt, tok_level)
    peak_requests, peak_requests_at = peak(rt, req_level)
    token_seconds = float(np.sum(tokens * (ends - starts)))

    errors = Counter(str((r.get("error") or {}).get("status", "?")) for r in records
                     if r.get("finish_reason") is None)
    return {
        "requests": {"total": len(records), "finished": len(ok), "failed": len(records) - len(ok),
                     "errors_by_status": dict(errors.most_common()),
                     "finish_reasons": dict(Counter(r["finish_reason"] for r in ok).most_common())},
        "start": _iso(t0), "end": _iso(end), "span_s": span,
        "prompt_tokens": describe([_num(r, "prompt_tokens") for r in ok if _num(r, "prompt_tokens") is not None]),
        "output_tokens": describe([_num(r, "output_tokens") for r in ok if _num(r, "output_tokens") is not None]),
        "ttft_s": describe([_num(r, "ttft") for r in ok if _num(r, "ttft") is not None]),
        "e2e_s": describe([_num(r, "e2e") for r in ok if _num(r, "e2e") is not None]),
        "tpot_s": describe(tpot),
        "rate": {"bucket_s": b, "buckets": int(rps.size), "mean_rps": mean_rps, "peak_rps": float(rps.max()),
                 "trough_rps": float(full.min()), "peak_to_mean": float(rps.max() / mean_rps) if mean_rps else None,
                 "peaks": peaks, "troughs": troughs},
        "in_flight": {"peak_tokens": peak_tokens,
                      "peak_tokens_t_s": None if peak_tokens_at is None else peak_tokens_at - t0,
                      "peak_tokens_time": None if peak_tokens_at is None else _iso(peak_tokens_at),
                      "mean_tokens": token_seconds / span,
                      "peak_requests": peak_requests,
                      "peak_requests_t_s": None if peak_requests_at is None else peak_requests_at - t0,
                      "mean_requests": float(np.sum(ends - starts)) / span},
        "by_tenant": by_tenant(records),
        "by_worker": by_worker(records),
        "mix": {"class": _mix(r.get("class") for r in records), "tenant": _mix(r.get("tenant") for r in records),
                "model": _mix(r.get("model") for r in records),
                "endpoint": _mix(r.get("endpoint") for r in records),
                "stream": _mix(r.get("stream") for r in records)},
    }


# ------------------------------------------------------------------ output


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"
    return f"{int(x):,}"


def render(s: dict, files: list[Path], bad: int, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    r = s["requests"]
    console.print(f"[bold]{r['total']:,} requests[/] from {s['start']} to {s['end']} ({s['span_s']:.1f} s) "
                  f"in {len(files)} file(s); {r['finished']:,} finished, {r['failed']:,} failed"
                  + (f" {r['errors_by_status']}" if r["failed"] else "") + (f"; {bad} bad lines" if bad else ""))

    t = Table(title="lengths and latencies (finished requests)")
    for col in ("", "n", "mean", "p50", "p95", "p99", "max"):
        t.add_column(col, justify="right" if col else "left")
    for key, label in (("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens"),
                       ("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"), ("e2e_s", "e2e (s)")):
        d = s[key]
        t.add_row(label, _fmt(d["n"]), *(_fmt(d.get(k)) for k in ("mean", "p50", "p95", "p99", "max")))
    console.print(t)

    rt = s["rate"]
    t = Table(title=f"request rate ({rt['bucket_s']:g} s buckets, all arrivals)")
    for col in ("", "req/s", "at (s from start)", "time (UTC)"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("mean", _fmt(rt["mean_rps"]), "", "")
    for name, rows in (("peak", rt["peaks"]), ("trough", rt["troughs"])):
        for row in rows:
            t.add_row(name, _fmt(row["rps"]), _fmt(row["t_s"]), row["time"])
    t.caption = f"peak/mean {_fmt(rt['peak_to_mean'])}"
    console.print(t)

    f = s["in_flight"]
    t = Table(title="in flight (prompt + output tokens held from arrival to end: an upper bound on KV)")
    for col in ("", "peak", "at (s from start)", "mean"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("tokens", _fmt(f["peak_tokens"]), _fmt(f["peak_tokens_t_s"]), _fmt(f["mean_tokens"]))
    t.add_row("requests", _fmt(f["peak_requests"]), _fmt(f["peak_requests_t_s"]), _fmt(f["mean_requests"]))
    console.print(t)

    t = Table(title="mix")
    for col in ("", "value", "requests", "share"):
        t.add_column(col, justify="right" if col in ("requests", "share") else "left")
    for dim, rows in s["mix"].items():
        if dim == "tenant" and list(rows) == ["(none)"]:
            continue  # no tenants file: nothing to break down
        for value, row in rows.items():
            t.add_row(dim, value, f"{row['count']:,}", f"{row['share']:.1%}")
    console.print(t)

    for dim in ("tenant", "worker"):
        rows = s[f"by_{dim}"]
        if list(rows) == ["(none)"]:
            continue  # no tenants file, or a log without workers: nothing to break down
        t = Table(title=f"by {dim}" + (" (the one that finished each request)" if dim == "worker" else ""))
        for col in (dim, "requests", "finished", "failed (by status)", "prompt tok", "output tok",
                    "TTFT p50", "TTFT p99", "e2e p50", "e2e p99"):
            t.add_column(col, justify="left" if col.startswith((dim, "failed")) else "right")
        for name, row in rows.items():
            errs = " ".join(f"{k}:{v}" for k, v in row["errors_by_status"].items())
            t.add_row(name, f"{row['requests']:,}", f"{row['finished']:,}",
                      f"{row['failed']:,}" + (f" ({errs})" if errs else ""), f"{row['prompt_tokens']:,}",
                      f"{row['output_tokens']:,}", *(_fmt(row[k].get(q)) for k in ("ttft_s", "e2e_s")
                                                    for q in ("p50", "p99")))
        console.print(t)


def plot(records: list[dict], s: dict, outdir: Path) -> list[Path]:
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    ok = [r for r in records if r.get("finish_reason") is not None]
    t0 = min(r["arrival"] for r in records)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, (key, label) in enumerate((("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens"))):
        v = np.sort([_num(r, key) for r in ok if _num(r, key) is not None])
        hist, cdf = axes[0][col], axes[1][col]
        if v.size:
            bins = min(60, max(5, int(np.sqrt(v.size))))
            if v[0] > 0 and v[-1] > 20 * np.median(v):  # a long tail: log scale, else it is one bar
                bins = np.geomspace(v[0], v[-1], bins + 1)
                for ax in (hist, cdf):
                    ax.set_xscale("log")
            hist.hist(v, bins=bins, color="tab:blue", alpha=0.8)
            cdf.plot(v, np.arange(1, v.size + 1) / v.size, color="tab:blue")
            for q, ls in zip(QUANTILES, (":", "--", "-.")):
                x = s[key][f"p{q}"]
                for ax in (hist, cdf):
                    ax.axvline(x, color="tab:red", ls=ls, lw=1, label=f"p{q} {x:,.0f}")
        hist.set_title(f"{label} (finished requests)")
        hist.set_ylabel("requests")
        hist.legend(fontsize=8)
        cdf.set_xlabel(label)
        cdf.set_ylabel("fraction ≤ x")
        cdf.grid(alpha=0.3)
    fig.tight_layout()
    written.append(outdir / "lengths.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    b = s["rate"]["bucket_s"]
    _, rps = rate_series([r["arrival"] for r in records], b, t0)
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.step(np.arange(rps.size + 1) * b, np.r_[rps, rps[-1:]], where="post", color="tab:blue")
    ax.axhline(s["rate"]["mean_rps"], color="gray", ls="--", lw=1, label=f"mean {s['rate']['mean_rps']:.3g}")
    for p in s["rate"]["peaks"]:
        ax.plot(p["t_s"], p["rps"], "v", color="tab:red")
    ax.set_xlabel("seconds from the first arrival")
    ax.set_ylabel(f"requests/s ({b:g} s buckets)")
    ax.set_title("request rate")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(outdir / "rate.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    held = [r for r in records if _num(r, "prompt_tokens") is not None and _num(r, "e2e") is not None]
    starts = np.array([r["arrival"] for r in held], float)
    ends = starts + np.array([_num(r, "e2e") for r in held], float)
    tokens = np.array([_num(r, "prompt_tokens") + (_num(r, "output_tokens") or 0.0) for r in held])
    fig, ax = plt.subplots(figsize=(11, 4))
    for w, color, label, axis in ((tokens, "tab:blue", "tokens in flight", ax),
                                  (np.ones_like(starts), "tab:orange", "requests in flight", ax.twinx())):
        t, level = sweep(starts, ends, w)
        t, level = _downsample(t, level)
        if t.size:
            axis.step(t - t0, level, where="post", color=color, lw=1)
        axis.set_ylabel(label, color=color)
    f = s["in_flight"]
    if f["peak_tokens_t_s"] is not None:
        ax.plot(f["peak_tokens_t_s"], f["peak_tokens"], "v", color="tab:red")
        ax.annotate(f"peak {f['peak_tokens']:,.0f}", (f["peak_tokens_t_s"], f["peak_tokens"]), fontsize=8)
    ax.set_xlabel("seconds from the first arrival")
    ax.set_title("in flight (prompt + output tokens per request, arrival to end)")
    fig.tight_layout()
    written.append(outdir / "inflight.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    dims = [d for d in ("class", "tenant", "model", "endpoint")
            if s["mix"][d] and not (d == "tenant" and list(s["mix"][d]) == ["(none)"])]
    fig, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 3.5), squeeze=False)
    for ax, d in zip(axes[0], dims):
        rows = s["mix"][d]
        ax.bar(list(rows), [r["count"] for r in rows.values()], color="tab:blue")
        ax.set_title(d)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    written.append(outdir / "mix.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _downsample(t: np.ndarray, level: np.ndarray, max_points: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    """At most about max_points steps: the maximum level within each of max_points/2 time bins."""
    if t.size <= max_points:
        return t, level
    edges = np.linspace(t[0], t[-1], max_points // 2 + 1)
    idx = np.unique(np.searchsorted(t, edges[:-1]))
    return t[idx], np.maximum.reduceat(level, idx)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="meshserve analyze", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", metavar="LOG", help="request log file(s), directories or globs")
    p.add_argument("--json", metavar="OUT", help="write the summary as JSON here ('-': stdout, no tables)")
    p.add_argument("--plots", metavar="DIR", help="write lengths.png, rate.png, inflight.png, mix.png here")
    p.add_argument("--bucket", type=float, default=None, metavar="SECONDS",
                   help=f"request-rate bucket (default: the smallest of 1, 2, 5, 10, 15, 30, 60 s, ... "
                        f"giving at most {MAX_BUCKETS} buckets)")
    p.add_argument("--no-rotated", action="store_true", help="a file argument does not bring its rotations")
    args = p.parse_args(argv)
    if args.bucket is not None and args.bucket <= 0:
        p.error("--bucket must be positive")
    try:
        files = find_files(args.logs, rotated=not args.no_rotated)
    except FileNotFoundError as e:
        print(f"meshserve analyze: error: {e}", file=sys.stderr)
        return 2
    records, bad = load(files)
    if not records:
        print(f"meshserve analyze: no requests in {', '.join(map(str, files)) or 'the given paths'}", file=sys.stderr)
        return 1
    summary = analyze(records, args.bucket)
    summary = {"files": [str(f) for f in files], "bad_lines": bad, **summary}
    if args.json != "-":
        render(summary, files, bad)
    if args.plots:
        summary["plots"] = [str(x) for x in plot(records, summary, Path(args.plots))]
        if args.json != "-":
            print("plots: " + ", ".join(summary["plots"]))
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
