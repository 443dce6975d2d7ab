"""Weight-only int8: the CPU kernel against its reference (F.linear on the dequantized weight), the
int8 model against Transformers run on the same dequantized weights (the oracle still holds), and
perplexity on the real default model within 2% of bf16."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from oracle import hf_greedy

from meshserve.kernels import int8_linear as il
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel, fuse_hf_weights
from meshserve.shared.model.weights import load_hf_dir

needs_kernel = pytest.mark.skipif(il.kernel() is None, reason="int8 CPU kernel not available (no AVX2 or no compiler)")


def test_quantize_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g) * torch.rand(48, 1, generator=g)
    w[3] = 0
    q, s = il.quantize(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() == 127
    err = (il.dequantize(q, s) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert (il.dequantize(q, s)[3] == 0).all()
    assert torch.equal(il.from_blocked(il.to_blocked(q)), q)


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 34), (32, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_dequantized_reference(n, k, bias, projection_path):
    g = torch.Generator().manual_seed(n + k)
    q, s = il.quantize(torch.randn(n, k, generator=g) * 0.05)
    b = (torch.randn(n, generator=g) * 0.1).bfloat16() if bias else None
    fast, ref = il.Int8Linear(s, blocked=il.to_blocked(q), bias=b), il.Int8Linear(s, q=q, bias=b)
    assert fast.blocked is not None and ref.blocked is None
    levels = il.kernel().levels_for(k)
    for m in (1, 3, 4, 6, 7, 16, 64):
        x = torch.randn(m, k, generator=g).bfloat16()
        x[0, 0] = 8.0  # one large input: the row's scale is set by it
        got = fast(x).float()
        want = F.linear(x.float(), ref.weight(), None if b is None else b.float())
        if not fast.gemm(m):  # the kernel
            # The input row's int16 rounding (half a level each) and the bf16 output's rounding, no more.
            bound = (ref.weight().abs().sum(1) * x.float().abs().amax(1, keepdim=True) / (2 * levels)
                     + want.abs() * 2 ** -8 + 1e-6)
            assert torch.equal(fast(x[-1:]), fast(x)[-1:])  # a row's result does not depend on the batch
        else:  # the GEMM on the weight rounded to bf16 (half an ulp each), the output's rounding
            assert torch.equal(got.bfloat16(), F.linear(x, ref.weight(torch.bfloat16), b))
            bound = x.float().abs() @ ref.weight().abs().T * 2 ** -8 + want.abs() * 2 ** -7 + 1e-6
        assert ((got - want).abs() <= bound).all(), (m, (got - want).abs().max())


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 34)])
def test_vnni_tiles_give_the_avx2_tiles_bits(n, k):
    """On a CPU with AVX-512 VNNI the kernel runs 16-column vpdpwssd tiles; their integer sums and
    epilogue are the AVX2 tiles', so each row comes out bit for bit the same at every row count
    (the AVX2 tiles' own row tiling: 6, and widened blocks from 13 rows)."""
    kern = il.kernel()
    if not kern.uses_vnni():
        pytest.skip("no AVX-512 VNNI on this CPU")
    g = torch.Generator().manual_seed(n - k)
    q, s = il.quantize(torch.randn(n, k, generator=g) * 0.05)
    blocked, b = il.to_blocked(q), (torch.randn(n, generator=g) * 0.1).bfloat16()
    try:
        for m in (1, 5, 6, 12, 13, 16, 17, 40):
            x = torch.randn(m, k, generator=g).bfloat16()
            x[-1, -1] = -9.0
            for bias in (None, b):
                vnni, avx2 = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
                kern.linear_int8(vnni, x, blocked, s, bias)
                kern.set_vnni(False)
                kern.linear_int8(avx2, x, blocked, s, bias)
                kern.set_vnni(True)
                assert torch.equal(vnni, avx2), (m, bias is not None)
    finally:
        kern.set_vnni(True)


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (48, 34), (32, 2), (16, 46)])
def test_kernel_dequantizes_the_blocked_weight_bit_for_bit(n, k):
    """What a many-row step hands torch's GEMM (Int8Linear.weight in bf16, from the kernel) is the
    reference's dequantize(q, scale) rounded to bf16, exactly; K/2 not a multiple of 8 reaches the
    kernel's scalar tail."""
    g = torch.Generator().manual_seed(n * k)
    q, s = il.quantize(torch.randn(n, k, generator=g) * 0.05)
    q[0, :2] = torch.tensor([-127, 127], dtype=torch.int8)
    fast = il.Int8Linear(s, blocked=il.to_blocked(q))
    assert fast.kernel is not None
    assert torch.equal(fast.weight(torch.bfloat16), il.dequantize(q, s, torch.bfloat16))
    assert torch.equal(fast.weight(), il.dequantize(q, s))  # fp32: the reference's own path


