"""The compiled CPU attention kernels (kernels/cpu/paged_attention.cpp: decode, and prefill chunks
from prefill_attention.h) against their oracle, the gather + SDPA reference path of
paged_attention(), on random arenas with shuffled block tables and slots."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import cpu_build
from meshserve.kernels.paged_attention import (AttentionMetadata, PrefillChunk, paged_attention,
                                               prefill_kernel, prefill_reference, quantize_kv,
                                               use_decode_kernel)

CONTEXT_LENS = [1, 15, 16, 17, 1000]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def kernel():
    if cpu_build.disabled():
        pytest.skip("MESHSERVE_DISABLE_CPU_KERNELS is set: the CPU kernels are not built")
    mod = cpu_build.load("meshserve_paged_attention_cpu", "paged_attention.cpp")
    if mod is None:
        pytest.skip("the CPU paged-attention kernel cannot be built here (no C++ compiler or ninja?); "
                    "see the warning logged by meshserve.kernels.cpu_build")
    return mod


def make_case(ctx_lens: list[int], hkv: int, group: int, d: int, block_size: int, dtype: torch.dtype,
              seed: int = 0):
    """A random arena and, per sequence, a shuffled set of distinct blocks, padded with random ids."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 7  # some blocks belong to nobody
    kv = torch.randn(2, num_blocks * block_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need) + 2
    table = torch.randint(0, num_blocks, (len(ctx_lens), max_blocks), generator=g)
    used = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(len(ctx_lens), hkv * group, d, generator=g).to(dtype)
    return q, kv, table, torch.tensor(ctx_lens, dtype=torch.long)


def reference(q, kv, table, ctx, block_size, scale, prefills=(), k=None, v=None):
    """paged_attention()'s gather + SDPA path (slot ids and mask built here, no block tables), and
    prefill_reference for the prompt chunks after the decodes."""
    nd, t = len(ctx), int(ctx.max())
    pos = torch.arange(t)
    slots = table[:, pos // block_size] * block_size + pos % block_size
    mask = (pos.unsqueeze(0) < ctx.unsqueeze(1)).view(nd, 1, 1, t)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=nd,
                             decode_slots=slots, decode_mask=mask)
    rows = [paged_attention(q[:nd], k, v, kv, meta, scale)]
    for p in prefills:
        r = slice(p.start, p.start + p.length)
        rows.append(prefill_reference(q[r], k[r], v[r], kv, p, torch.empty(0, dtype=torch.long), scale))
    return torch.cat(rows)


def run_kernel(kernel, q, kv, table, ctx, block_size, scale):
    out = torch.empty_like(q)
    kernel.paged_decode_attention(out, q, kv, table, ctx, block_size, scale)
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 24])  # 24: 16 key rows per reduction, then 8
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_kernel_matches_reference(kernel, dtype, group, block_size, batch):
    hkv, d = (3, 64) if group == 3 else (2, 64)
    scale = d ** -0.5
    if batch == 1:
        cases = [[c] for c in CONTEXT_LENS]
    else:  # every length appears, in a shuffled order
        order = torch.randperm(batch, generator=torch.Generator().manual_seed(batch)).tolist()
        cases = [[CONTEXT_LENS[i % len(CONTEXT_LENS)] for i in order]]
    for seed, lens in enumerate(cases):
        q, kv, table, ctx = make_case(lens, hkv, group, d, block_size, dtype, seed)
        want = reference(q, kv, table, ctx, block_size, scale)
        got = run_kernel(kernel, q, kv, table, ctx, block_size, scale)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0,
                                   msg=lambda m: f"context lengths {lens}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [16, 32, 40, 128])  # 40 takes the plain-loop path
