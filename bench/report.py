"""Benchmark metrics from per-request timings: latency percentiles, throughput, goodput, failures,
per class; a table for people (rich) and PNG plots (matplotlib, Agg).

Definitions (as vLLM's and SGLang's serving benchmarks use them), times in seconds from when the
request was sent:
- TTFT: until the first chunk with content;
- ITL: the gaps between consecutive content chunks (one per chunk; a chunk may carry several tokens);
- TPOT: (e2e - TTFT) / (output tokens - 1), per request (output tokens from `usage` when the server
  sends it, else the number of content chunks); requests with one output token have none;
- e2e: until the end of the stream.
Throughputs divide by the run's duration (first send to last end), per class too, so the classes'
throughputs add up to the total. Goodput counts the requests that met every SLO of their class
(the workload's per-class `slo`, else the command's --slo-* values).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds from the start of the run."""

    index: int
    cls: str = "default"
    model: str | None = None
    priority: str | None = None
    prompt_tokens: int = 0
    requested_output_tokens: int = 0
    arrival: float = 0.0  # when the schedule said to send it
    start: float | None = None  # when it was sent (later than arrival when the concurrency cap held it)
    chunk_times: list[float] = field(default_factory=list)  # each content chunk
    end: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    slo: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.ok else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])] if self.ok else []

    def meets(self, slo: dict[str, float | None]) -> bool:
        if not self.ok:
            return False
        for key, limit in ({k: v for k, v in slo.items() if v is not None} | self.slo).items():
            value = getattr(self, key)
            if value is not None and value > limit:
                return False
        return True

    def record(self) -> dict:
        """The per-request line of the JSON file."""
        return {"index": self.index, "class": self.cls, "model": self.model, "priority": self.priority,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "requested_output_tokens": self.requested_output_tokens, "cached_tokens": self.cached_tokens,
                "arrival": self.arrival, "start": self.start, "end": self.end, "ttft": self.ttft,
                "tpot": self.tpot, "e2e": self.e2e, "chunks": len(self.chunk_times), "error": self.error}


