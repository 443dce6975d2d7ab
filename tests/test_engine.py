"""The engine against its oracle: greedy tokens equal Hugging Face Transformers' in fp32,
whatever the chunk size, prefix caching or preemption; seeded sampling is batch-invariant."""

from __future__ import annotations

import pytest
import torch
from oracle import hf_greedy

from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine, RequestError
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir

MAX_NEW = 24


def make_prompts(vocab: int, n: int = 18, seed: int = 0) -> list[list[int]]:
    """Prompts of many lengths (1..~150), some sharing a long prefix, so prefix caching hits."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 47, 64, 65, 90, 120, 150][: n - 2]
    prompts = [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]
    shared = prompts[-2][:100]
    return [shared + [5, 6, 7]] + prompts + [shared + torch.randint(3, vocab, (20,), generator=g).tolist()]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size)
    ref = hf_greedy(hf, prompts, MAX_NEW, cfg.eos_token_ids)
    return model, hf, prompts, ref


def engine(model, chunk=512, prefix=True, blocks=4096, block_size=16, max_seqs=64) -> LLMEngine:
    sched = SchedulerConfig(max_num_batched_tokens=max(chunk, 32), prefill_chunk_size=chunk, max_num_seqs=max_seqs)
    return LLMEngine(model, EngineConfig(block_size=block_size, num_kv_blocks=blocks,
                                         enable_prefix_caching=prefix, scheduler=sched))


@pytest.mark.parametrize("chunk", [1, 7, 64, 512])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("pool", ["large", "small"])
def test_greedy_matches_transformers(tiny, chunk, prefix, pool):
    model, _, prompts, ref = tiny
    # "small": 24 blocks of 8 tokens cannot hold all the sequences at once, so some are preempted.
    eng = engine(model, chunk, prefix, blocks=4096 if pool == "large" else 24, block_size=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    # Two waves: the second arrives while the first decodes, and its last prompt shares 100
    # tokens with the first wave's first prompt, whose blocks are computed by then.
    first = [eng.add_request(f"a{i}", p, params) for i, p in enumerate(prompts[:9])]
    while eng.scheduler.waiting or any(s.num_output_tokens == 0 for s in first if not s.is_finished):
        eng.step()
    second = [eng.add_request(f"b{i}", p, params) for i, p in enumerate(prompts[9:])]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in first + second] == ref
    stats = eng.stats
    if pool == "small":
        assert stats["num_preemptions"] > 0
    if prefix:
        assert stats["prefix_hits"] > 0  # the two prompts sharing 100 tokens
    assert eng.block_pool.num_free == eng.block_pool.num_blocks  # nothing leaked


def test_cache_salt_shares_prefix_blocks_only_within_a_salt(tiny):
    """vLLM's cache_salt: a prompt cached under one salt is a hit for the same salt only (and the
    unsalted prompt's blocks are no salted one's); the tokens are the oracle's either way."""
    model, _, prompts, ref = tiny
    eng = engine(model, block_size=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    p, want = prompts[-3], ref[-3]  # 120 tokens: 14 full blocks to share

    def run(rid: str, salt: str | None) -> int:
        s = eng.add_request(rid, p, params, cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
        assert s.output_token_ids == want
        return s.num_cached_tokens

    assert run("plain", None) == 0
    assert run("a1", "tenant-a") == 0  # the unsalted blocks are not tenant-a's
    assert run("b1", "tenant-b") == 0
    assert run("a2", "tenant-a") == run("b2", "tenant-b") == run("plain2", None) == (len(p) - 1) // 8 * 8


def test_biases_on_every_projection_match_transformers(tiny_llama_biased):
    """A Llama with attention_bias biases o_proj too, and mlp_bias the MLP's three projections: each
    is applied (they were once dropped), in chunked prefill, prefix hits and decode alike."""
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama_biased)
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= set(sd)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_biased), dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size, n=8)
    ref = hf_greedy(hf, prompts, 16, cfg.eos_token_ids)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    assert all(model.proj[0][name].bias is not None for name in ("qkv", "o", "gate_up", "down"))
    assert engine(model, chunk=7).generate(prompts, SamplingParams(max_tokens=16, temperature=0)) == ref


TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _transformers_model(path, arch: str, **config):
    """A tiny random model of a Transformers architecture, saved to `path`, biases and norms noised."""
    import transformers

    torch.manual_seed(7)
    hf = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**TINY, **config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("arch,config", [("Qwen2", {}), ("Qwen3", {"head_dim": 32}),
                                         ("Mistral", {"sliding_window": 48})])
def test_other_llama_family_architectures_match_transformers(tmp_path, arch, config):
    """Qwen2 (q|k|v biases, o none), Qwen3 (an RMSNorm over each q and k head before RoPE; heads
    wider than hidden / heads here) and Mistral (a sliding window, within which attention is full:
    served with its window as the context, so never beyond it)."""
    hf = _transformers_model(tmp_path, arch, **config)
    cfg, sd = load_hf_dir(tmp_path)
    assert cfg.context_length == config.get("sliding_window", 256)
    prompts = [p[:cfg.context_length - 16] for p in make_prompts(cfg.vocab_size, n=8)]
    ref = hf_greedy(hf, prompts, 16, [2])
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    assert engine(model, chunk=7).generate(prompts, SamplingParams(max_tokens=16, temperature=0)) == ref
    if arch == "Qwen3":  # bf16 and int8 weights run it too (decode steps fused, with the q/k norms)
        for quantization in (None, "int8"):
            bf = LlamaModel.from_hf(cfg, sd, torch.bfloat16, quantization=quantization)
            got = engine(bf).generate(prompts, SamplingParams(max_tokens=4, temperature=0))
            assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= len(ref) * 0.75
    if "sliding_window" in config:
        with pytest.raises(ValueError, match="sliding window"):
            LLMEngine(model, EngineConfig(max_model_len=cfg.sliding_window + 1))


