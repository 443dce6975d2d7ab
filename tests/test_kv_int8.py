"""The int8 KV cache (--kv-cache-dtype int8): the format, the CPU decode kernel against the torch
reference on int8 arenas, greedy tokens against Transformers with K/V rounded the same way (the
oracle, on the same quantize/dequantize), block bytes that carry their scales, and perplexity on
the default model within 2% of bf16 KV. The mesh (swap preemption resuming exactly) is in
test_preemption.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import hf_greedy
from test_cpu_kernels import kernel, make_case, reference, run_kernel  # noqa: F401 - kernel is a fixture

from meshserve.kernels.paged_attention import dequantize_kv, quantize_kv
from meshserve.services.kv_pool.blocks import ArenaBlocks
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.kv_layout import check_kv_cache_dtype, kv_arena_shape, kv_bytes_per_block
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir


def test_rows_hold_values_and_their_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.rand(5, 3, 1, generator=g)
    x[2, 1] = 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    s = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 127) and rows[..., :64].abs().max() == 127
    err = (dequantize_kv(rows, torch.float32) - x).abs()
    assert (err <= s / 2 * (1 + 1e-6)).all() and not dequantize_kv(rows, torch.float32)[2, 1].any()

    class Cfg:
        num_hidden_layers, num_key_value_heads, head_dim = 30, 3, 64

    assert kv_arena_shape(Cfg, 4, 16, torch.int8) == [30, 2, 64, 3, 68]
    assert kv_bytes_per_block(Cfg, 16, "int8") / kv_bytes_per_block(Cfg, 16, "bfloat16") == 68 / 128
    check_kv_cache_dtype("int8")  # the CUDA kernels read int8 rows too (tests/test_cuda_kernels.py)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        check_kv_cache_dtype("fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,group,bs", [(64, 3, 16), (64, 1, 16), (16, 4, 16), (128, 2, 16), (40, 2, 16),
                                        (64, 3, 8), (64, 3, 24), (32, 2, 48)])  # 40: the plain loops
def test_kernel_reads_int8_as_the_reference_does(kernel, dtype, d, group, bs):  # noqa: F811
    """Block sizes other than the kernel's 16 key rows per reduction: 8 (part of one), 24 and 48
    (a block in two or three, the last part short)."""
    lens = [1, 15, 16, 17, 1000, 33]
    q, kvf, table, ctx = make_case(lens, 2 if group != 3 else 3, group, d, bs, torch.float32, seed=d + group + bs)
    kv, q = quantize_kv(kvf), q.to(dtype)
    want = reference(q, kv, table, ctx, bs, d ** -0.5)
    got = run_kernel(kernel, q, kv, table, ctx, bs, d ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 40])  # 40: 16 at a time, then the plain loop's 8
def test_kernel_dequantizes_slots_as_the_reference_does(kernel, dtype, d):  # noqa: F811
    """What prefill chunks attend over: the gathered rows, dequantized, bit for bit."""
    g = torch.Generator().manual_seed(d)
    kv = quantize_kv(torch.randn(2, 300, 3, d, generator=g) * torch.rand(2, 300, 3, 1, generator=g))
    for n in (5, 290):  # one thread, then several
        slots = torch.randint(0, 300, (n,), generator=g)
        out = torch.empty(2, n, 3, d, dtype=dtype)
        kernel.dequantize_slots(out, kv, slots)
        assert torch.equal(out, dequantize_kv(kv.index_select(1, slots), dtype))
    with pytest.raises(RuntimeError, match="outside the arena"):
        kernel.dequantize_slots(torch.empty(2, 1, 3, d, dtype=dtype), kv, torch.tensor([300]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_writes_the_reference_rows(kernel, dtype):  # noqa: F811
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(9, 5 * 64, generator=g) * 3).to(dtype)  # k and v are strided views, as in the model
    qkv[4, 3 * 64:4 * 64] = 0  # an all-zero key row
    k, v = qkv[:, 64:3 * 64].view(9, 2, 64), qkv[:, 3 * 64:].view(9, 2, 64)
    slots = torch.tensor([7, 0, 3, 12, 5, 6, 11, 2, 9])
    got, want = torch.zeros(2, 16, 2, 68, dtype=torch.int8), torch.zeros(2, 16, 2, 68, dtype=torch.int8)
    kernel.write_kv_int8(got, k, v, slots)
    want[0].index_copy_(0, slots, quantize_kv(k))
    want[1].index_copy_(0, slots, quantize_kv(v))
    assert torch.equal(got, want)


def int8_kv_cache():
    """Transformers' cache with each new key and value row rounded as our int8 arena stores it."""
    from transformers import DynamicCache

    class Int8KV(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            return super().update(dequantize_kv(quantize_kv(k), k.dtype), dequantize_kv(quantize_kv(v), v.dtype),
                                  layer_idx, *args, **kwargs)

    return Int8KV()


@pytest.fixture(scope="module")
def tiny_int8(tiny_llama):
    """The tiny model, its prompts and the oracle's tokens (K/V rounded as the int8 arena stores them)."""
    from test_engine import make_prompts
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size, n=10)
    ref = hf_greedy(hf, prompts, 12, cfg.eos_token_ids, cache=int8_kv_cache)
    assert ref != hf_greedy(hf, prompts[:3], 12, cfg.eos_token_ids) + ref[3:]  # the rounding shows
    return LlamaModel.from_hf(cfg, sd, torch.float32), prompts, ref


