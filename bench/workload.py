"""Benchmark workloads: a spec in a YAML or JSON file, turned into requests deterministically.

A workload file describes the requests, not the server:

    name: shared-prefix
    num_requests: 64
    context_length: 8192          # optional: lengths below were written for this context; they are
                                  # scaled by max_model_len / context_length when requests are made
    prompt_len: {dist: uniform, low: 32, high: 256}   # tokens after the shared prefix (if any)
    output_len: {dist: fixed, value: 128}
    prefix_groups:                # requests that start with the same tokens (system prompts, RAG)
      - {name: system, length: 1024, share: 0.8, count: 1}
    classes:                      # request classes: share, priority, own lengths/arrivals/SLOs
      - {name: chat, share: 1.0, priority: normal}
    models: {names: [a, b, c], zipf: 1.0}   # share of the k-th model proportional to 1/k^zipf
    arrival: {pattern: poisson, rate: 4.0, max_concurrency: 32}
    sampling: {temperature: 0}    # extra body fields (defaults: temperature 0, ignore_eos true)

Length distributions (`dist`): `fixed` (value), `uniform` (low, high, both inclusive), `normal`
(mean, std), `lognormal` (mu and sigma of log(x), or median instead of mu), `trace` (file: a JSONL
file, relative to the workload file, and field: the key to read; every `trace` distribution on
the same file reads the same row of a request, so prompt and output lengths stay paired). Each
takes optional `min` (default 1) and `max` bounds. A bare integer means `fixed`.

Arrival patterns: `all_at_once`, `poisson` (rate requests/s), `constant` (rate), `bursts`
(burst_size requests at once every burst_interval s); `start` delays the first arrival and
`max_concurrency` (top level only) caps the requests in flight. A class with its own `arrival`
gets its own arrival process (e.g. interactive requests arriving during a background batch);
`while_running: <class>` sends a class's requests only while that other class still has requests
unfinished (the rest are skipped, not counted as failures).

Shares (classes, prefix groups, models) become exact counts (largest remainder), assigned to
requests in a seeded random order. The same spec, seed, vocabulary and max_model_len always give
the same requests; the draws for lengths and prompt tokens use the seed's first stream in the same
order as engine_bench.mixed_workload, so `mixed-64` is exactly that workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from meshserve.shared.limits import Priority

WORKLOADS_DIR = Path(__file__).parent / "workloads"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- length distributions

class _Dist(_Spec):
    min: int = Field(default=1, ge=0)
    max: int | None = None

    def _draw(self, rng: np.random.Generator, n: int, rows: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, n: int, rows: np.ndarray | None = None) -> np.ndarray:
        """n integer lengths, rounded and clipped to [min, max]."""
        x = np.rint(np.asarray(self._draw(rng, n, rows), dtype=np.float64))
        return np.clip(x, self.min, self.max if self.max is not None else np.inf).astype(np.int64)


class Fixed(_Dist):
    dist: Literal["fixed"]
    value: int = Field(ge=0)

    def _draw(self, rng, n, rows):
        return np.full(n, self.value)


class Uniform(_Dist):
    dist: Literal["uniform"]
    low: int = Field(ge=0)
    high: int

    @model_validator(mode="after")
    def _order(self):
        if self.high < self.low:
            raise ValueError("uniform: high must be >= low")
        return self

    def _draw(self, rng, n, rows):
        return rng.integers(self.low, self.high + 1, n)


class Normal(_Dist):
    dist: Literal["normal"]
    mean: float
    std: float = Field(ge=0)

    def _draw(self, rng, n, rows):
        return rng.normal(self.mean, self.std, n)


class LogNormal(_Dist):
    dist: Literal["lognormal"]
    mu: float | None = None  # mean of log(x)
    median: float | None = Field(default=None, gt=0)  # exp(mu), an alternative to mu
    sigma: float = Field(ge=0)  # std of log(x)

    @model_validator(mode="after")
    def _one_location(self):
        if (self.mu is None) == (self.median is None):
            raise ValueError("lognormal: give exactly one of mu and median")
        return self

    @property
    def log_mean(self) -> float:
        return self.mu if self.mu is not None else math.log(self.median)

    def _draw(self, rng, n, rows):
        return rng.lognormal(self.log_mean, self.sigma, n)


class Trace(_Dist):
    dist: Literal["trace"]
    file: str
    field: str

    def _draw(self, rng, n, rows):
        raise AssertionError("trace lengths are read by Workload.generate")


Distribution = Annotated[Union[Fixed, Uniform, Normal, LogNormal, Trace], Field(discriminator="dist")]


def _dist_shorthand(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):
        return {"dist": "fixed", "value": v}
    return v


# --- the rest of the spec

class Arrival(_Spec):
    pattern: Literal["all_at_once", "poisson", "constant", "bursts"] = "all_at_once"
    rate: float | None = Field(default=None, gt=0)  # requests/s (poisson, constant)
    burst_size: int | None = Field(default=None, ge=1)
    burst_interval: float | None = Field(default=None, ge=0)  # seconds between bursts
    start: float = Field(default=0.0, ge=0)  # seconds before the first arrival
    max_concurrency: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _params(self):
        if self.pattern in ("poisson", "constant") and self.rate is None:
            raise ValueError(f"arrival pattern {self.pattern!r} needs a rate (requests/s)")
        if self.pattern == "bursts" and (self.burst_size is None or self.burst_interval is None):
            raise ValueError("arrival pattern 'bursts' needs burst_size and burst_interval")
        return self

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n arrival times (seconds from the start of the run), non-decreasing."""
        if n == 0:
            return np.zeros(0)
        if self.pattern == "all_at_once":
            t = np.zeros(n)
        elif self.pattern == "poisson":  # exponential gaps; the first request arrives at `start`
            gaps = rng.exponential(1.0 / self.rate, n)
            t = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        elif self.pattern == "constant":
            t = np.arange(n) / self.rate
        else:
            t = (np.arange(n) // self.burst_size) * self.burst_interval
        return self.start + t


class PrefixGroup(_Spec):
    name: str
    length: int = Field(ge=1)  # tokens of the shared prefix
    share: float = Field(ge=0, le=1)  # fraction of all requests that start with one of this group's prefixes
    count: int = Field(default=1, ge=1)  # distinct prefixes in the group (e.g. RAG documents), used uniformly


class RequestClass(_Spec):
    name: str
    share: float = Field(default=1.0, ge=0)
    priority: Priority | None = None
    prompt_len: Distribution | None = None  # default: the workload's
    output_len: Distribution | None = None
    arrival: Arrival | None = None  # default: the workload's arrival process, shared with other classes
    sampling: dict[str, Any] = Field(default_factory=dict)
    slo: dict[str, float] = Field(default_factory=dict)  # ttft, tpot, e2e (seconds): this class's goodput SLOs
    # Another class's name: this class's requests are sent only while that class still has requests
    # unfinished (arrivals "for as long as the batch runs"); the later ones are skipped, not failed.
    while_running: str | None = None

    @field_validator("prompt_len", "output_len", mode="before")
    @classmethod
    def _shorthand(cls, v):
        return _dist_shorthand(v)

    @field_validator("arrival")
    @classmethod
    def _no_class_concurrency(cls, v):
        if v is not None and v.max_concurrency is not None:
            raise ValueError("max_concurrency is a workload-wide setting (top-level arrival)")
        return v

    @field_validator("slo")
    @classmethod
    def _slo_keys(cls, v):
        bad = set(v) - {"ttft", "tpot", "e2e"}
        if bad:
            raise ValueError(f"unknown SLO keys {sorted(bad)}; use ttft, tpot, e2e (seconds)")
        return v


class ModelMix(_Spec):
    names: list[str] = Field(min_length=1)
    zipf: float | None = Field(default=None, ge=0)  # share of the k-th name proportional to 1/k^zipf
    shares: list[float] | None = None  # or explicit shares

    @model_validator(mode="after")
    def _check(self):
        if self.zipf is not None and self.shares is not None:
            raise ValueError("models: give zipf or shares, not both")
        if self.shares is not None and len(self.shares) != len(self.names):
            raise ValueError("models: one share per name")
        return self

    def probabilities(self) -> np.ndarray:
        k = len(self.names)
        if self.shares is not None:
            w = np.asarray(self.shares, dtype=np.float64)
        elif self.zipf is not None:
            w = 1.0 / np.arange(1, k + 1, dtype=np.float64) ** self.zipf
        else:
            w = np.ones(k)
        return w / w.sum()


class WorkloadSpec(_Spec):
    name: str
    description: str = ""
    num_requests: int = Field(ge=1)
    seed: int = 0
    context_length: int | None = Field(default=None, ge=1)
    prompt_len: Distribution
    output_len: Distribution
    prefix_groups: list[PrefixGroup] = Field(default_factory=list)
    classes: list[RequestClass] = Field(default_factory=lambda: [RequestClass(name="default")])
    models: ModelMix | None = None
    arrival: Arrival = Field(default_factory=Arrival)
    sampling: dict[str, Any] = Field(default_factory=dict)

    _base_dir: Path | None = PrivateAttr(default=None)  # where trace files are looked up

    @field_validator("prompt_len", "output_len", mode="before")
    @classmethod
    def _shorthand(cls, v):
        return _dist_shorthand(v)

    @model_validator(mode="after")
    def _check(self):
        if sum(g.share for g in self.prefix_groups) > 1 + 1e-9:
            raise ValueError("prefix_groups: the shares add up to more than 1")
        if not self.classes or sum(c.share for c in self.classes) <= 0:
            raise ValueError("classes: at least one class with a positive share")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("classes: names must be unique")
        for c in self.classes:
            if c.while_running is not None and (c.while_running not in names or c.while_running == c.name):
                raise ValueError(f"class {c.name!r}: while_running must name another class, not {c.while_running!r}")
        return self

    def generate(self, seed: int | None = None, *, vocab_size: int, special_ids: set[int] | frozenset[int] = frozenset(),
                 max_model_len: int = 8192, num_requests: int | None = None) -> list["Request"]:
        return generate(self, seed, vocab_size=vocab_size, special_ids=special_ids,
                        max_model_len=max_model_len, num_requests=num_requests)


@dataclass
class Request:
    """One request of a workload, in arrival order."""

    index: int
    arrival: float  # seconds from the start of the run
    prompt: list[int]  # token ids, prefix included
    output_len: int  # max_tokens (with ignore_eos, the exact output length)
    cls: str
    priority: str | None = None
    model: str | None = None  # None: the benchmark's --model
    prefix_group: str | None = None
    prefix_id: int | None = None  # which of the group's prefixes
    prefix_len: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)  # body fields (temperature, ignore_eos, ...)
    slo: dict[str, float] = field(default_factory=dict)
    while_running: str | None = None  # sent only while that class has requests unfinished

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


