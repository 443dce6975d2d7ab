"""The fused decode step (kernels/cpu/fused_decode.cpp) against its oracle, the model's
per-operation forward: bit for bit (hidden states and the KV it writes) on the tiny model with int8
weights in bf16, over bf16 and int8 KV arenas, 1-12 decodes of different contexts, one and two
threads, with and without a q|k|v bias; and the engine's greedy tokens with it and without it."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import fused_decode
from meshserve.kernels.paged_attention import AttentionMetadata, quantize_kv
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir

pytestmark = pytest.mark.skipif(fused_decode.kernel() is None,
                                reason="the fused decode kernel is not available (no AVX2 or no compiler)")

BLOCK = 16


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    from tiny_model import make_tiny_llama

    biased = make_tiny_llama(tmp_path_factory.mktemp("tiny-bias"), attention_bias=True)
    out = {}
    for name, path in (("plain", tiny_llama), ("bias", biased)):
        cfg, sd = load_hf_dir(path)
        out[name] = LlamaModel.from_hf(cfg, sd, torch.bfloat16, quantization="int8")
    return out


def decode_step(cfg, n: int, kv_dtype: torch.dtype, seed: int):
    """n decodes with contexts of 1 to 70 tokens in shuffled blocks of a random arena."""
    g = torch.Generator().manual_seed(seed)
    ctx = [[1, 15, 16, 17, 40, 70][i % 6] + i for i in range(n)]
    need = [-(-c // BLOCK) for c in ctx]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(n, max(need), dtype=torch.long)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    shape = (cfg.num_hidden_layers, 2, num_blocks * BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    kv = torch.randn(shape, generator=g).bfloat16()
    if kv_dtype == torch.int8:
        kv = quantize_kv(kv)
    pos = torch.tensor([c - 1 for c in ctx])
    slots = table.gather(1, (pos // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + pos % BLOCK
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=n, decode_block_tables=table,
                             decode_context_lens=torch.tensor(ctx), block_size=BLOCK)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    return ids, pos, meta, kv


@pytest.mark.parametrize("which", ["plain", "bias"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_is_the_per_operation_step_bit_for_bit(models, which, kv_dtype, threads):
    model = models[which]
    assert model.fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (1, 3, fused_decode.MAX_ROWS):
            ids, pos, meta, kv = decode_step(model.cfg, n, kv_dtype, seed=n)
            assert model.fused.applies(n, meta, kv)
            kv_fused, kv_ref = kv.clone(), kv.clone()
            got = model(ids, pos, meta, kv_fused)
            fused, model.fused = model.fused, None
            try:
                want = model(ids, pos, meta, kv_ref)
            finally:
                model.fused = fused
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
            assert torch.equal(kv_fused, kv_ref)
            assert not torch.equal(kv_fused, kv)  # the step's K/V were written
    finally:
        torch.set_num_threads(before)


def test_fused_step_only_where_it_applies(models, tiny_llama):
    model = models["plain"]
    ids, pos, meta, kv = decode_step(model.cfg, fused_decode.MAX_ROWS + 1, torch.bfloat16, seed=0)
    assert not model.fused.applies(fused_decode.MAX_ROWS + 1, meta, kv)
    assert not model.fused.applies(fused_decode.MAX_ROWS + 1, meta, kv.float())
    cfg, sd = load_hf_dir(tiny_llama)
    assert LlamaModel.from_hf(cfg, sd, torch.bfloat16).fused is None  # bf16 weights: no int8 projections
    assert LlamaModel.from_hf(cfg, sd, torch.float32, quantization="int8").fused is None


def test_engine_greedy_tokens_same_with_and_without_fused_step(models):
    from test_engine import make_prompts

    model = models["plain"]
    prompts = make_prompts(model.cfg.vocab_size, n=8)
    params = SamplingParams(max_tokens=12, temperature=0)

    def run():
        return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=256)).generate(prompts, params)

    class Counting:  # the fused step's C++ object, counting its calls
        def __init__(self, plan):
            self.plan, self.calls = plan, 0

        def forward(self, *args):
            self.calls += 1
            return self.plan.forward(*args)

    plan = model.fused.plan
    model.fused.plan = counting = Counting(plan)
    try:
        with_fused = run()
    finally:
        model.fused.plan = plan
    assert counting.calls >= 8  # the decode-only steps ran fused
    fused, model.fused = model.fused, None
    try:
        without = run()
    finally:
        model.fused = fused
    assert with_fused == without


def test_layered_load_builds_the_fused_step_once_complete(tiny_llama, tmp_path):
    """While a layered load is being written the model runs the per-operation path (the fused step
    reads the q|k|v biases when built); once the gate is done it builds the fused step, on the biases
    as finally written."""
    import numpy as np

    from tiny_model import make_tiny_llama

    from meshserve.shared.model.layer_gate import LayerGate, num_parts
    from meshserve.shared.model.llama import fuse_hf_weights

    cfg, sd = load_hf_dir(make_tiny_llama(tmp_path / "m", attention_bias=True))
    final = fuse_hf_weights(cfg, sd, torch.bfloat16, quantization="int8")
    weights = {k: v.clone() for k, v in final.items()}
    for k in weights:
        if k.endswith("qkv_bias"):
            weights[k].zero_()  # not written yet
    ready = tmp_path / "ready"
    np.array([1], dtype=np.int64).tofile(ready)  # part 0 written
    model = LlamaModel(cfg, weights, gate=LayerGate(str(ready), num_parts(cfg.num_hidden_layers)))
    assert model.fused is None
    for k in weights:
        weights[k].copy_(final[k])
    word = np.memmap(ready, dtype=np.int64, mode="r+", shape=(1,))
    word[0] = num_parts(cfg.num_hidden_layers)
    word.flush()
    model.logits(torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16))
    assert model.gate is None and model.fused is not None
    ids, pos, meta, kv = decode_step(cfg, 3, torch.bfloat16, seed=5)
    got = model(ids, pos, meta, kv.clone())
    want = LlamaModel(cfg, final)
    want.fused = None
    assert torch.equal(got, want(ids, pos, meta, kv.clone()))