@pytest.mark.parametrize("kernels,chunk,blocks", [("on", 512, 4096), ("on", 7, 4096), ("on", 64, 14),
                                                   ("off", 64, 14)])
def test_greedy_equals_transformers_on_the_same_rounding(tiny_int8, monkeypatch, kernels, chunk, blocks):
    """Whole or chunked prompts, prefix-cache hits, a pool small enough to preempt by swap (the host
    copies carry the scales), the CPU kernel or the torch reference: Transformers' tokens with K/V
    rounded per token and head."""
    model, prompts, ref = tiny_int8
    if kernels == "off":
        monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    eng = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=blocks, kv_cache_dtype="int8",
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=chunk,
                                                                  preemption_mode="swap")))
    assert eng.kv_cache.dtype == torch.int8 and eng.kv_cache.shape[-1] == model.cfg.head_dim + 4
    assert eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0)) == ref
    if blocks < 100:
        assert eng.stats["preemptions_by_mode"].get("swap", 0) > 0


def test_blocks_move_with_their_scales(tiny_llama):
    """What the kv-pool copies (swap tier, cross-node chunks) is a block's bytes, scales included:
    a block copied through bytes into another arena (numpy, as the kv-pool holds it) reads back the same."""
    cfg, sd = load_hf_dir(tiny_llama)
    eng = LLMEngine(LlamaModel.from_hf(cfg, sd, torch.float32),
                    EngineConfig(block_size=8, num_kv_blocks=16, kv_cache_dtype="int8"))
    eng.generate([list(range(3, 40))], SamplingParams(max_tokens=2, temperature=0))
    src = ArenaBlocks(eng.kv_cache, 8)
    assert src.dtype == "int8" and src.block_bytes == kv_bytes_per_block(cfg, 8, "int8")
    data = src.read_range([0, 1, 2], 0, 3 * src.block_bytes)
    buf = np.zeros(eng.kv_cache.numel(), dtype=np.uint8)
    dst = ArenaBlocks.of_bytes(buf, "int8", list(eng.kv_cache.shape), 8)
    for off in range(0, len(data), 1000):  # chunk edges anywhere, as transfers split them
        dst.write_range([5, 4, 3], off, data[off:off + 1000])
    got = torch.from_numpy(buf).view(torch.int8).view(eng.kv_cache.shape)
    for s, d in ((0, 5), (1, 4), (2, 3)):
        a, b = eng.kv_cache[:, :, s * 8:(s + 1) * 8], got[:, :, d * 8:(d + 1) * 8]
        assert a.any() and torch.equal(dequantize_kv(a, torch.float32), dequantize_kv(b, torch.float32))


def test_an_arena_of_another_dtype_is_refused(tiny_llama):
    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    arena = torch.zeros(kv_arena_shape(cfg, 4, 16, torch.float32))
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        LLMEngine(model, EngineConfig(kv_cache_dtype="int8"), kv_cache=arena)


def test_default_model_int8_kv_perplexity_within_2_percent_of_bf16(default_bf16):
    from meshserve.bench.quant_bench import perplexity

    p16 = default_bf16["perplexity"]  # bf16 weights, bf16 KV
    p8 = perplexity(default_bf16["model"], default_bf16["ids"], kv_cache_dtype="int8")
    assert p16 < 40 and p8 != p16
    assert abs(p8 / p16 - 1) < 0.02, (p16, p8)


def test_manifest_chooses_the_kv_cache_per_model(tiny_llama, tmp_path):
    """Two models of one KV shape, one with `kv_cache_dtype: int8`: each runs on its own arena (the
    node makes an int8 one beside the fp32 one), and each one's greedy text through the mesh is the
    in-process engine's with that KV cache."""
    from mesh_util import Mesh
    from openai import OpenAI
    from tiny_model import make_tiny_llama

    from meshserve.shared.engine.llm import LLM

    other = make_tiny_llama(tmp_path / "other", seed=8)
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- {{name: plain, path: '{tiny_llama}'}}\n"
                        f"- {{name: small-kv, path: '{other}', kv_cache_dtype: int8}}\n")
    prompts = [[5 + (i * 7 + j * 13) % 370 for j in range(40)] for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = {"plain": [c.text for c in LLM(str(tiny_llama), "float32").generate(prompts, params)],
            "small-kv": [c.text for c in LLM(str(other), "float32", EngineConfig(kv_cache_dtype="int8"))
                         .generate(prompts, params)]}
    fp32 = [c.text for c in LLM(str(other), "float32").generate(prompts, params)]
    assert fp32 != want["small-kv"]  # the rounding shows in these outputs, so the test can tell
    with Mesh(tiny_llama, tmp_path, prefill=0, decode=1, extra=["--models", str(manifest)],
              env={"MESHSERVE_CACHE": str(tmp_path / "cache")}) as m:
        client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for name in ("plain", "small-kv", "plain"):
            got = [client.completions.create(model=name, prompt=p, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
            assert got == want[name], name
        arenas = m.ask("kv.node0.status")["arenas"]
        assert sorted(k.rsplit("-", 1)[1] for k in arenas) == ["float32", "int8"], list(arenas)
