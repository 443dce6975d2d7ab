"""Loading models: the load time from each tier, and a cold model's TTFT with and without layered
loading (issue 12). Run through `meshserve bench-models --tier-load-times` and `--cold-ttft`.

- Tier load times: the model-loader's own load path (ModelLoader.open_load and Load.run, in this
  process, no mesh) for each model of `--tier-models`: `source` (the model's files read, dequantized,
  fused: what its first load does; the prepared form is kept afterwards, untimed, as a mesh answers
  before keeping it), `disk` (the prepared form copied back), `host` (the bytes in memory, one copy). Each is timed `--repeat` times (min and median), as `answer_s`
  (until the buffer exists and its layout is known: when a layered load is answered) and `total_s`.
  The files are in the page cache after the first load (a cold disk is slower).
- Cold TTFT: `meshserve up --models` with two copies of one model (the worker starts on the first),
  then one streamed request of `--cold-prompt-tokens` tokens to the second, which is not loaded:
  its TTFT includes the load, from its files (`source`, a fresh cache) and from its prepared form
  (`disk`), per `--cold-tiers`. Once with layered loading, once with `--no-layered-loading`; then a
  median of three more requests to it with other prompts of that length, loaded by then (the TTFT
  without any load, and without prefix-cache hits). `--cold-repeat` rounds, the modes alternating.
  The cold model's files are read into the page cache before its first request, or with
  `--cold-page-cache cold` dropped from it (best effort: posix_fadvise).

`random-1b` in `--tier-models` (and the default `--cold-model`) is a random-weight Llama of about 1B
parameters the benchmark writes itself (bf16 safetensors, the tokenizer of `--model`), in the shape
of `--random-shape` (hidden,intermediate,layers; default 2048,5632,20: 1.08B parameters with an
untied head over SmolLM2's 49,152-token vocabulary).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import types
from pathlib import Path

from meshserve.shared.models_repo import DEFAULT_MODEL, load_tokenizer

RANDOM = "random-1b"


def write_random_model(dest: Path, shape: str, tokenizer_of: str, seed: int = 0) -> tuple[Path, int]:
    """A random-weight Llama in Hugging Face form (bf16 safetensors); returns (its directory, parameters)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers = (int(x) for x in shape.split(","))
    heads = max(1, hidden // 64)
    kv = max(1, heads // 8)
    d = hidden // heads
    tok = load_tokenizer(tokenizer_of)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_hf_dir(dest)
    vocab = tok.vocab_size
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else 0
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": d, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": vocab,
           "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else eos, "eos_token_id": eos,
           "torch_dtype": "bfloat16"}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    sd = {"model.embed_tokens.weight": rnd(vocab, hidden), "lm_head.weight": rnd(vocab, hidden),
          "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": rnd(heads * d, hidden),
               p + "self_attn.k_proj.weight": rnd(kv * d, hidden), p + "self_attn.v_proj.weight": rnd(kv * d, hidden),
               p + "self_attn.o_proj.weight": rnd(hidden, heads * d),
               p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
               p + "mlp.down_proj.weight": rnd(hidden, inter),
               p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    save_file(sd, str(dest / "model.safetensors"))
    return dest, sum(t.numel() for t in sd.values())


def _stats(xs: list[float]) -> dict:
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4), "runs": [round(x, 4) for x in xs]}


def tier_load_times(model: str, dtype: str, repeat: int, device: str = "cpu") -> dict:
    """Each tier's load time of one model through the loader's own load path (on `device`'s memory:
    a shared file, or a GPU allocation)."""
    from meshserve.services.model_loader import loads
    from meshserve.services.model_loader.main import ModelLoader
    from meshserve.shared.subjects import Subjects

    loader = ModelLoader(types.SimpleNamespace(subjects=Subjects("bench-tiers")), "n0", max_models=4, device=device)
    out: dict = {}
    host = None

    def timed(tier: str, **kw) -> None:
        nonlocal host
        answer, total = [], []
        for _ in range(repeat):
            t0 = time.monotonic()
            load = loader.open_load(model, dtype, **kw)
            answer.append(time.monotonic() - t0)
            try:
                load.run()
                total.append(time.monotonic() - t0)
                loader.keep_prepared(load)  # a mesh's load is answered before this (untimed)
                if host is None:
                    host = (loads.read_back(load.path, load.buffer), (load.specs, load.config))
                out.setdefault("came_from", {})[tier] = load.tier
                out["bytes"] = load.nbytes
            finally:
                load.release()
        out[tier] = {"answer_s": _stats(answer), "total_s": _stats(total)}

    timed("source", source=True)  # read, dequantized, fused (and the prepared form kept)
    timed("disk")  # the prepared form
    timed("host", host=host[0], meta=host[1])
    return out