def test_head_dims(kernel, dtype, d):
    lens = [17, 1, 300, 16]
    q, kv, table, ctx = make_case(lens, 2, 4, d, 16, dtype, seed=d)
    scale = d ** -0.5
    torch.testing.assert_close(run_kernel(kernel, q, kv, table, ctx, 16, scale).float(),
                               reference(q, kv, table, ctx, 16, scale).float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_dispatch(kernel, dtype):
    """Through paged_attention(): strided q (a view of the fused qkv rows), decodes then a prefill
    chunk, metadata with block tables only. Matches the reference path."""
    hkv, group, d, bs = 3, 3, 64, 16
    lens = [5, 1000, 33]
    _, kv, table, ctx = make_case(lens + [40], hkv, group, d, bs, dtype, seed=7)
    table, ctx = table[:3], ctx[:3]
    g = torch.Generator().manual_seed(1)
    n = len(lens) + 4  # 3 decodes, then a 4-token prefill chunk whose context is cached
    qkv = torch.randn(n, (group + 2) * hkv, d, generator=g).to(dtype)
    q, k, v = qkv[:, :group * hkv], qkv[:, group * hkv:(group + 1) * hkv], qkv[:, (group + 1) * hkv:]
    assert not q.is_contiguous()
    pslots = torch.randperm(kv.shape[1], generator=g)[:40]
    prefill = PrefillChunk(start=3, length=4, context_len=40, slots=pslots)
    scale = d ** -0.5
    want = reference(q, kv, table, ctx, bs, scale, [prefill], k, v)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=3,
                             decode_block_tables=table, decode_context_lens=ctx, block_size=bs,
                             prefills=[prefill])
    assert use_decode_kernel(kv)
    got = paged_attention(q, k, v, kv, meta, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)
    # Decodes only (the kernel writes the whole output).
    meta.prefills, want_d = [], want[:3]
    torch.testing.assert_close(paged_attention(q[:3], k[:3], v[:3], kv, meta, scale).float(),
                               want_d.float(), atol=ATOL[dtype], rtol=0)


def prefill_case(length: int, cached: int, hkv: int, group: int, d: int, kv_dtype: str, seed: int):
    """A bf16 chunk of `length` queries (a strided view, as the fused qkv rows give) over `cached`
    tokens of context plus its own, in shuffled slots of a random arena (bf16 or int8 rows)."""
    g = torch.Generator().manual_seed(seed)
    t = cached + length
    arena = torch.randn(2, t + 37, hkv, d, generator=g).to(torch.bfloat16)
    kv = torch.stack([quantize_kv(arena[0]), quantize_kv(arena[1])]) if kv_dtype == "int8" else arena
    slots = torch.randperm(t + 37, generator=g)[:t]
    qkv = torch.randn(length, (group + 2) * hkv, d, generator=g).to(torch.bfloat16)
    return qkv[:, :group * hkv], kv, slots


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("group, d", [(1, 64), (3, 64), (4, 32), (8, 128), (3, 128)])
@pytest.mark.parametrize("length, cached", [(1, 0), (7, 0), (16, 0), (17, 40), (33, 1), (128, 471), (200, 0)])
def test_prefill_kernel_matches_reference(kernel, kv_dtype, group, d, length, cached):
    """A prompt chunk's attention, kernel against gather + SDPA: lengths around the 16-query tiles
    and the 8-key score tiles, odd contexts (the last pair of keys padded), with and without cached
    context, G query heads in groups of up to 3, head dims 32/64/128, bf16 and int8 arenas."""
    hkv = 2 if group > 3 else 3
    q, kv, slots = prefill_case(length, cached, hkv, group, d, kv_dtype, seed=length + cached + d)
    if prefill_kernel(kv, q) is None:
        pytest.skip("no AVX-512 BF16 on this CPU: prefill chunks take the reference path")
    scale = d ** -0.5
    chunk = PrefillChunk(start=0, length=length, context_len=cached + length, slots=slots)
    want = prefill_reference(q, None, None, kv, chunk, slots[cached:], scale)
    got = torch.empty(length, hkv * group, d, dtype=torch.bfloat16)
    kernel.paged_prefill_attention(got, q, kv, slots, scale)
    torch.testing.assert_close(got.reshape(length, -1).float(), want.float(), atol=2e-2, rtol=0)


