"""`meshserve bench-isolation`: a small model's latency alone, beside a busy larger model, and beside it
with resource partitions (issue 12), side by side in one run.

    meshserve bench-isolation [--small M] [--big DIR] [--big-width 2] [--dtype bfloat16]
                              [--small-requests 30] [--prompt-tokens 64] [--output-tokens 32]
                              [--big-streams 4] [--big-output-tokens 256]
                              [--small-cpus "0"] [--big-cpus "1"] [--mesh-args "..."] [--out FILE]

The big model is `--big`, or a random-weight model the benchmark writes itself: `--small`'s KV
shape (layers, KV heads, head size: the node's one KV arena holds both) and tokenizer, `--big-width`
times its hidden and MLP sizes. Two decode workers (worker 0 on the small model, worker 1 on the
big one) under one `meshserve up --models`; three runs:

- `alone`: the small model's requests (one at a time, streamed), the big model idle;
- `shared`: the same while `--big-streams` streams keep the big model busy, no partitions: each
  worker may use every core (`--worker-threads`, default: all the cores);
- `partitioned`: the same with `cpus` in the manifest (the small model's workers on
  `--small-cpus`, the big one's on `--big-cpus`; default: the first half of the cores and the rest),
  each worker then on at most one thread per core of its set.

Reported per run: the small model's TTFT and inter-token latency (p50, p99), and the big model's
output tokens/s (what isolating the small one costs it); then each busy run over `alone`.
Prints the JSON on stdout (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshserve.bench.compare import add_mesh_arguments, start_mesh, stop_mesh
from meshserve.bench.loadgen import quiet_http_logs, write_json
from meshserve.bench.report import stats
from meshserve.shared.models_repo import DEFAULT_MODEL


def write_random_model(like: str, into: Path, width: float, seed: int = 0, layers: int | None = None) -> Path:
    """A random-weight Llama (Hugging Face layout, bf16) with `like`'s KV shape (or another number of
    `layers`: another KV shape) and tokenizer and `width` times its hidden and MLP sizes."""
    import torch
    from safetensors.torch import save_file

    from meshserve.shared.models_repo import load_model_files

    cfg, _, tok = load_model_files(like)
    hd, kv, num_layers = cfg.head_dim, cfg.num_key_value_heads, layers or cfg.num_hidden_layers
    heads = max(kv, round(cfg.num_attention_heads * width / kv) * kv)  # a multiple of the KV heads (GQA)
    hidden, inter = heads * hd, int(cfg.intermediate_size * width)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": rand(cfg.vocab_size, hidden),
          "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               p + "self_attn.q_proj.weight": rand(heads * hd, hidden),
               p + "self_attn.k_proj.weight": rand(kv * hd, hidden),
               p + "self_attn.v_proj.weight": rand(kv * hd, hidden),
               p + "self_attn.o_proj.weight": rand(hidden, heads * hd),
               p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
               p + "mlp.down_proj.weight": rand(hidden, inter)}
    into.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(into / "model.safetensors"))
    tok.save_hf_dir(into)
    (into / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": True,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids, "torch_dtype": "bfloat16"}))
    return into


async def _stream(client, url: str, body: dict, count: list[int] | None = None) -> tuple[float, list[float], int]:
    """(TTFT, the gaps between content chunks, chunks) of one streamed completion; `count[0]` counts
    the chunks as they come."""
    t0 = time.monotonic()
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                if any(c.get("text") for c in chunk.get("choices") or []):
                    times.append(time.monotonic())
                    if count is not None:
                        count[0] += 1
    if not times:
        raise RuntimeError("a stream with no tokens")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # ids 0-2 are the special tokens in SmolLM2's vocabulary


async def _phase(url: str, a, vocab: int, busy: bool) -> dict:
    """The small model's requests one after another, with the big model kept busy meanwhile or not."""
    import httpx

    rng, big_rng = random.Random(a.seed), random.Random(a.seed + 1)  # the same small prompts in every run
    small = {"model": "small", "max_tokens": a.output_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    big = {"model": "big", "max_tokens": a.big_output_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as c:
        for body in (small, big):  # warm-up: both workers have run steps of these sizes
            await _stream(c, url, dict(body, prompt=_prompt(big_rng, a.prompt_tokens, vocab), max_tokens=4))
        stop, big_tokens, finished, big_failed = asyncio.Event(), [0], [0], [0]

        async def keep_busy():
            while not stop.is_set():
                try:
                    await _stream(c, url, dict(big, prompt=_prompt(big_rng, a.prompt_tokens, vocab)), big_tokens)
                except Exception:  # noqa: BLE001 - counted; this stream stops
                    big_failed[0] += 1
                    return
                finished[0] += 1

        busy_tasks = [asyncio.ensure_future(keep_busy()) for _ in range(a.big_streams if busy else 0)]
        if busy_tasks:
            await asyncio.sleep(a.big_ramp_s)  # the big model's streams are past their prompts
        t0, big_before = time.monotonic(), big_tokens[0]
        ttft, itl, failed = [], [], 0
        for _ in range(a.small_requests):
            try:
                t, gaps, _ = await _stream(c, url, dict(small, prompt=_prompt(rng, a.prompt_tokens, vocab)))
                ttft.append(t)
                itl += gaps
            except Exception:  # noqa: BLE001 - counted, the run goes on
                failed += 1
        span, big_during = time.monotonic() - t0, big_tokens[0] - big_before
        stop.set()
        for t in busy_tasks:
            t.cancel()
        await asyncio.gather(*busy_tasks, return_exceptions=True)
    return {"small": {"requests": a.small_requests, "failed": failed, "ttft_s": _pct(ttft), "itl_s": _pct(itl)},
            "big": {"streams": len(busy_tasks), "finished_streams": finished[0], "failed": big_failed[0],
                    "output_tokens_per_s": round(big_during / span, 2) if busy_tasks else None}}


def _pct(xs: list[float]) -> dict:
    s = stats(xs)
    return {"p50": s["p50"], "p99": s["p99"], "mean": s["mean"], "n": len(xs)}


def _manifest(path: Path, small: str, big: str, cpus: tuple[str, str] | None) -> Path:
    extra = [f", cpus: '{c}'" for c in cpus] if cpus else ["", ""]
    path.write_text(f"- {{name: small, path: '{small}'{extra[0]}}}\n- {{name: big, path: '{big}'{extra[1]}}}\n")
    return path


def default_split(cores: list[int]) -> tuple[str, str]:
    """The first half of the cores (at least one) for the small model, the rest for the big one."""
    from meshserve.shared.partitions import format_cpus

    if len(cores) < 2:
        raise SystemExit("bench-isolation needs at least two cores to split between the models")
    k = max(1, len(cores) // 2)
    return format_cpus(cores[:k]), format_cpus(cores[k:])


def _mesh(a, manifest: Path, label: str):
    m = copy.copy(a)
    m.model, m.prefill, m.decode = a.small, 0, 2
    m.mesh_args = (f"{a.mesh_args or ''} --models {manifest} --fixed-roles --fixed-model-workers "
                   f"--worker-threads {a.worker_threads}")  # one worker per model, as the runs compare
    print(f"{label}: meshserve up {m.mesh_args.strip()} ...", file=sys.stderr, flush=True)
    return start_mesh(m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshserve bench-isolation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default=DEFAULT_MODEL, help="the small, latency-sensitive model")
    ap.add_argument("--big", default=None, help="the busy model (default: a random one written from --small)")
    ap.add_argument("--big-width", type=float, default=2.0, help="the written big model's hidden and MLP sizes "
                                                               "over the small one's")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--small-requests", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--big-streams", type=int, default=4, help="concurrent streams that keep the big model busy")
    ap.add_argument("--big-output-tokens", type=int, default=256)
    ap.add_argument("--big-ramp-s", type=float, default=2.0, help="seconds of big-model load before measuring")
    ap.add_argument("--small-cpus", default=None, help="the small model's cores with partitions (manifest `cpus`)")
    ap.add_argument("--big-cpus", default=None, help="the big model's cores with partitions")
    ap.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: all the "
                                                                     "cores; a partition caps them at its cores)")
    ap.add_argument("--seed", type=int, default=0)
    add_mesh_arguments(ap, prefill=None, decode=None)  # the workers are the benchmark's to set
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    quiet_http_logs()
    from meshserve.shared.models_repo import load_tokenizer, resolve
    from meshserve.shared.partitions import process_cores

    cores = process_cores()
    a.worker_threads = a.worker_threads or len(cores)
    split = (a.small_cpus, a.big_cpus) if a.small_cpus and a.big_cpus else default_split(cores)
    vocab = load_tokenizer(a.small).vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="meshserve-bench-isolation-"))
    try:
        big = a.big or str(write_random_model(a.small, tmp / "big", a.big_width, a.seed))
        small = str(resolve(a.small))
        res: dict = {"command": "meshserve bench-isolation " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "small": small, "big": a.big or f"random, {a.big_width:g}x the small model's width",
                     "big_bytes": sum(f.stat().st_size for f in Path(big).glob("*.safetensors")) if Path(big).is_dir()
                     else os.path.getsize(big),
                     "cores": len(cores), "worker_threads": a.worker_threads,
                     "partitions": {"small": split[0], "big": split[1]}, "runs": {}}
        up, url = _mesh(a, _manifest(tmp / "plain.yaml", small, big, None), "alone + shared")
        try:
            res["runs"]["alone"] = asyncio.run(_phase(url, a, vocab, busy=False))
            res["runs"]["shared"] = asyncio.run(_phase(url, a, vocab, busy=True))
        finally:
            stop_mesh(up)
        up, url = _mesh(a, _manifest(tmp / "partitioned.yaml", small, big, split), "partitioned")
        try:
            res["runs"]["partitioned"] = asyncio.run(_phase(url, a, vocab, busy=True))
        finally:
            stop_mesh(up)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    alone = res["runs"]["alone"]["small"]

    def over(run: str, metric: str):
        x, y = res["runs"][run]["small"][metric]["p99"], alone[metric]["p99"]
        return round(x / y, 3) if x and y else None

    res["summary"] = {
        "small_ttft_p99_s": {k: r["small"]["ttft_s"]["p99"] for k, r in res["runs"].items()},
        "small_itl_p99_s": {k: r["small"]["itl_s"]["p99"] for k, r in res["runs"].items()},
        "big_output_tokens_per_s": {k: r["big"]["output_tokens_per_s"] for k, r in res["runs"].items()},
        "ttft_p99_over_alone": {k: over(k, "ttft_s") for k in ("shared", "partitioned")},
        "itl_p99_over_alone": {k: over(k, "itl_s") for k in ("shared", "partitioned")}}
    if a.out:
        write_json(a.out, res)
    print(json.dumps(res, indent=2))
    return 0 if all(r["small"]["failed"] == 0 for r in res["runs"].values()) else 1
