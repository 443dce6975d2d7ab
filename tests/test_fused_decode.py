"""The fused decode step (kernels/cpu/fused_decode.cpp) against its oracle, the model's
per-operation forward: bit for bit (hidden states and the KV it writes) on the tiny model in bf16
with int8 weights (on their tiles, and on their bf16 copy where the CPU keeps one) and with bf16
weights (where the CPU has AVX-512 BF16), over bf16 and int8 KV arenas, 1-64 decodes of different
contexts, one and two threads, with and without a q|k|v bias, and with proposals verified as
several rows of one sequence; and the engine's greedy tokens with it and without it, and with
prompt lookup and without it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshserve.kernels import fused_decode, int8_linear
from meshserve.kernels.paged_attention import AttentionMetadata, quantize_kv
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir

pytestmark = pytest.mark.skipif(fused_decode.kernel() is None,
                                reason="the fused decode kernel is not available (no AVX2 or no compiler)")
BF16_FUSED = fused_decode.kernel() is not None and fused_decode.kernel().bf16_weights()
bf16_only = pytest.mark.skipif(not BF16_FUSED, reason="bf16 weights run fused only with AVX-512 BF16")
WHICH = ["plain", "bias", "qwen3", pytest.param("bf16", marks=bf16_only), pytest.param("bf16-bias", marks=bf16_only),
         pytest.param("bf16-qwen3", marks=bf16_only)]

copy_only = pytest.mark.skipif(not fused_decode.kernel() or int8_linear.dequantized_form() != "blocked",
                               reason="int8 weights keep a blocked bf16 copy only on AVX-512 BF16 without AMX")

BLOCK = 16


def qkv_biases_only(cfg, sd):
    """Qwen2's form of attention_bias, which the fused step takes: q|k|v biased, o not (a Llama's
    biases o too, and its steps then run per operation)."""
    return cfg, {k: v for k, v in sd.items() if not k.endswith("o_proj.bias")}


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    from tiny_model import make_tiny_llama

    from test_engine import _transformers_model

    biased = make_tiny_llama(tmp_path_factory.mktemp("tiny-bias"), attention_bias=True)
    qwen3 = tmp_path_factory.mktemp("tiny-qwen3")  # q and k head norms before RoPE
    _transformers_model(qwen3, "Qwen3")
    out = {}
    for name, path in (("plain", tiny_llama), ("bias", biased), ("qwen3", qwen3)):
        cfg, sd = qkv_biases_only(*load_hf_dir(path))
        out[name] = LlamaModel.from_hf(cfg, sd, torch.bfloat16, quantization="int8")
        out["bf16" if name == "plain" else f"bf16-{name}"] = LlamaModel.from_hf(cfg, sd, torch.bfloat16)
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


def fused_and_per_operation(model, ids, pos, meta, kv):
    """The step fused and through the per-operation forward, each on its own copy of the arena:
    (fused hidden states, per-operation ones, fused arena, per-operation arena)."""
    kv_fused, kv_ref = kv.clone(), kv.clone()
    got = model(ids, pos, meta, kv_fused)
    fused, model.fused = model.fused, None
    try:
        want = model(ids, pos, meta, kv_ref)
    finally:
        model.fused = fused
    return got, want, kv_fused, kv_ref


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_is_the_per_operation_step_bit_for_bit(models, which, kv_dtype, threads):
    model = models[which]
    assert model.fused is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in sorted({1, 3} | {most for most, _ in model.fused.plans} | {most + 1 for most, _ in model.fused.plans[:-1]}):
            ids, pos, meta, kv = decode_step(model.cfg, n, kv_dtype, seed=n)
            assert model.fused.applies(n, meta, kv)
            got, want, kv_fused, kv_ref = fused_and_per_operation(model, ids, pos, meta, kv)
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
            assert torch.equal(kv_fused, kv_ref)
            assert not torch.equal(kv_fused, kv)  # the step's K/V were written
    finally:
        torch.set_num_threads(before)


def verify_step(cfg, kv_dtype: torch.dtype, seed: int):
    """Sequences verifying proposals as consecutive decode rows (4 and 3 rows) beside plain decodes:
    a sequence's rows share its block table, row j at position c + j seeing c + j + 1 tokens."""
    g = torch.Generator().manual_seed(seed)
    # (context before the step, rows). Two threads split the (row, KV head) tasks in half: the second
    # sequence's last row has one head on each, the other needing rows the first thread writes.
    seqs = [(33, 1), (20, 4), (47, 3), (5, 1)]
    need = [-(-(c + r) // BLOCK) for c, r in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for nb in need:
        tables.append(perm[used:used + nb] + [0] * (max(need) - nb))
        used += nb
    rows = [(tables[i], c + j) for i, (c, r) in enumerate(seqs) for j in range(r)]
    pos = torch.tensor([p for _, p in rows])
    table = torch.tensor([t for t, _ in rows])
    slots = table.gather(1, (pos // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + pos % BLOCK
    shape = (cfg.num_hidden_layers, 2, num_blocks * BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    kv = torch.randn(shape, generator=g).bfloat16()
    if kv_dtype == torch.int8:
        kv = quantize_kv(kv)
    n = len(rows)
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=n, decode_block_tables=table,
                             decode_context_lens=pos + 1, block_size=BLOCK, verify_rows=True)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g), pos, meta, kv


@pytest.mark.parametrize("which", ["plain", pytest.param("bf16", marks=bf16_only)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_verification_rows_are_the_per_operation_step_bit_for_bit(models, which, kv_dtype, threads):
    """A row reads the K/V the sequence's earlier rows write in the same step: fused, every write
    comes before any attention (a barrier), as in the per-operation path."""
    model = models[which]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(3):
            ids, pos, meta, kv = verify_step(model.cfg, kv_dtype, seed)
            assert model.fused.applies(len(ids), meta, kv)
            got, want, kv_fused, kv_ref = fused_and_per_operation(model, ids, pos, meta, kv)
            assert torch.equal(got, want), (seed, (got.float() - want.float()).abs().max())
            assert torch.equal(kv_fused, kv_ref)
    finally:
        torch.set_num_threads(before)


def test_fused_step_only_where_it_applies(models, tiny_llama):
    model = models["plain"]
    ids, pos, meta, kv = decode_step(model.cfg, fused_decode.MAX_ROWS + 1, torch.bfloat16, seed=0)
    assert not model.fused.applies(fused_decode.MAX_ROWS + 1, meta, kv)
    assert not model.fused.applies(fused_decode.MAX_ROWS + 1, meta, kv.float())
    cfg, sd = load_hf_dir(tiny_llama)
    assert (LlamaModel.from_hf(cfg, sd, torch.bfloat16).fused is not None) == BF16_FUSED
    assert LlamaModel.from_hf(cfg, sd, torch.float32, quantization="int8").fused is None
    assert LlamaModel.from_hf(cfg, sd, torch.float32).fused is None


@pytest.mark.parametrize("which", ["plain", pytest.param("bf16", marks=bf16_only)])
@pytest.mark.parametrize("gemm_from", [4, 0], ids=["gemm-from-4", "no-gemm"])
def test_fused_step_takes_the_rows_the_per_operation_path_runs_on_the_tiles(models, which, gemm_from, monkeypatch):
    """The per-operation path hands a projection's many-row steps to torch's GEMM (AMX) or to int8's
    bf16 copy, whose bits are not the tiles': the fused step takes every row count up to the first
    where some projection leaves its tiles (at most MAX_ROWS), and is bit for bit that path there."""
    from meshserve.kernels import cpu_build, linear

    monkeypatch.setattr(cpu_build, "amx_gemm_min_rows", lambda: gemm_from)
    model = models[which]
    fused = model._fused_decode()
    projs = [p for layer in model.proj for p in layer.values()]
    assert 1 <= fused.max_rows <= fused_decode.MAX_ROWS
    assert all(p.tiles(fused.max_rows) is not None for p in projs)
    assert fused.max_rows == fused_decode.MAX_ROWS or not all(p.tiles(fused.max_rows + 1) for p in projs)
    plain_kept = all(p.weight is not None if isinstance(p, linear.Linear) else p.dequantized is not None for p in projs)
    if gemm_from and plain_kept:  # loaded for AMX: the GEMM takes 4 rows, int8's kept copy 1.5 x 4
        assert fused.max_rows == {"bf16": 3, "plain": 5}[which]
    ids, pos, meta, kv = decode_step(model.cfg, fused.max_rows + 1, torch.bfloat16, seed=0)
    assert not fused.applies(fused.max_rows + 1, meta, kv)
    ids, pos, meta, kv = decode_step(model.cfg, fused.max_rows, torch.bfloat16, seed=1)
    before, model.fused = model.fused, fused
    try:
        assert fused.applies(fused.max_rows, meta, kv)
        got, want, kv_fused, kv_ref = fused_and_per_operation(model, ids, pos, meta, kv)
    finally:
        model.fused = before
    assert torch.equal(got, want) and torch.equal(kv_fused, kv_ref)


@contextlib.contextmanager
def copy_from(model, rows: int, monkeypatch):
    """int8 weights run their bf16 copy from `rows` rows, and the model's fused step is rebuilt so."""
    monkeypatch.setenv("MESHSERVE_INT8_BF16_MIN_ROWS", str(rows))
    int8_linear.bf16_kernel_min_rows.cache_clear()
    before = model.fused
    try:
        model.fused = model._fused_decode()
        yield
    finally:
        model.fused = before
        monkeypatch.undo()
        int8_linear.bf16_kernel_min_rows.cache_clear()


@copy_only
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-kv", "int8-kv"])
def test_int8_steps_of_many_rows_run_fused_on_the_bf16_copy(models, kv_dtype, monkeypatch):
    """From the copy's threshold the per-operation path runs int8 projections on their bf16 copy:
    the fused step has a second plan on the copy there, bit for bit that path."""
    model = models["plain"]
    with copy_from(model, 5, monkeypatch):
        assert [most for most, _ in model.fused.plans] == [4, fused_decode.MAX_ROWS]
        for n in (4, 5, 9):
            ids, pos, meta, kv = decode_step(model.cfg, n, kv_dtype, seed=n)
            assert model.fused.applies(n, meta, kv)
            got, want, kv_fused, kv_ref = fused_and_per_operation(model, ids, pos, meta, kv)
            assert torch.equal(got, want), (n, (got.float() - want.float()).abs().max())
            assert torch.equal(kv_fused, kv_ref)


class Counting:
    """A fused plan (the C++ object), counting its calls and those that verified proposals."""

    def __init__(self, plan):
        self.plan, self.calls, self.verified = plan, 0, 0

    def forward(self, *args):
        self.calls += 1
        self.verified += bool(args[-1])
        return self.plan.forward(*args)


@pytest.mark.parametrize("which", ["plain", pytest.param("bf16", marks=bf16_only)])
def test_engine_greedy_tokens_same_with_and_without_fused_step(models, which):
    from test_engine import make_prompts

    model = models[which]
    prompts = make_prompts(model.cfg.vocab_size, n=8)
    params = SamplingParams(max_tokens=12, temperature=0)

    def run():
        return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=256)).generate(prompts, params)

    plans = model.fused.plans
    model.fused.plans = [(most, Counting(plan)) for most, plan in plans]
    try:
        with_fused = run()
    finally:
        counted, model.fused.plans = model.fused.plans, plans
    assert sum(c.calls for _, c in counted) >= 8  # the decode-only steps ran fused
    fused, model.fused = model.fused, None
    try:
        without = run()
    finally:
        model.fused = fused
    assert with_fused == without


def speculate_against_plain(model, lengths=(6, 11, 17, 40), max_tokens=24):
    """Four streams whose prompts repeat themselves (`lengths`, three times), greedy, without and with
    prompt lookup (always proposing): (plain tokens, speculated tokens, the rows of each decode-only
    step that verified, the fused plans' counters)."""
    from test_speculative import spec_engine

    from meshserve.shared.engine.speculative import SpeculativeConfig

    g = torch.Generator().manual_seed(1)
    base = [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts = [b * 3 for b in base]  # prompts that repeat themselves: lookups match
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    plain = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=256)).generate(prompts, params)

    plans = model.fused.plans
    model.fused.plans = counted = [(most, Counting(plan)) for most, plan in plans]
    try:
        eng = spec_engine(model, SpeculativeConfig("ngram", num_speculative_tokens=4, disable_by_batch_size=64))
        eng.speculator.payoff.proposes = lambda: True  # this test is about the tokens, not the speed
        propose, steps = eng.speculator.propose, []

        def recording(running, live, max_rows=None):
            out = propose(running, live, max_rows)
            if out and all(s.num_tokens - s.num_computed_tokens == 1 for s in running):  # decodes only
                steps.append(len(running) + sum(len(s.draft.tokens) for s in out))
            return out

        eng.speculator.propose = recording
        spec = eng.generate(prompts, params)
    finally:
        model.fused.plans = plans
    st = eng.stats["spec_decode"]
    assert st["num_verification_steps"] > 0 and st["num_accepted_tokens"] > 0
    return plain, spec, steps, counted


@pytest.mark.parametrize("which", ["plain", pytest.param("bf16", marks=bf16_only)])
def test_prompt_lookup_verifies_in_fused_steps_and_gives_the_tokens_of_plain_decoding(models, which,
                                                                                       kernel_projections):
    """Verification runs as decode rows, so with int8 weights (integer sums) or bf16 ones on the
    kernel's tiles (each row's sums in its own registers, in the same order) a row's result does
    not depend on the rows beside it and speculation changes no token; proposals are cut so that
    every verification step of four streams fits the fused step's rows, and runs fused."""
    model = models[which]
    plain, spec, steps, counted = speculate_against_plain(model)
    assert spec == plain
    assert steps and max(steps) <= model.fused.max_rows
    assert sum(c.verified for _, c in counted) == len(steps)  # every decode-only step that verified ran fused


@copy_only
def test_proposals_keep_a_step_on_the_tiles_its_plain_decode_runs(models, monkeypatch):
    """int8 weights' bf16 copy (from 9 rows here) computes other bits than the int8 tiles: four
    streams decode on the tiles (4 rows), so their proposals are cut to the tiles' 8 rows, never
    into the copy's plan, and speculation changes no token (prompts of 3 tokens: their prefill,
    12 rows, runs the copy in both runs alike)."""
    model = models["plain"]
    with copy_from(model, 9, monkeypatch):
        assert [most for most, _ in model.fused.plans] == [8, fused_decode.MAX_ROWS]
        assert [model.fused_decode_rows(n) for n in (1, 4, 8, 9, 64, 65)] == [8, 8, 8, 64, 64, 0]
        plain, spec, steps, counted = speculate_against_plain(model, lengths=(1, 1, 1, 1), max_tokens=40)
    assert steps and max(steps) <= 8
    assert counted[0][1].verified == len(steps) and counted[1][1].calls == 0
    assert spec == plain


def test_layered_load_builds_the_fused_step_once_complete(tiny_llama, tmp_path):
    """While a layered load is being written the model runs the per-operation path (the fused step
    reads the q|k|v biases when built); once the gate is done it builds the fused step, on the biases
    as finally written."""
    import numpy as np

    from tiny_model import make_tiny_llama

    from meshserve.shared.model.layer_gate import LayerGate, num_parts
    from meshserve.shared.model.llama import fuse_hf_weights

    cfg, sd = qkv_biases_only(*load_hf_dir(make_tiny_llama(tmp_path / "m", attention_bias=True)))
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


def test_fused_decode_bench_times_both_paths(tiny_llama, tmp_path):
    """bench/fused_decode_bench.py times the layers fused and per operation by row count; a count the
    fused step does not take (more than MAX_ROWS) has no fused time."""
    import json

    from meshserve.bench.fused_decode_bench import main

    out = tmp_path / "fused.json"
    rows = f"1,{fused_decode.MAX_ROWS + 1}"
    assert main(["--model", str(tiny_llama), "--quantization", "int8", "--rows", rows, "--context", "40",
                 "--reps", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["fused_max_rows"] >= 1
    one, many = res["results"]
    assert one["rows"] == 1 and one["fused_ms"] > 0 and one["per_operation_ms"] > 0
    assert many["fused_ms"] is None and many["per_operation_ms"] > 0