def cold_ttft(a, model: Path, log) -> dict:
    """TTFT of a cold model's first request, layered and not, from each tier of `--cold-tiers` (source:
    its files, in a fresh cache; disk: its prepared form, kept by an earlier run), and of three more
    (loaded) requests with other prompts of the same length (the same prompt would find its blocks
    in the prefix cache). `--cold-repeat` rounds, a fresh mesh per run, the modes alternating:
    medians and each run, per tier."""
    tmp = Path(a.tmp)
    copies = {}
    for name in ("warm", "cold"):
        dst = tmp / f"cold-ttft-{name}"
        if not dst.exists():
            shutil.copytree(model, dst, copy_function=os.link)
        copies[name] = dst
    manifest = tmp / "cold-ttft.yaml"
    manifest.write_text("".join(f"- {{name: {n}, path: '{p}'}}\n" for n, p in copies.items()))
    vocab = load_tokenizer(str(model)).vocab_size - 10
    prompts = [[(first + step * i) % vocab + 5 for i in range(a.cold_prompt_tokens)]
               for first, step in ((7, 13), (3, 17), (11, 19), (5, 23))]
    tiers = a.cold_tiers.split(",")
    runs = {tier: {"layered": [], "whole": []} for tier in tiers}
    prepared_cache = tmp / "cache-prepared"  # the disk runs' cache: the first run from the files fills it
    for k in range(a.cold_repeat):
        for mode, flag in (("layered", ""), ("whole", "--no-layered-loading")):
            for tier in tiers:
                cache = tmp / f"cache-{k}-{mode}" if tier == "source" else prepared_cache
                files = [*copies["cold"].iterdir(), *cache.glob(f"prepared/{copies['cold'].name}-*/*")]
                run = _cold_run(a, copies["warm"], manifest, flag, prompts, cache, log, files,
                                keeps=f"{copies['cold'].name}-*" if tier == "source" else None)
                if tier == "source" and not prepared_cache.exists():
                    cache.rename(prepared_cache)
                shutil.rmtree(tmp / f"cache-{k}-{mode}", ignore_errors=True)
                came_from = (run["switch"] or {}).get("tier")
                if came_from != tier:
                    raise RuntimeError(f"a {tier} run loaded the cold model from {came_from}: {run}")
                runs[tier][mode].append(run)
    out = {}
    for tier, by_mode in runs.items():
        out[tier] = {mode: {"cold_ttft_s": statistics.median(r["cold_ttft_s"] for r in rs),
                            "loaded_ttft_s": statistics.median(r["loaded_ttft_s"] for r in rs), "runs": rs}
                     for mode, rs in by_mode.items()}
        whole = out[tier]["whole"]["cold_ttft_s"]
        out[tier]["layered_over_whole"] = out[tier]["layered"]["cold_ttft_s"] / whole if whole else None
    return out