def median_seconds(f, reps: int, warmup: int = 3) -> float:
    """The median wall time of `reps` calls of f, after `warmup` untimed ones (microbenchmarks)."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def emit_json(res: dict, path: str | None) -> None:
    """A benchmark's result: printed, and written to `path` when given."""
    text = json.dumps(res, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def stats(xs: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (numpy's linear interpolation); None when there is nothing to measure."""
    if not xs:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    a = np.asarray(xs, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def _duration(results: list[RequestResult]) -> float:
    starts = [r.start for r in results if r.start is not None]
    ends = [r.end if r.end is not None else r.start for r in results if r.start is not None]
    return max(ends) - min(starts) if starts else 0.0


def summarize(results: list[RequestResult], slo: dict[str, float | None] | None = None,
              duration: float | None = None, by_class: bool = True) -> dict:
    """The numbers of a run: overall, and per class under "classes" (and per model when several)."""
    slo = slo or {}
    duration = _duration(results) if duration is None else duration
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    reasons: dict[str, int] = {}
    for r in failed:
        reason = r.error or "no output"
        reasons[reason] = reasons.get(reason, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(1 for r in ok if r.meets(slo))
    per = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    res: dict[str, Any] = {
        "requests": len(results), "completed": len(ok), "failed": len(failed),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "short_outputs": sum(1 for r in ok if r.requested_output_tokens and r.output_tokens < r.requested_output_tokens),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "request_throughput": per(len(ok)), "output_throughput": per(out_tokens),
        "total_token_throughput": per(out_tokens + prompt_tokens),
        "goodput": per(good), "good_requests": good,
        "goodput_fraction": good / len(results) if results else None,
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": stats([x for r in ok for x in r.itls]),
        "e2e": stats([r.e2e for r in ok]),
        "failures": {"count": len(failed), "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))},
    }
    if by_class:
        res["classes"] = {c: summarize([r for r in results if r.cls == c], slo, duration, by_class=False)
                          for c in dict.fromkeys(r.cls for r in results)}
        models = list(dict.fromkeys(r.model for r in results))
        if len(models) > 1:
            res["models"] = {str(m): summarize([r for r in results if r.model == m], slo, duration, by_class=False)
                             for m in models}
    return res


# --- for people

def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if unit == "ms":
        return f"{1000 * x:.1f}"
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"


def table(summary: dict, title: str = "meshserve bench"):
    """A rich Table: one column for the whole run and one per class."""
    from rich.table import Table

    cols = [("all", summary)]
    classes = summary.get("classes") or {}
    if len(classes) > 1:
        cols += list(classes.items())
    t = Table(title=title)
    t.add_column("metric")
    for name, _ in cols:
        t.add_column(name, justify="right")

    def row(label, fn):
        t.add_row(label, *[fn(s) for _, s in cols])

    row("requests ok / failed", lambda s: f"{s['completed']} / {s['failed']}")
    row("duration, s", lambda s: _fmt(s["duration_s"]))
    row("requests/s", lambda s: _fmt(s["request_throughput"]))
    row("output tokens/s", lambda s: _fmt(s["output_throughput"]))
    row("total tokens/s", lambda s: _fmt(s["total_token_throughput"]))
    row("goodput, requests/s", lambda s: f"{_fmt(s['goodput'])} ({s['good_requests']}/{s['requests']})")
    for m, unit in (("ttft", "ms"), ("tpot", "ms"), ("itl", "ms"), ("e2e", "s")):
        for k in ("mean", "p50", "p90", "p99"):
            row(f"{m.upper()} {k}, {unit}", lambda s, m=m, k=k, unit=unit: _fmt(s[m][k], unit))
    for reason, n in summary["failures"]["reasons"].items():
        t.add_row(f"[red]failed: {reason[:70]}[/red]", str(n), *[""] * (len(cols) - 1))
    return t


def print_table(t) -> None:
    """To stderr (stdout carries the JSON), wide enough for every column even when not a terminal."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=max(console.width, 30 + 14 * len(t.columns)))
    console.print(t)


# --- plots

def timeline(results: list[RequestResult], bins: int = 60) -> dict[str, np.ndarray]:
    """Counts over time: in flight (sent, not done), waiting for the first token, held by the client
    (arrived, not sent: the concurrency cap), and output tokens/s (a chunk's tokens spread evenly)."""
    ends = [r.end for r in results if r.end is not None] + [r.start for r in results if r.start is not None]
    t_end = max(ends + [r.arrival for r in results] + [1e-3])
    t = np.linspace(0.0, t_end, 400)

    def active(pairs):
        return np.array([sum(1 for a, b in pairs if a <= x < b) for x in t])

    sent = [(r.start, r.end if r.end is not None else r.start) for r in results if r.start is not None]
    waiting = [(r.start, r.chunk_times[0] if r.chunk_times else (r.end or r.start))
               for r in results if r.start is not None]
    held = [(r.arrival, r.start if r.start is not None else t_end) for r in results]
    edges = np.linspace(0.0, t_end, bins + 1)
    tokens = np.zeros(bins)
    for r in results:
        if r.ok and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            idx = np.clip(np.searchsorted(edges, r.chunk_times, side="right") - 1, 0, bins - 1)
            np.add.at(tokens, idx, per_chunk)
    width = edges[1] - edges[0]
    return {"t": t, "in_flight": active(sent), "waiting_first_token": active(waiting), "held": active(held),
            "bin_mid": (edges[:-1] + edges[1:]) / 2, "output_tok_s": tokens / width}


def plots(results: list[RequestResult], out_dir: str | Path, title: str = "") -> list[str]:
    """latency_cdf.png (TTFT, TPOT, ITL, e2e per class), throughput.png, concurrency.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    classes = list(dict.fromkeys(r.cls for r in results))
    groups = [("all", results)] + ([(c, [r for r in results if r.cls == c]) for c in classes] if len(classes) > 1 else [])
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, m in zip(axes.flat, METRICS):
        for name, rs in groups:
            ok = [r for r in rs if r.ok]
            xs = [x for r in ok for x in r.itls] if m == "itl" else [getattr(r, m) for r in ok]
            xs = np.sort([x for x in xs if x is not None])
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{name} (n={len(xs)})")
        ax.set_xlabel(f"{m.upper()}, s")
        ax.set_ylabel("fraction of " + ("gaps" if m == "itl" else "requests"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title} latency CDFs".strip())
    fig.tight_layout()
    paths.append(str(out / "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    tl = timeline(results)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(tl["bin_mid"], tl["output_tok_s"], label="output tokens/s")
    done = np.sort([r.end for r in results if r.ok])
    if len(done):
        ax2 = ax.twinx()
        ax2.plot(done, np.arange(1, len(done) + 1), color="tab:orange", label="completed requests")
        ax2.set_ylabel("completed requests")
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("time, s")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{title} throughput over time".strip())
    fig.tight_layout()
    paths.append(str(out / "throughput.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(tl["t"], tl["in_flight"], label="in flight (sent, not finished)")
    ax.plot(tl["t"], tl["waiting_first_token"], label="waiting for the first token (queued or prefilling)")
    if tl["held"].any():
        ax.plot(tl["t"], tl["held"], label="held by the client (max concurrency)")
    ax.set_xlabel("time, s")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{title} queue and in-flight requests".strip())
    fig.tight_layout()
    paths.append(str(out / "concurrency.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
