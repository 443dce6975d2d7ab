"""Benchmark workloads (bench/workload.py): seeded, reproducible, and the samples follow
the distributions, shares and arrival processes the files ask for."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from meshserve.bench.workload import (LogNormal, Normal, Uniform, exact_counts, list_workloads,
                                               load_workload)

VOCAB = 500
SPECIAL = {0, 1, 2}


def write(tmp_path, data: dict, name: str = "w.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data))
    return p


def gen(spec_or_path, seed=None, **kw):
    spec = load_workload(spec_or_path) if not hasattr(spec_or_path, "generate") else spec_or_path
    return spec.generate(seed, vocab_size=kw.pop("vocab_size", VOCAB), special_ids=kw.pop("special_ids", SPECIAL), **kw)


RICH = {"name": "rich", "num_requests": 300,
        "prompt_len": {"dist": "normal", "mean": 80, "std": 20},
        "output_len": {"dist": "uniform", "low": 5, "high": 40},
        "prefix_groups": [{"name": "sys", "length": 32, "share": 0.3}, {"name": "rag", "length": 48, "share": 0.4, "count": 3}],
        "classes": [{"name": "a", "share": 0.6, "priority": "normal"},
                    {"name": "b", "share": 0.4, "priority": "interactive", "output_len": 7,
                     "arrival": {"pattern": "bursts", "burst_size": 5, "burst_interval": 2.0}}],
        "models": {"names": ["m1", "m2", "m3"], "zipf": 1.0},
        "arrival": {"pattern": "poisson", "rate": 10.0}}


def test_same_file_and_seed_same_requests_other_seed_differs(tmp_path):
    path = write(tmp_path, RICH)
    a, b = gen(path, 3), gen(load_workload(path), 3)  # loaded twice: nothing cached between
    assert a == b and len(a) == 300
    json_path = write(tmp_path, RICH, "w.json")  # JSON and YAML describe the same workload
    assert gen(json_path, 3) == a
    c = gen(path, 4)
    assert [q.prompt for q in c] != [q.prompt for q in a]
    assert [q.arrival for q in c] != [q.arrival for q in a]
    assert sorted(q.output_len for q in c) != sorted(q.output_len for q in a)
    assert gen(path) == gen(path, 0)  # the file's seed (default 0)
    for q in a:  # prompts never contain special ids and stay in the vocabulary
        assert not SPECIAL & set(q.prompt) and max(q.prompt) < VOCAB
    assert [q.arrival for q in a] == sorted(q.arrival for q in a) and [q.index for q in a] == list(range(300))


def test_mixed_64_is_the_engine_benchmarks_workload():
    from meshserve.bench.engine_bench import mixed_workload

    reqs = gen("mixed-64", 0, vocab_size=49152)
    want = mixed_workload(64, 0, 49152, SPECIAL)
    assert [(q.prompt, q.output_len) for q in reqs] == want
    assert all(q.arrival == 0 for q in reqs)
    assert sum(q.output_len for q in reqs) == 8920  # as docs/benchmarks reports for seed 0
    assert all(39 <= q.prompt_len <= 1021 and 17 <= q.output_len <= 256 for q in reqs)


def test_distributions_match_their_parameters():
    rng = np.random.default_rng(0)
    n = 40000
    x = Normal(dist="normal", mean=500, std=100).sample(rng, n)
    assert abs(x.mean() - 500) < 3 and abs(x.std() - 100) < 2
    x = LogNormal(dist="lognormal", mu=5.0, sigma=0.6).sample(rng, n)
    assert abs(np.log(x).mean() - 5.0) < 0.01 and abs(np.log(x).std() - 0.6) < 0.01
    x = LogNormal(dist="lognormal", median=200, sigma=1.0).sample(rng, n)
    assert abs(np.median(x) - 200) < 6
    x = Uniform(dist="uniform", low=39, high=1021).sample(rng, n)
    assert x.min() == 39 and x.max() == 1021 and abs(x.mean() - 530) < 4
    assert len(np.unique(x)) == 1021 - 39 + 1  # every value in the range is drawn, none outside
    x = Normal(dist="normal", mean=10, std=50, min=4, max=30).sample(rng, n)
    assert x.min() == 4 and x.max() == 30
    with pytest.raises(ValidationError):
        Uniform(dist="uniform", low=10, high=5)
    with pytest.raises(ValidationError):
        LogNormal(dist="lognormal", sigma=1.0)  # neither mu nor median


def test_generated_lengths_follow_the_workload(tmp_path):
    spec = {"name": "d", "num_requests": 4000,
            "prompt_len": {"dist": "normal", "mean": 300, "std": 40},
            "output_len": {"dist": "lognormal", "mu": 4.0, "sigma": 0.5}}
    reqs = gen(write(tmp_path, spec), 1)
    p = np.array([q.prompt_len for q in reqs])
    o = np.array([q.output_len for q in reqs])
    assert abs(p.mean() - 300) < 3 and abs(p.std() - 40) < 2
    assert abs(np.log(o).mean() - 4.0) < 0.03 and abs(np.log(o).std() - 0.5) < 0.03


def test_shares_zipf_classes_and_prefix_groups(tmp_path):
    data = dict(RICH, num_requests=1000, models={"names": ["a", "b", "c", "d"], "zipf": 1.2})
    reqs = gen(write(tmp_path, data), 5)
    zipf = 1 / np.arange(1, 5) ** 1.2
    counts = Counter(q.model for q in reqs)
    for name, share in zip("abcd", zipf / zipf.sum()):
        assert abs(counts[name] / 1000 - share) <= 1 / 1000
    classes = Counter(q.cls for q in reqs)
    assert classes == {"a": 600, "b": 400}
    assert all(q.priority == ("normal" if q.cls == "a" else "interactive") for q in reqs)
    assert all(q.output_len == 7 for q in reqs if q.cls == "b")  # the class's own length
    assert len({q.cls for q in reqs[:50]}) == 2  # assigned in a random order, not in blocks
    # prefix groups: 30% start with the one system prompt, 40% with one of three RAG documents
    groups = Counter(q.prefix_group for q in reqs)
    assert groups == {"sys": 300, "rag": 400, None: 300}
    sys_prefixes = {tuple(q.prompt[:32]) for q in reqs if q.prefix_group == "sys"}
    rag_prefixes = Counter(tuple(q.prompt[:48]) for q in reqs if q.prefix_group == "rag")
    assert len(sys_prefixes) == 1 and len(rag_prefixes) == 3 and min(rag_prefixes.values()) > 100
    sys_prefix = next(iter(sys_prefixes))
    assert sum(tuple(q.prompt[:32]) == sys_prefix for q in reqs) == 300  # nobody else shares it
    assert all(q.prompt_len >= q.prefix_len for q in reqs)


def test_shipped_shared_prefix_shares_1024_tokens_with_80_percent():
    reqs = gen("shared-prefix", 0)
    heads = Counter(tuple(q.prompt[:1024]) for q in reqs if q.prompt_len >= 1024)
    (head, count), = heads.most_common(1)
    assert len(head) == 1024 and count == round(0.8 * len(reqs))
    assert sum(tuple(q.prompt[:1024]) == head for q in reqs) == count


def test_exact_counts():
    assert exact_counts([0.875, 0.125], 8).tolist() == [7, 1]
    assert exact_counts([1 / 3] * 3, 10).sum() == 10
    assert exact_counts([0.3, 0.4], 10).tolist() == [3, 4]


def test_arrival_processes(tmp_path):
    base = {"name": "a", "num_requests": 5000, "prompt_len": 8, "output_len": 4}
    t = np.array([q.arrival for q in gen(write(tmp_path, base | {"arrival": {"pattern": "poisson", "rate": 5.0}}), 2)])
    gaps = np.diff(t)
    assert t[0] == 0 and abs(gaps.mean() - 0.2) < 0.01 and abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential
    t = [q.arrival for q in gen(write(tmp_path, base | {"num_requests": 10, "arrival": {
        "pattern": "bursts", "burst_size": 4, "burst_interval": 3.0, "start": 1.0}}))]
    assert t == [1.0] * 4 + [4.0] * 4 + [7.0] * 2
    t = [q.arrival for q in gen(write(tmp_path, base | {"num_requests": 4, "arrival": {"pattern": "constant", "rate": 2.0}}))]
    assert t == [0.0, 0.5, 1.0, 1.5]
    reqs = gen(write(tmp_path, base | {"num_requests": 7, "arrival": {"max_concurrency": 3}}))
    assert all(q.arrival == 0 for q in reqs) and load_workload(tmp_path / "w.yaml").arrival.max_concurrency == 3


def test_priority_mix_interactive_arrives_during_the_background_batch():
    reqs = gen("priority-mix", 0)
    bg = [q for q in reqs if q.cls == "background"]
    inter = [q for q in reqs if q.cls == "interactive"]
    assert len(bg) == 48 and len(inter) == 16
    assert all(q.arrival == 0 and q.priority == "background" for q in bg)
    assert all(q.arrival >= 2.0 and q.priority == "interactive" for q in inter)
    assert all(q.slo == {"ttft": 1.0, "tpot": 0.1} for q in inter)
    assert all(32 <= q.prompt_len <= 128 for q in inter)


def test_sustained_mix_has_interactive_bursts_for_a_minute_beside_normal_traffic_and_a_batch():
    reqs = gen("sustained-mix", 0)
    by = {c: [q for q in reqs if q.cls == c] for c in ("background", "interactive", "normal")}
    assert [len(by[c]) for c in by] == [16, 180, 24]
    assert all(q.arrival == 0 and q.priority == "background" and q.prompt_len >= 1000 for q in by["background"])
    times = Counter(q.arrival for q in by["interactive"])
    assert set(times.values()) == {6} and min(times) == 1.0 and max(times) == 59.0  # 6 every 2 s
    assert all(q.priority == "normal" for q in by["normal"]) and len({q.arrival for q in by["normal"]}) == 24


def test_short_long_and_multi_model():
    reqs = gen("short-long", 0)
    assert sorted(q.output_len for q in reqs)[-1] == 2000
    assert all(45 <= q.output_len <= 55 for q in reqs if q.cls == "short") and len(reqs) == 8
    models = Counter(q.model for q in gen("multi-model", 0))
    assert models.most_common(1)[0] == ("smollm2-135m-instruct", 52)  # 96 / (1 + 1/2 + 1/3) = 52.4


def test_mixed_chat_lengths_and_context_scaling():
    spec = load_workload("mixed-chat")
    reqs = gen(spec, 0, num_requests=3000)
    p = np.array([q.prompt_len for q in reqs])
    assert abs((p < 200).mean() - 0.5) < 0.04 and abs((p > 4000).mean() - 0.05) < 0.015
    assert all(q.prompt_len + q.output_len <= 8192 for q in reqs)
    small = gen(spec, 0, num_requests=3000, max_model_len=2048)  # scaled to a quarter, then clamped
    ps = np.array([q.prompt_len for q in small])
    assert abs(np.median(ps) - np.median(p) / 4) < 6
    assert all(q.prompt_len + q.output_len <= 2048 for q in small)


def test_trace_lengths_are_sampled_in_pairs(tmp_path):
    rows = [{"input_tokens": 10 * k, "output_tokens": k} for k in range(3, 40)]
    (tmp_path / "trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = {"name": "t", "num_requests": 400,
            "prompt_len": {"dist": "trace", "file": "trace.jsonl", "field": "input_tokens"},
            "output_len": {"dist": "trace", "file": "trace.jsonl", "field": "output_tokens"}}
    reqs = gen(write(tmp_path, spec), 0)
    assert all(q.prompt_len == 10 * q.output_len for q in reqs)  # both from the same row
    assert len({q.output_len for q in reqs}) > 30 and {q.output_len for q in reqs} <= set(range(3, 40))


def test_bad_specs_are_refused(tmp_path):
    base = {"name": "b", "num_requests": 4, "prompt_len": 8, "output_len": 4}
    for bad in ({"typo_field": 1}, {"prompt_len": {"dist": "zipf", "a": 2}},
                {"arrival": {"pattern": "poisson"}},
                {"prefix_groups": [{"name": "x", "length": 4, "share": 0.7}, {"name": "y", "length": 4, "share": 0.7}]},
                {"classes": [{"name": "c", "slo": {"latency": 1}}]}):
        with pytest.raises(ValidationError):
            load_workload(write(tmp_path, base | bad))
    with pytest.raises(FileNotFoundError, match="mixed-chat"):
        load_workload("no-such-workload")


def test_shipped_workloads_all_load():
    assert {"mixed-chat", "mixed-64", "short-long", "shared-prefix", "priority-mix", "multi-model"} <= set(list_workloads())
    for name in list_workloads():
        assert gen(name, 0, num_requests=16)