def dequantized_copy_case(form: str, why: str):
    """A 960 x 576 projection as quantize_weights keeps it on a CPU whose dequantized copy is in
    `form` (else a skip, saying `why`): the weights, q and s, the projection with its copy and one
    without (dequantizing per call), and the generator for the inputs."""
    if il.dequantized_form() != form:
        pytest.skip(why)
    g = torch.Generator().manual_seed(7)
    w = {"p": torch.randn(960, 576, generator=g) * 0.05, "norm": torch.randn(576, generator=g)}
    out = il.quantize_weights(w, ["p"], torch.bfloat16)
    q, s = il.quantize(w["p"])
    kept, per_call = il.Int8Linear.of(out, "p"), il.Int8Linear(out["p" + il.SCALE], blocked=out["p" + il.BLOCKED])
    return out, q, s, kept, per_call, g


@needs_kernel
def test_amx_cpu_keeps_the_dequantized_copy_and_runs_many_rows_on_it():
    """On a CPU with AMX, quantize_weights also keeps q * scale in bf16 (the bits the kernel's one-pass
    dequantization gives), and a step of GEMM_FACTOR_COPY times as many rows as send bf16
    projections to the GEMM runs it on that copy: what dequantizing per call gave, without the pass."""
    from meshserve.kernels import cpu_build

    out, q, s, kept, per_call, g = dequantized_copy_case("plain", "no AMX on this CPU")
    assert torch.equal(out["p" + il.DEQUANTIZED], il.dequantize(q, s, torch.bfloat16))
    first = int(cpu_build.amx_gemm_min_rows() * il.GEMM_FACTOR_COPY)
    assert kept.gemm(first) and not kept.gemm(first - 1) and not per_call.gemm(first) and not kept.gemm(1)
    for m in (1, 8, 16, 40, 64, 128):
        x = torch.randn(m, 576, generator=g).bfloat16()
        want = F.linear(x, per_call.weight(torch.bfloat16)) if kept.gemm(m) else per_call(x)
        assert torch.equal(kept(x), want), m


@needs_kernel
def test_avx512_bf16_cpu_keeps_a_blocked_dequantized_copy_for_many_rows():
    """On a CPU with AVX-512 BF16 and no AMX, quantize_weights also keeps q * scale in bf16 in the
    bf16 kernel's blocked layout, and a step of bf16_kernel_min_rows rows or more runs that kernel on
    it (what the bf16 kernel gives on the dequantized weight); fewer rows stay on the int8 tiles."""
    from meshserve.kernels import linear

    out, q, s, kept, per_call, g = dequantized_copy_case("blocked", "not an AVX-512 BF16 CPU without AMX")
    assert il.DEQUANTIZED not in out and set(out) == {"p" + il.BLOCKED, "p" + il.SCALE, "p" + il.DEQUANTIZED_BLOCKED,
                                                      "norm"}
    assert torch.equal(linear.from_blocked(out["p" + il.DEQUANTIZED_BLOCKED]), il.dequantize(q, s, torch.bfloat16))
    bf16 = linear.Linear(blocked=out["p" + il.DEQUANTIZED_BLOCKED])
    n = il.bf16_kernel_min_rows()
    for m in (1, n - 1, n, 64, 128):
        x = torch.randn(m, 576, generator=g).bfloat16()
        assert torch.equal(kept(x), bf16(x) if m >= n else per_call(x)), m