def test_prefill_kernel_rejects_what_it_cannot_run(kernel):
    q, kv, slots = prefill_case(4, 3, 3, 3, 64, "bf16", seed=1)
    if not kernel.prefill_available():
        pytest.skip("no AVX-512 BF16 on this CPU")
    out = torch.empty(4, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the arena"):
        kernel.paged_prefill_attention(out, q, kv, torch.cat([slots[:-1], torch.tensor([kv.shape[1]])]), 0.125)
    with pytest.raises(RuntimeError, match="must hold the chunk"):
        kernel.paged_prefill_attention(out, q, kv, slots[:2], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.paged_prefill_attention(out.float(), q.float(), kv.float(), slots, 0.125)


def test_reference_from_block_tables(monkeypatch):
    """With the kernels disabled, metadata carrying only block tables still runs (reference path)."""
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    q, kv, table, ctx = make_case([1, 17, 40], 2, 2, 16, 8, torch.float32, seed=3)
    assert not use_decode_kernel(kv)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=3,
                             decode_block_tables=table, decode_context_lens=ctx, block_size=8)
    torch.testing.assert_close(paged_attention(q, None, None, kv, meta, 0.25),
                               reference(q, kv, table, ctx, 8, 0.25), atol=1e-6, rtol=0)


def test_bad_block_table_is_rejected(kernel):
    q, kv, table, ctx = make_case([20], 1, 1, 16, 8, torch.float32)
    table[0, 1] = kv.shape[1] // 8  # one past the last block
    with pytest.raises(RuntimeError, match="outside the arena"):
        kernel.paged_decode_attention(torch.empty_like(q), q, kv, table, ctx, 8, 0.25)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.paged_decode_attention(torch.empty_like(q), q, kv, table[:, :1], ctx, 8, 0.25)


def test_build_stamp_covers_included_headers(tmp_path, monkeypatch):
    """A kernel is rebuilt when a kernels/cpu header it includes changes, directly or through another."""
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n')
    (tmp_path / "b.h").write_text("int b = 1;\n")
    (tmp_path / "k.cpp").write_text('#include "a.h"\n#include <vector>\n')
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path)
    assert cpu_build._local_headers("k.cpp") == ["a.h", "b.h"]
    before = cpu_build._stamp("k", "k.cpp")
    (tmp_path / "b.h").write_text("int b = 2;\n")
    assert cpu_build._stamp("k", "k.cpp") != before


# -- bf16 projections from the blocked layout (kernels/cpu/linear.cpp) against F.linear


def linear_kernel_or_skip():
    from meshserve.kernels.linear import kernel

    if kernel() is None:
        pytest.skip("the bf16 projection kernel is not available here (disabled, not buildable, or no AVX-512 BF16)")


def test_blocked_layout_round_trips():
    from meshserve.kernels.linear import from_blocked, to_blocked

    w = torch.randn(96, 40).bfloat16()
    b = to_blocked(w)
    assert b.shape == (3, 20, 32, 2) and b[1, 3, 5, 1] == w[32 + 5, 2 * 3 + 1]
    assert torch.equal(from_blocked(b), w)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (4096, 576), (32, 2), (64, 38)])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 12, 13, 64, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_linear_matches_linear(n, k, m, with_bias, projection_path):
    from meshserve.kernels.linear import BLOCKED, Linear, block_weights, keeps_plain

    linear_kernel_or_skip()
    g = torch.Generator().manual_seed(n * 31 + k + m)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(m, k, generator=g).bfloat16()
    weights = block_weights({"w": w, "b": b} if b is not None else {"w": w}, ["w"])
    # One copy (the plain form is gone), but where the CPU's AMX GEMM takes many rows (keeps_plain)
    assert set(weights) - {"b"} == ({"w", "w" + BLOCKED} if keeps_plain() else {"w" + BLOCKED})
    assert keeps_plain() == (projection_path == "amx-gemm")
    lin = Linear.of(weights, "w", "b" if b is not None else None)
    assert lin.blocked is not None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got = lin(x).float()
    # fp32 accumulation, then one rounding to bf16: within a couple of bf16 ulps of the exact value
    assert torch.allclose(got, want, rtol=2 ** -7, atol=1e-2)
    # a rows view that is not contiguous takes the same path
    assert torch.equal(lin(torch.cat([x, x], 1)[:, :k]), lin(x))


def test_blocked_weights_skip_what_the_layout_does_not_fit(projection_path):
    from meshserve.kernels.linear import BLOCKED, Linear, block_weights

    linear_kernel_or_skip()
    w = {"odd_n": torch.randn(40, 64).bfloat16(), "fp32": torch.randn(64, 64), "tied": torch.randn(64, 64).bfloat16()}
    out = block_weights(w, ["odd_n", "fp32", "tied"], keep={"tied"})
    assert set(out) == {"odd_n", "fp32", "tied", "tied" + BLOCKED}  # the same when keeping plain forms
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(Linear.of(out, "odd_n")(x), torch.nn.functional.linear(x, w["odd_n"]))


# -- a layer's element-wise steps (kernels/cpu/layer_ops.cpp) against their torch references