@pytest.mark.parametrize("arch,config", [("Gemma", {"head_dim": 16}), ("Phi3", {}), ("Llama", {"hidden_act": "gelu"})])
def test_architectures_this_decoder_is_not_are_refused_by_name(tmp_path, arch, config):
    """Loaded as a Llama they would run, wrong (Gemma's activation and scaled embedding, ...)."""
    _transformers_model(tmp_path, arch, **config)
    with pytest.raises(ValueError, match=f"{arch}ForCausalLM is not supported|'gelu' is not supported"):
        load_hf_dir(tmp_path)


def test_step_runs_its_model_pass_through_the_given_runner(tiny):
    """The worker's thread tuner runs each model pass: it is told the size of the step being run
    (not the last one's), and the tokens are those of a plain step."""
    model, _, prompts, ref = tiny
    eng = engine(model, chunk=64)
    seqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW, temperature=0))
            for i, p in enumerate(prompts)]
    sizes = []

    def run(num_tokens, compute):
        sizes.append(num_tokens)
        return compute()

    while eng.has_unfinished():
        eng.step(run)
    assert [s.output_token_ids for s in seqs] == ref
    assert sizes[0] == min(64, sum(len(p) for p in prompts)) and sizes[-1] < sizes[0]  # prefill chunks, then decodes


def test_prefix_hit_gives_same_tokens_and_counts_cached(tiny):
    model, _, prompts, ref = tiny
    eng = engine(model)
    first = eng.generate([prompts[-1]], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    seq = eng.add_request("again", prompts[-1], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    while eng.has_unfinished():
        eng.step()
    assert seq.num_cached_tokens == (len(prompts[-1]) - 1) // 16 * 16
    assert first == [ref[-1]] and seq.output_token_ids == ref[-1]


def test_seeded_sampling_is_batch_invariant(tiny):
    model, _, prompts, _ = tiny
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine(model).generate([prompts[9]], params)[0]
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(8)]
    mixed = engine(model, chunk=7).generate(prompts[:8] + [prompts[9]], others + [params])[-1]
    assert alone == mixed
    other_seed = engine(model).generate([prompts[9]], SamplingParams(max_tokens=20, temperature=0.9, seed=99))[0]
    assert other_seed != alone


def test_sampling_filters_that_leave_one_token_equal_greedy(tiny):
    model, _, prompts, ref = tiny
    for params in (SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_k=1, seed=1),
                   SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=1e-6, seed=1),
                   SamplingParams(max_tokens=MAX_NEW, temperature=1.0, min_p=1.0, seed=1)):
        assert engine(model).generate(prompts[:4], params) == ref[:4]


def test_logprobs_match_transformers(tiny):
    model, hf, prompts, ref = tiny
    eng = engine(model)
    p = prompts[10]
    seq = eng.add_request("lp", p, SamplingParams(max_tokens=3, temperature=0, logprobs=5))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    with torch.inference_mode():
        logits = hf(torch.tensor([p + seq.output_token_ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    for i, out in enumerate(outs):
        lp = out.new_logprobs[0]
        row = lps[len(p) - 1 + i]
        assert lp.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)


def test_stop_conditions(tiny):
    model, _, prompts, ref = tiny
    eng = engine(model)
    p, want = prompts[3], ref[3]
    out = eng.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[want[2]]))[0]
    assert out == want[:want.index(want[2]) + 1]
    out = eng.generate([p], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out == want[:5]


def test_request_that_can_never_fit_is_rejected(tiny):
    model, *_ = tiny
    eng = engine(model, blocks=4, block_size=8)
    with pytest.raises(RequestError, match="KV cache"):
        eng.add_request("big", list(range(3, 30)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request("long", [3] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="token ids"):
        eng.add_request("bad", [10**6], SamplingParams(max_tokens=10))
    # The engine is still healthy.
    assert eng.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0))[0]


def test_stop_strings_and_detokenization_in_process(tiny_llama, tiny):
    _, _, prompts, ref = tiny
    llm = LLM(str(tiny_llama), "float32")
    full = llm.generate([prompts[5]], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0]
    assert full.token_ids == ref[5]
    assert full.text == llm.tokenizer.decode(ref[5])
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert stop.strip(), "pick a prompt whose output has text in the middle"
    cut = llm.generate([prompts[5]], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_bfloat16_runs_and_mostly_agrees(tiny_llama, tiny):
    _, _, prompts, ref = tiny
    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.bfloat16)
    got = engine(model, chunk=64).generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    # bf16 rounds differently from fp32; the first tokens should still mostly agree.
    assert sum(g[0] == r[0] for g, r in zip(got, ref)) >= len(ref) * 0.8