def test_the_copys_threshold_is_the_cpus_measured_one_unless_overridden(monkeypatch):
    from meshserve.kernels import cpu_build

    family = cpu_build.cpu_family()
    assert family is None or (family[0] and family[1] > 0)
    for cpu, env, want in ((("AuthenticAMD", 26), None, 12), (("AuthenticAMD", 25), None, 32), (None, None, 32),
                           (("AuthenticAMD", 26), "40", 40), (("AuthenticAMD", 26), "0", 0)):
        monkeypatch.setattr(cpu_build, "cpu_family", lambda cpu=cpu: cpu)
        if env is None:
            monkeypatch.delenv("MESHSERVE_INT8_BF16_MIN_ROWS", raising=False)
        else:
            monkeypatch.setenv("MESHSERVE_INT8_BF16_MIN_ROWS", env)
        il.bf16_kernel_min_rows.cache_clear()
        assert il.bf16_kernel_min_rows() == want, (cpu, env)
    monkeypatch.undo()
    il.bf16_kernel_min_rows.cache_clear()


def test_tied_embedding_rows_from_either_layout():
    q, s = il.quantize(torch.randn(64, 24))
    ids = torch.tensor([0, 17, 63, 17, 5])
    want = il.dequantize(q, s)[ids]
    assert torch.equal(il.Int8Linear(s, q=q).rows(ids, torch.float32), want)
    # The loader's blocked layout: read in place where the kernel runs, unblocked once where it does not.
    assert torch.equal(il.Int8Linear(s, blocked=il.to_blocked(q)).rows(ids, torch.float32), want)