def layer_ops_or_skip():
    from meshserve.kernels.layer_ops import LayerOps
    ops = LayerOps(torch.bfloat16, "cpu", 1e-5)
    if ops.kernel is None:
        pytest.skip("the compiled layer ops are unavailable here (see the warning logged)")
    return ops, LayerOps(torch.float32, "cpu", 1e-5)  # the reference, whatever the dtype


def close_bf16(a, b, ulps=2):
    """Within a couple of bf16 roundings of each other (relative to the values' scale)."""
    a, b = a.float(), b.float()
    assert torch.allclose(a, b, rtol=ulps * 2 ** -8, atol=ulps * 2 ** -8 * b.abs().max().item()), \
        (a - b).abs().max()


@pytest.mark.parametrize("rows", [1, 3, 200])
def test_layer_ops_match_reference(rows):
    ops, ref = layer_ops_or_skip()
    torch.manual_seed(rows)
    d, heads, hd = 576, 12, 64
    x = torch.randn(rows, d).bfloat16()
    w = (torch.rand(d) + 0.5).bfloat16()
    close_bf16(ops.rms_norm(x, w), ref.rms_norm(x, w))

    a, res = torch.randn(rows, d).bfloat16(), torch.randn(rows, d).bfloat16()
    res_k, res_r = res.clone(), res.clone()
    out_k, out_r = ops.add_rms_norm_(a.clone(), res_k, w), ref.add_rms_norm_(a.clone(), res_r, w)
    assert torch.equal(res_k, res_r)  # the residual stream is rounded exactly as torch rounds it
    close_bf16(out_k, out_r)

    # RoPE on the q and k heads of a fused qkv row; v (the rest of the row) stays as it was.
    qkv = torch.randn(rows, (heads + 3) * hd).bfloat16()
    pos = torch.randint(0, 4096, (rows,))
    ang = torch.outer(torch.arange(4096).float(), torch.rand(hd // 2))
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    q_k, q_r = qkv.clone(), qkv.clone()
    ops.rope_(q_k, pos, cos, sin, heads, hd)
    ref.rope_(q_r, pos, cos, sin, heads, hd)
    close_bf16(q_k, q_r)
    assert torch.equal(q_k[:, heads * hd:], qkv[:, heads * hd:])

    gu = torch.randn(rows, 2 * 1536).bfloat16()
    close_bf16(ops.silu_mul(gu), ref.silu_mul(gu))
    # The vectorized exponential's clamps: silu's limits, and NaN stays NaN (odd counts reach
    # the scalar tail too).
    for n in (16, 19):
        g = torch.tensor([-100., -89., -88.5, 88.5, 89., 100., 0., float("nan")] * 3)[:n]
        gu = torch.cat([g, torch.full((n,), 1.5)]).bfloat16().unsqueeze(0)
        got, want = ops.silu_mul(gu).float(), ref.silu_mul(gu).float()
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=2 ** -7, atol=1e-30)


def test_layer_ops_bench_reports_every_step(tmp_path):
    """bench/layer_ops_bench.py times each step at each row count, the kernel against torch."""
    import json

    from meshserve.bench.layer_ops_bench import main
    layer_ops_or_skip()
    out = tmp_path / "ops.json"
    assert main(["--rows", "1,19", "--reps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["step"], r["rows"]) for r in rows} == {
        (s, m) for s in ("rms_norm", "add_rms_norm", "rope", "silu_mul") for m in (1, 19)}
    assert all(r["kernel_us"] > 0 and r["torch_us"] > 0 for r in rows)
    assert all(r["max_rel_diff"] < 0.02 for r in rows), rows


def test_layer_ops_reject_bad_input():
    ops, _ = layer_ops_or_skip()
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rope_(torch.zeros(1, 128).bfloat16(), torch.tensor([99]), torch.zeros(8, 32).bfloat16(),
                  torch.zeros(8, 32).bfloat16(), 2, 64)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        ops.kernel.rms_norm(torch.zeros(1, 8), torch.zeros(1, 8), torch.ones(8), 1e-5)


def test_attention_bench_times_a_prefill_chunk(capsys):
    """bench/attention_bench.py --prefill: the reference and (where it runs) the kernel on one chunk."""
    from meshserve.bench import attention_bench

    r = attention_bench.main(["--prefill", "20", "--context", "50", "--repeat", "2", "--kv-cache-dtype", "int8"])
    assert r["shape"]["prefill"] == 20 and r["reference_ms"] > 0
    if r["kernel_ms"] is not None:
        assert r["max_abs_diff"] < 2e-2 and r["kernel_GFLOP_per_s"] > 0