def page_cache(files: list[Path], warm: bool) -> None:
    """The files' pages read into the page cache (warm), or dropped from it (cold: best effort, as
    posix_fadvise drops only clean pages that no process maps)."""
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            if warm:
                while fh.read(1 << 24):
                    pass
            else:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _cold_run(a, warm: Path, manifest: Path, flag: str, prompts: list[list[int]], cache: Path, log,
              files: list[Path], keeps: str | None = None) -> dict:
    """One mesh on `warm`, its model cache `cache`: the cold model's `files` put in or out of the page
    cache (`--cold-page-cache`), the first prompt to the cold model (it loads), then the others
    (loaded: the median is its loaded TTFT, as the worker's thread tuner tries its thread counts on
    the first steps of a size); with `keeps` (a glob), until the loader has kept a prepared form by
    that name (it does so after answering the load)."""
    import httpx

    from meshserve.bench.compare import start_mesh, stop_mesh

    m = types.SimpleNamespace(**vars(a))
    m.model = str(warm)
    m.mesh_args = f"{a.mesh_args or ''} --models {manifest} --fixed-roles --no-prewarm {flag}"
    m.prefill, m.decode = 0, 1
    log(f"cold TTFT, cache {cache}: {m.mesh_args.strip()}")
    os.environ["MESHSERVE_CACHE"] = str(cache)  # the mesh's processes inherit it
    up, url = start_mesh(m)

    def loader_models() -> list[dict]:
        st = httpx.get(url + "/health", timeout=10).json().get("scheduler", {})
        return [x for node in (st.get("loaders") or {}).values() for x in node.get("models", [])]

    try:
        deadline = time.monotonic() + a.mesh_startup_timeout
        while time.monotonic() < deadline:  # the first model written whole (a layered load answers early)
            if any(x["name"] == "warm" and x["tier"] == "mapped" for x in loader_models()):
                break
            time.sleep(0.5)
        page_cache(files, a.cold_page_cache == "warm")  # after the warm model's load: it may share their inodes
        ttfts, cached = [], []
        for prompt in prompts:
            body = {"model": "cold", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0, first = time.monotonic(), None
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
                r.raise_for_status()
                for line in r.iter_lines():  # read to the end; the first data line is the first token
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    if first is None:
                        first = time.monotonic() - t0
                    usage = json.loads(line[5:]).get("usage") or {}
                    if usage:
                        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            ttfts.append(round(first, 3))
        deadline = time.monotonic() + 10
        while True:  # the loaders' status comes with their heartbeats
            load_s = next((x["load_s"] for x in loader_models() if x["name"] == "cold"), None)
            if load_s or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        deadline = time.monotonic() + 300
        while keeps and not list((cache / "prepared").glob(f"{keeps}/weights.json")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no prepared form {keeps} was kept in {cache}")
            time.sleep(0.2)
        switches = httpx.get(url + "/health", timeout=10).json().get("scheduler", {}).get("recent_model_switches", [])
        return {"cold_ttft_s": ttfts[0], "loaded_ttft_s": statistics.median(ttfts[1:]), "loaded_ttfts_s": ttfts[1:],
                "cached_tokens": cached, "load_s": load_s,
                "switch": next((s for s in switches if s["to"] == "cold"), None)}
    finally:
        stop_mesh(up)


def main(a, log, argv: list[str]) -> dict:
    """bench-models --tier-load-times / --cold-ttft (see the module docstring)."""
    from meshserve.kernels import cpu_build

    # the compiled CPU kernels stay where they are (a fresh cache would rebuild them in every mesh)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cpu_build.build_dir()))
    os.environ["MESHSERVE_CACHE"] = str(Path(a.tmp) / "cache")  # a fresh cache: the first load is from source
    res: dict = {"command": "meshserve bench-models " + " ".join(argv), "dtype": a.dtype,
                 "device": getattr(a, "device", "cpu")}
    random_dir = None

    def model_path(name: str) -> str:
        nonlocal random_dir
        if name != RANDOM:
            return name
        if random_dir is None:
            log(f"writing a random-weight model of shape {a.random_shape} ...")
            random_dir, n = write_random_model(Path(a.tmp) / RANDOM, a.random_shape, a.model)
            res["random_model"] = {"shape": a.random_shape, "parameters": n}
        return str(random_dir)

    if a.tier_load_times:
        res["tier_load_times"] = {}
        for name in a.tier_models.split(","):
            log(f"tier load times of {name} ...")
            res["tier_load_times"][name] = tier_load_times(model_path(name), a.dtype, a.repeat,
                                                           getattr(a, "device", "cpu"))
    if a.cold_ttft:
        res["cold_ttft"] = cold_ttft(a, Path(model_path(a.cold_model)), log)
        res["cold_ttft"]["model"] = a.cold_model
    return res


def add_arguments(ap) -> None:
    ap.add_argument("--tier-load-times", action="store_true",
                    help="time one load of each model of --tier-models from each tier (no mesh, no workload)")
    ap.add_argument("--tier-models", default=f"{DEFAULT_MODEL},{RANDOM}",
                    help=f"comma-separated models; {RANDOM!r}: a random ~1B model written here (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="loads per tier (min and median reported)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="--tier-load-times: load into the node's shared memory (cpu) or a GPU allocation (cuda)")
    ap.add_argument("--cold-ttft", action="store_true",
                    help="a cold model's TTFT with and without layered loading (two meshes, no workload)")
    ap.add_argument("--cold-model", default=RANDOM, help="the model of --cold-ttft (default: %(default)s)")
    ap.add_argument("--cold-prompt-tokens", type=int, default=256)
    ap.add_argument("--cold-repeat", type=int, default=2, help="rounds of --cold-ttft, the modes alternating")
    ap.add_argument("--cold-page-cache", choices=("warm", "cold"), default="warm",
                    help="--cold-ttft: the cold model's files (its own and its prepared form) read into the page "
                         "cache before its first request, or dropped from it (default: %(default)s)")
    ap.add_argument("--cold-tiers", default="source,disk",
                    help="--cold-ttft loads the cold model from its files (source) and its prepared form (disk)")
    ap.add_argument("--random-shape", default="2048,5632,20",
                    help="hidden,intermediate,layers of the random model (default: %(default)s, about 1B parameters)")