def dequantized_hf(path, tied: bool):
    """Transformers on the weights the int8 model computes with: each projection (and the lm_head,
    which a tied embedding shares) replaced by its dequantized int8 form."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and (name.endswith("_proj") or name == "lm_head"):
                mod.weight.copy_(il.dequantize(*il.quantize(mod.weight)))
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    return hf


@pytest.mark.parametrize("kind", ["plain", "tied", "biased"])
def test_int8_greedy_matches_transformers_on_dequantized_weights(tiny_llama, tiny_llama_tied, tiny_llama_biased,
                                                                 kind):
    from test_engine import make_prompts

    tied = kind == "tied"
    path = {"plain": tiny_llama, "tied": tiny_llama_tied, "biased": tiny_llama_biased}[kind]
    cfg, sd = load_hf_dir(path)
    weights = fuse_hf_weights(cfg, sd, torch.float32, quantization="int8")
    assert ("embed" in weights) == (not tied)  # a tied embedding is one int8 copy, also the lm_head
    assert weights["layers.0.qkv@int8"].dtype == torch.int8
    model = LlamaModel(cfg, weights)
    prompts = make_prompts(cfg.vocab_size, n=8)
    ref = hf_greedy(dequantized_hf(path, tied), prompts, 16, cfg.eos_token_ids)
    eng = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=256,
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=7)))
    assert eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0)) == ref

    # bf16: the CPU kernel on the blocked layout, rounding as bf16 does; the first tokens mostly agree.
    bf = LlamaModel.from_hf(cfg, sd, torch.bfloat16, quantization="int8")
    if il.kernel() is not None:
        assert bf.proj[0]["qkv"].blocked is not None and bf.head.blocked is not None
    if kind == "biased":  # the fused step takes q|k|v biases only: these run per operation
        assert bf.fused is None and bf.proj[0]["down"].bias is not None
    got = LLMEngine(bf, EngineConfig(block_size=8, num_kv_blocks=256)).generate(
        prompts, SamplingParams(max_tokens=4, temperature=0))
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= len(ref) * 0.75


def test_unknown_quantization_is_refused(tiny_llama):
    cfg, sd = load_hf_dir(tiny_llama)
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        fuse_hf_weights(cfg, sd, torch.bfloat16, quantization="int4")


def test_default_model_int8_perplexity_within_2_percent_of_bf16(default_bf16):
    from meshserve.bench.quant_bench import perplexity, weight_bytes_per_token

    cfg, sd, ids, bf16 = default_bf16["cfg"], default_bf16["sd"], default_bf16["ids"], default_bf16["model"]
    assert len(ids) > 300
    int8 = LlamaModel.from_hf(cfg, sd, torch.bfloat16, quantization="int8")
    p16, p8 = default_bf16["perplexity"], perplexity(int8, ids)
    assert p16 < 40  # the model reads this text as text
    assert abs(p8 / p16 - 1) < 0.02, (p16, p8)
    assert weight_bytes_per_token(int8) < 0.52 * weight_bytes_per_token(bf16)


def test_meshserve_up_quantization_int8_serves(tiny_llama, tmp_path):
    """`meshserve up --quantization int8`: the loader writes the int8 layout into shared memory, the
    workers run it, and the text equals the in-process int8 engine's; the same loader also serves
    the model's bf16 variant to whoever asks for it (one source, both formats). With an int8 KV
    cache too (`--kv-cache-dtype int8`, the issue's pairing): the prefill worker hands its int8
    blocks, scales inside, to the decode worker by block ids."""
    import asyncio

    import nats
    from mesh_util import Mesh
    from openai import OpenAI

    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.schemas import LoadRequest, WeightsDescriptor

    prompt = "The quick brown fox"
    want = LLM(str(tiny_llama), "bfloat16", quantization="int8", kv_cache_dtype="int8").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0))[0].text
    with Mesh(tiny_llama, tmp_path, prefill=1, decode=1,
              extra=["--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "int8"]) as m:
        r = OpenAI(base_url=m.url + "/v1", api_key="unused").completions.create(
            model=m.model, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        assert m.ask("kv.node0.arena")["dtype"] == "int8"
        assert m.ask("models.node0.list") == [{"model": m.model, "dtype": "bfloat16", "quantization": "int8",
                                               "ready": True}]

        async def load(quantization):
            nc = await nats.connect(m.nats_url)
            try:
                req = LoadRequest(model=m.model, dtype="bfloat16", quantization=quantization).encode()
                return WeightsDescriptor.decode((await nc.request(f"{m.namespace}.models.node0.load", req,
                                                                  timeout=60)).data)
            finally:
                await nc.close()

        int8, bf16 = asyncio.run(load("int8")), asyncio.run(load(None))
        assert int8.quantization == "int8" and bf16.quantization is None and int8.path != bf16.path
        dtypes = {t.name: t.dtype for t in int8.tensors}
        assert dtypes["layers.0.qkv@scale"] == "float32" and "layers.0.qkv" not in dtypes
        assert dtypes.get("layers.0.qkv" + (il.BLOCKED if il.kernel() else il.INT8)) == "int8"
        assert {t.name: t.dtype for t in bf16.tensors}["norm"] == "bfloat16"


def test_loader_keeps_int8_weights_apart_from_bf16(tiny_llama, tmp_path, monkeypatch):
    """The loader's disk tier (prepared GGUF weights) keeps the int8 variant as its own entry and
    reloads the same bytes."""
    import hashlib
    import types

    from tiny_model import write_tiny_gguf

    from meshserve.services.model_loader import prepared
    from meshserve.services.model_loader.main import ModelLoader
    from meshserve.shared.subjects import Subjects

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path / "shm"))
    gguf = write_tiny_gguf(tiny_llama, tmp_path / "t.gguf")
    loader = ModelLoader(types.SimpleNamespace(subjects=Subjects("t")), "n0", max_models=4)
    bf16, int8 = loader.load_now(str(gguf), "bfloat16"), loader.load_now(str(gguf), "bfloat16", "int8")
    assert int8.quantization == "int8" and int8.path != bf16.path
    assert prepared.entry(gguf, "bfloat16-int8", "cpu") != prepared.entry(gguf, "bfloat16", "cpu")
    digest = hashlib.sha256(open(int8.path, "rb").read()).hexdigest()
    # The untied embedding stays bf16; an AMX CPU keeps q * scale in bf16 too, as bf16 keeps its plain
    # copy (0.75x of bf16's two), another CPU with AVX-512 BF16 in the bf16 kernel's layout (1.5x bf16's one).
    form = il.dequantized_form()
    assert os.path.getsize(int8.path) < {None: 0.7, "plain": 0.85, "blocked": 1.55}[form] * os.path.getsize(bf16.path)
    assert any(t.name.endswith(il.DEQUANTIZED) for t in int8.tensors) == (form == "plain")
    assert any(t.name.endswith(il.DEQUANTIZED_BLOCKED) for t in int8.tensors) == (form == "blocked")
    assert {t.dtype for t in int8.tensors} == {"int8", "float32", "bfloat16"}
    os.unlink(int8.path)
    again = loader.load_now(str(gguf), "bfloat16", "int8")  # from the kept copy
    assert hashlib.sha256(open(again.path, "rb").read()).hexdigest() == digest and again.tensors == int8.tensors