# --- loading

def list_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def load_workload(name_or_path: str | Path) -> WorkloadSpec:
    """A workload file (YAML or JSON), or the name of one shipped in bench/workloads/."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        for ext in (".yaml", ".yml", ".json"):
            cand = WORKLOADS_DIR / f"{name_or_path}{ext}"
            if cand.is_file():
                path = cand
                break
        else:
            raise FileNotFoundError(f"no workload file or shipped workload named {str(name_or_path)!r}; "
                                    f"shipped: {', '.join(list_workloads())}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a workload is a mapping")
    data.setdefault("name", path.stem)
    spec = WorkloadSpec.model_validate(data)
    spec._base_dir = path.parent
    return spec


# --- generation

def exact_counts(shares: list[float] | np.ndarray, n: int) -> np.ndarray:
    """Integer counts proportional to shares, summing to round(n * sum(shares)) (largest remainder)."""
    s = np.asarray(shares, dtype=np.float64)
    total = int(round(n * s.sum()))
    raw = n * s
    counts = np.floor(raw + 1e-9).astype(np.int64)
    left = total - int(counts.sum())
    if left > 0:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:left]] += 1
    return counts


def _assign(rng: np.random.Generator, shares: list[float] | np.ndarray, n: int, normalize: bool = True) -> np.ndarray:
    """Index per request (-1: none), exact counts, in a seeded random order."""
    s = np.asarray(shares, dtype=np.float64)
    if normalize:
        s = s / s.sum()
    counts = exact_counts(s, n)
    labels = np.concatenate([np.full(c, i) for i, c in enumerate(counts)] + [np.full(n - counts.sum(), -1)])
    return rng.permutation(labels.astype(np.int64))


def _read_trace(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"trace {path} is empty")
    return rows


def allowed_token_ids(vocab_size: int, special_ids: set[int] | frozenset[int]) -> np.ndarray:
    return np.array([t for t in range(vocab_size) if t not in special_ids])


def generate(spec: WorkloadSpec, seed: int | None = None, *, vocab_size: int,
             special_ids: set[int] | frozenset[int] = frozenset(), max_model_len: int = 8192,
             num_requests: int | None = None) -> list[Request]:
    """The workload's requests, sorted by arrival (ties keep their order). Deterministic."""
    seed = spec.seed if seed is None else seed
    n = num_requests or spec.num_requests
    main = np.random.default_rng(seed)  # lengths, then prompt tokens: mixed_workload's order

    def aux(k: int) -> np.random.Generator:
        return np.random.default_rng([seed, k])

    classes = spec.classes
    cls_of = _assign(aux(1), [c.share for c in classes], n)
    model_of = _assign(aux(2), spec.models.probabilities(), n) if spec.models else np.full(n, -1)
    groups = spec.prefix_groups
    group_of = _assign(aux(3), [g.share for g in groups], n, normalize=False) if groups else np.full(n, -1)
    r = aux(7)  # which of the group's prefixes
    variant_of = np.array([r.integers(0, groups[g].count) if g >= 0 else -1 for g in group_of], dtype=np.int64)

    # trace rows: one row per request per trace file, shared by every distribution reading that file
    trace_rng, traces, rows = aux(6), {}, {}
    for d in [spec.prompt_len, spec.output_len] + [x for c in classes for x in (c.prompt_len, c.output_len)]:
        if isinstance(d, Trace) and d.file not in traces:
            path = Path(d.file) if Path(d.file).is_absolute() else (spec._base_dir or Path.cwd()) / d.file
            traces[d.file] = _read_trace(path)
            rows[d.file] = trace_rng.integers(0, len(traces[d.file]), n)

    def lengths(which: str) -> np.ndarray:
        out = np.zeros(n, dtype=np.int64)
        for ci, c in enumerate(classes):
            members = np.flatnonzero(cls_of == ci)
            d = getattr(c, which) or getattr(spec, which)
            if not len(members):
                continue
            if isinstance(d, Trace):
                vals = np.array([float(traces[d.file][i][d.field]) for i in rows[d.file][members]])
                out[members] = np.clip(np.rint(vals), d.min, d.max if d.max is not None else np.inf)
            else:
                out[members] = d.sample(main, len(members))
        return out

    plens, olens = lengths("prompt_len"), lengths("output_len")
    scale = max_model_len / spec.context_length if spec.context_length else 1.0
    prefix_lens = [g.length for g in groups]
    if scale != 1.0:
        plens = np.maximum(1, np.rint(plens * scale)).astype(np.int64)
        olens = np.maximum(1, np.rint(olens * scale)).astype(np.int64)
        prefix_lens = [max(1, round(x * scale)) for x in prefix_lens]

    allowed = allowed_token_ids(vocab_size, special_ids)
    if not len(allowed):
        raise ValueError("no token ids to build prompts from")
    ptok = aux(4)
    prefixes = [[ptok.choice(allowed, prefix_lens[gi]).tolist() for _ in range(g.count)]
                for gi, g in enumerate(groups)]

    arr_rng = aux(5)
    arrivals = np.zeros(n)
    shared = np.flatnonzero(np.array([classes[ci].arrival is None for ci in cls_of], dtype=bool)) if n else []
    arrivals[shared] = spec.arrival.times(arr_rng, len(shared))
    for ci, c in enumerate(classes):
        if c.arrival is not None:
            members = np.flatnonzero(cls_of == ci)
            arrivals[members] = c.arrival.times(arr_rng, len(members))

    base_sampling = {"temperature": 0, "ignore_eos": True} | spec.sampling
    reqs = []
    for i in range(n):
        out = int(np.clip(olens[i], 1, max_model_len - 1))
        room = max_model_len - out
        g = int(group_of[i])
        prefix = prefixes[g][variant_of[i]][:room - 1] if g >= 0 else []
        suffix_len = int(min(max(1, plens[i]), room - len(prefix)))
        suffix = main.choice(allowed, suffix_len).tolist()
        c = classes[cls_of[i]]
        reqs.append(Request(
            index=i, arrival=float(arrivals[i]), prompt=prefix + suffix, output_len=out, cls=c.name,
            priority=c.priority, model=spec.models.names[model_of[i]] if model_of[i] >= 0 else None,
            prefix_group=groups[g].name if g >= 0 else None, prefix_id=int(variant_of[i]) if g >= 0 else None,
            prefix_len=len(prefix), sampling=base_sampling | c.sampling, slo=dict(c.slo),
            while_running=c.while_running))
    reqs.sort(key=lambda q: q.arrival)  # stable
    for i, q in enumerate(reqs):
        q.index = i
    return reqs


def summary(spec: WorkloadSpec, requests: list[Request], seed: int | None) -> dict:
    """What the JSON reports say about the workload that ran."""
    p = [q.prompt_len for q in requests]
    o = [q.output_len for q in requests]
    return {"name": spec.name, "seed": spec.seed if seed is None else seed, "num_requests": len(requests),
            "prompt_tokens": int(sum(p)), "output_tokens": int(sum(o)),
            "prompt_len": {"min": min(p, default=0), "mean": float(np.mean(p)) if p else 0.0, "max": max(p, default=0)},
            "output_len": {"min": min(o, default=0), "mean": float(np.mean(o)) if o else 0.0, "max": max(o, default=0)},
            "classes": {c.name: sum(q.cls == c.name for q in requests) for c in spec.classes},
            "duration_of_arrivals_s": max((q.arrival for q in requests), default=0.0),
            "max_concurrency": spec.arrival.max_concurrency}
