"""LoRA adapters (docs/models.md, "LoRA adapters"): requests for two adapters of one base and for the
base itself run in one engine step, and each gives the greedy tokens of that adapter merged into the
base (W + scaling * B @ A) and run alone through Hugging Face Transformers in fp32; an adapter for
another base is refused at load, saying why; one mesh serves adapters from its manifest and one
loaded at run time through vLLM's endpoint, and /v1/models lists them under their base.

Adapters are written here in PEFT's format (adapter_config.json + adapter_model.safetensors) with
random A and B (PEFT starts B at zero, which would hide every bug)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from mesh_util import Mesh
from openai import OpenAI
from oracle import hf_greedy
from safetensors.torch import load_file, save_file
from tiny_model import make_tiny_llama

from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.lora import LoRAError, module_shape, read_adapter
from meshserve.shared.manifest import ManifestError, load_manifest
from meshserve.shared.model.config import ModelConfig
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NEW = 12


def _prefix(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_adapter(out: Path, base: Path, r: int, alpha: float, targets=ALL, layers=None, seed: int = 0,
                  use_rslora: bool = False, base_name: str | None = None) -> Path:
    """A random PEFT LoRA adapter for the HF model at `base` (its config's shapes)."""
    cfg = ModelConfig.from_hf_dict(json.loads((base / "config.json").read_text()))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in (range(cfg.num_hidden_layers) if layers is None else layers):
        for m in targets:
            fan_in, fan_out = module_shape(cfg, m)
            key = f"base_model.model.model.layers.{i}.{_prefix(m)}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.3
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(targets), "use_rslora": use_rslora, "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(base) if base_name is None else base_name}))
    return out


def merge(base: Path, adapter: Path, out: Path) -> Path:
    """The oracle's weights: the base's HF directory with W + scaling * B @ A for every adapted module."""
    spec = read_adapter(adapter)
    shutil.copytree(base, out)
    sd = load_file(str(base / "model.safetensors"))
    ad = load_file(str(adapter / "adapter_model.safetensors"))
    for name, (layer, module, ab, _, _) in spec.tensors.items():
        if ab == "A":
            b = ad[name.replace("lora_A", "lora_B")]
            w = f"model.layers.{layer}.{_prefix(module)}.{module}.weight"
            sd[w] = (sd[w].double() + spec.scaling * (b.double() @ ad[name].double())).to(sd[w].dtype).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    a = write_adapter(root / "a", tiny_llama, r=4, alpha=8, seed=1)
    # another rank, rsLoRA, some modules (one of a fused pair), one layer
    b = write_adapter(root / "b", tiny_llama, r=2, alpha=4, targets=("q_proj", "v_proj", "up_proj", "down_proj"),
                      layers=[1], seed=2, use_rslora=True)
    c = write_adapter(root / "c", tiny_llama, r=3, alpha=3, targets=("k_proj", "o_proj", "gate_proj"), seed=3)
    other = make_tiny_llama(root / "other-base", intermediate_size=96, seed=5)
    wrong = write_adapter(root / "wrong", other, r=2, alpha=2, seed=4)  # shapes of another base
    return {"a": a, "b": b, "c": c, "wrong": wrong, "root": root}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# -- the engine


def test_two_adapters_and_the_base_in_one_batch_equal_merged_models(tiny_llama, adapters):
    cfg, sd = load_hf_dir(tiny_llama)
    config = EngineConfig(block_size=8, num_kv_blocks=256, scheduler=SchedulerConfig(max_num_batched_tokens=512))
    eng = LLMEngine(LlamaModel.from_hf(cfg, sd, torch.float32), config)
    eng.load_lora("a", str(adapters["a"]), base_names=(str(tiny_llama),))
    eng.load_lora("b", str(adapters["b"]), base_names=(str(tiny_llama),))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 33)]
    oracle = {None: hf_greedy(_hf(tiny_llama), prompts, MAX_NEW, cfg.eos_token_ids)}
    for name in ("a", "b"):
        merged = merge(tiny_llama, adapters[name], adapters["root"] / f"merged-{name}")
        oracle[name] = hf_greedy(_hf(merged), prompts, MAX_NEW, cfg.eos_token_ids)
    assert oracle["a"] != oracle[None] and oracle["b"] != oracle[None] and oracle["a"] != oracle["b"]

    steps = []  # which adapters each step's batch held (the real runner runs it)
    run = eng.runner.run
    eng.runner.run = lambda batch, *rest: (steps.append({s.lora for s in batch.seqs}), run(batch, *rest))[1]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    for wave in range(2):  # the second wave finds the first's blocks cached: each adapter only its own
        seqs = {(lo, i): eng.add_request(f"{wave}-{lo}-{i}", p, params, lora=lo)
                for i, p in enumerate(prompts) for lo in ("a", None, "b")}
        while eng.has_unfinished():
            eng.step()
        for (lo, i), s in seqs.items():
            assert s.output_token_ids == oracle[lo][i], (wave, lo, i)
    assert steps[0] == steps[1] == {"a", "b", None}, steps  # prefills, then decodes: three kinds of rows a step
    assert eng.stats["prefix_hits"] > 0
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


def test_adapter_for_another_base_is_refused_at_load(tiny_llama, adapters):
    cfg, sd = load_hf_dir(tiny_llama)
    eng = LLMEngine(LlamaModel.from_hf(cfg, sd, torch.float32), EngineConfig(block_size=8, num_kv_blocks=64))
    with pytest.raises(LoRAError, match=r"does not fit the base model: .*mlp\.(gate|up|down)_proj\.lora_[AB]\.weight"
                                        r"' has shape \[(96, 2|2, 96)\], the base model needs \[(128, 2|2, 128)\]"):
        eng.load_lora("wrong", str(adapters["wrong"]))
    root = adapters["root"]
    named = write_adapter(root / "named", tiny_llama, r=2, alpha=2, base_name="HuggingFaceTB/SmolLM2-360M")
    with pytest.raises(LoRAError, match="trained for 'HuggingFaceTB/SmolLM2-360M', not for this base model"):
        eng.load_lora("named", str(named), base_names=("tiny", str(tiny_llama)))
    fc1 = write_adapter(root / "fc1", tiny_llama, r=2, alpha=2, targets=("q_proj",))
    conf = json.loads((fc1 / "adapter_config.json").read_text())
    (fc1 / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["q_proj", "fc1"]}))
    with pytest.raises(LoRAError, match="targets 'fc1', which the base model does not have"):
        eng.load_lora("fc1", str(fc1))
    deep = write_adapter(root / "deep", tiny_llama, r=2, alpha=2, layers=[0, 5], targets=("q_proj",))
    with pytest.raises(LoRAError, match="but the base model has 2 layers"):
        eng.load_lora("deep", str(deep))
    dora = write_adapter(root / "dora", tiny_llama, r=2, alpha=2, targets=("q_proj",))
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        eng.load_lora("dora", str(dora))
    with pytest.raises(LoRAError, match="not a directory"):
        eng.load_lora("none", str(root / "absent"))
    assert eng.loras == {}
    with pytest.raises(ValueError, match="no LoRA adapter 'a' is loaded"):
        eng.add_request("r", [5, 6], SamplingParams(max_tokens=2), lora="a")


def test_manifest_lists_adapters_under_their_base(tmp_path, tiny_llama):
    f = tmp_path / "models.yaml"
    (tmp_path / "ad").mkdir()
    f.write_text(f"- {{name: base, path: '{tiny_llama}', adapters: [{{name: sql, path: ad}}]}}\n")
    m = load_manifest(f)
    a, base = m.adapter("sql")
    assert base.name == "base" and a.path == str((tmp_path / "ad").resolve()) and m.adapter("base") is None
    f.write_text(f"- {{name: base, path: '{tiny_llama}', adapters: [{{name: base, path: ad}}]}}\n")
    with pytest.raises(ManifestError, match="adapter name 'base' of model 'base' is already the name of model"):
        load_manifest(f)
    f.write_text(f"- {{name: base, path: '{tiny_llama}', adapters: [{{name: x, path: ad, rank: 3}}]}}\n")
    with pytest.raises(ManifestError, match="adapters.0.rank: unknown key"):
        load_manifest(f)


# -- the mesh

PROMPT = "The quick brown fox"


def test_mesh_serves_manifest_and_runtime_adapters(tiny_llama, adapters, tmp_path):
    from meshserve.shared.engine.llm import LLM

    root = adapters["root"]
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- name: base\n  path: '{tiny_llama}'\n  adapters:\n"
                        f"    - {{name: ad-a, path: '{adapters['a']}'}}\n"
                        f"    - {{name: ad-b, path: '{adapters['b']}'}}\n"
                        f"    - {{name: ad-wrong, path: '{adapters['wrong']}'}}\n")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    oracle = {"base": LLM(str(tiny_llama), "float32").generate([PROMPT], params)[0].text}
    for name in ("a", "b", "c"):
        merged = root / f"merged-{name}"
        if not merged.exists():
            merge(tiny_llama, adapters[name], merged)
        oracle[f"ad-{name}"] = LLM(str(merged), "float32").generate([PROMPT], params)[0].text
    assert len(set(oracle.values())) == 4
    # a prefill and a decode worker: each reads the adapters itself (the decode worker at the handoff)
    with Mesh(tiny_llama, tmp_path, prefill=1, decode=1, extra=["--models", str(manifest)]) as m:
        url = m.url
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ad-c", "lora_path": str(adapters["c"])},
                       timeout=30)
        assert r.status_code == 200 and r.json()["parent"] == "base", r.text
        bad = httpx.post(url + "/v1/load_lora_adapter",
                         json={"lora_name": "ad-w2", "lora_path": str(adapters["wrong"])}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora_adapter", bad.text
        assert "does not fit the model 'base'" in bad.json()["error"]["message"]
        dup = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ad-a", "lora_path": str(adapters["c"])},
                         timeout=30)
        assert dup.status_code == 400 and dup.json()["error"]["param"] == "lora_name"

        cards = {x["id"]: x for x in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        assert {k: cards[k]["parent"] for k in ("base", "ad-a", "ad-b", "ad-c", "ad-wrong")} == \
            {"base": None, "ad-a": "base", "ad-b": "base", "ad-c": "base", "ad-wrong": "base"}
        assert cards["ad-wrong"]["state"] == "failed" and "other-base" in cards["ad-wrong"]["error"]
        assert "not for this base model" in cards["ad-wrong"]["error"]
        assert cards["ad-a"]["state"] == cards["base"]["state"] != "failed"

        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        names = ["ad-a", "ad-b", "ad-c", "base"] * 2  # at once: each worker batches them together

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW,
                                             temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            texts = list(pool.map(complete, names))
        assert texts == [oracle[n] for n in names]
        with pytest.raises(openai.APIStatusError, match="LoRA adapter does not load") as e:
            complete("ad-wrong")
        assert e.value.status_code == 503

        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad-c"}, timeout=30)
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            complete("ad-c")
        assert complete("ad-a") == oracle["ad-a"]
