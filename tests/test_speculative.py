"""Speculative decoding: greedy output equals Transformers' (the oracle) with prompt lookup and with
a draft model, through chunking, prefix caching and preemption; sampled output keeps the target's
distribution (the rejection rule alone, and the engine against sampling without speculation);
stops, max_tokens, logprobs and structured output hold; per-class and batch-size turn-down."""

from __future__ import annotations

import json
import time

import pytest
import torch
from oracle import hf_greedy

from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine
from meshserve.shared.engine.ngram_proposer import NgramProposer, PredictionProposer
from meshserve.shared.engine.rejection_sampler import verify
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import Draft, SamplingParams, Sequence
from meshserve.shared.engine.speculative import SpeculativeConfig
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir

MAX_NEW = 24


@pytest.fixture(scope="module")
def models(tiny_llama):
    """The target, a draft (the target's weights with noise: it agrees with the target often, not
    always), Transformers' reference outputs."""
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    target = LlamaModel.from_hf(cfg, sd, torch.float32)
    g = torch.Generator().manual_seed(3)
    draft = LlamaModel.from_hf(cfg, {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g) for k, v in sd.items()},
                               torch.float32)
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]
    prompts = base + [b * 3 for b in base[1:]]  # prompts that repeat themselves: lookups match
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    return target, draft, prompts, hf_greedy(hf, prompts, MAX_NEW, cfg.eos_token_ids)


def spec_engine(target, spec, draft=None, blocks=4096, chunk=64, prefix=True) -> LLMEngine:
    sched = SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=chunk)
    return LLMEngine(target, EngineConfig(block_size=8, num_kv_blocks=blocks, enable_prefix_caching=prefix,
                                          scheduler=sched, speculative=spec), draft_model=draft)


@pytest.mark.parametrize("method,chunk,prefix,pool", [("ngram", 64, True, "large"), ("ngram", 7, False, "small"),
                                                      ("draft", 64, True, "small"), ("draft-self", 7, True, "large")])
def test_greedy_matches_transformers(models, method, chunk, prefix, pool):
    target, draft, prompts, ref = models
    spec = SpeculativeConfig("ngram" if method == "ngram" else "draft", num_speculative_tokens=3,
                             disable_by_batch_size=64)
    # "small": 24 blocks of 8 tokens cannot hold every sequence at once: some are preempted.
    eng = spec_engine(target, spec, target if method == "draft-self" else draft if method == "draft" else None,
                      blocks=4096 if pool == "large" else 24, chunk=chunk, prefix=prefix)
    assert eng.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0)) == ref
    st = eng.stats
    assert st["spec_decode"]["num_verification_steps"] > 0 and st["spec_decode"]["num_accepted_tokens"] > 0
    if method == "draft-self":  # the target as its own draft: every proposed token is accepted
        assert st["spec_decode"]["num_accepted_tokens"] == st["spec_decode"]["num_draft_tokens"]
    if pool == "small":
        assert st["num_preemptions"] > 0
    assert eng.block_pool.num_free == eng.block_pool.num_blocks  # nothing leaked, rejected blocks included


def test_handoff_carries_only_tokens(models):
    """A sequence detached mid-decode and adopted again continues exactly; the draft's state for it
    is dropped when it leaves and rebuilt from its tokens."""
    target, draft, prompts, ref = models
    eng = spec_engine(target, SpeculativeConfig("draft", num_speculative_tokens=3), draft)
    seq = eng.add_request("h", prompts[3], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    while seq.num_output_tokens < 6:
        eng.step()
    seq, blocks, shared = eng.detach("h")
    eng.step()  # nothing runs; the draft forgets it
    assert "h" not in eng.speculator.proposer.mirrors and seq.draft is None
    eng.adopt(seq, blocks, shared, seq.num_computed_tokens)
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == ref[3]


def test_rejection_rule_keeps_the_target_distribution():
    """The first token of a verification is distributed as p_0 whatever the proposal (a point mass or
    a draft distribution q); the second, when the first proposed token was kept, as p_1."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    p = logits.softmax(-1)
    q = torch.softmax(torch.randn(2, 6, generator=g), -1)
    n = 4000
    for probs in (None, q):
        seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, seed=7))
        first, second = torch.zeros(6), torch.zeros(6)
        for _ in range(n):
            # a point mass on the likeliest tokens (often kept, so the second is often reached); or drawn from q
            d = [int(p[0].argmax()), int(p[1].argmax())] if probs is None else \
                torch.multinomial(q, 1, generator=g).flatten().tolist()
            seq.draft = Draft(d, probs)
            tokens, _ = verify(logits, seq)
            first[tokens[0]] += 1
            if tokens[0] == d[0]:
                second[tokens[1]] += 1
        for emp, ref in ((first, p[0]), (second, p[1])):
            # three times the total variation distance a sample of this size is expected to show
            tv, bound = 0.5 * float((emp / emp.sum() - ref).abs().sum()), 1.5 * (2 * 6 / (torch.pi * emp.sum())) ** 0.5
            assert emp.sum() > 1000 and tv < bound, (probs is None, emp / emp.sum(), ref)
    # a rule that kept every proposed token would be far off: the test can fail
    assert 0.5 * float((torch.eye(6)[0] - p[0]).abs().sum()) > 0.3


def test_sampling_with_speculation_matches_sampling_without(models):
    """The engine end to end: the distribution of the first token after a proposal (the second
    output token; a draft model proposes) over many seeded requests, with and without speculation."""
    target, draft, prompts, _ = models
    n = 300
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s) for s in range(n)]
    spec = SpeculativeConfig("draft", num_speculative_tokens=2, disable_by_batch_size=n)
    counts = []
    for eng in (spec_engine(target, None), spec_engine(target, spec, draft)):
        eng.scheduler.config.max_num_seqs = n
        eng.scheduler.config.max_num_batched_tokens = 4096
        outs = eng.generate([prompts[2]] * n, params)
        counts.append(torch.bincount(torch.tensor([o[1] for o in outs]), minlength=target.cfg.vocab_size).float())
    st = eng.stats["spec_decode"]
    assert st["num_verification_steps"] >= n and 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]
    a, b = (c / n for c in counts)
    # 2.5 times the total variation distance two samples of this size from one distribution show
    support = int(((a > 0) | (b > 0)).sum())
    bound = 2.5 * 0.5 * (2 * support / torch.pi * (2 / n)) ** 0.5
    assert 0.5 * float((a - b).abs().sum()) < bound, (a[a > 0], b[b > 0])


def test_stops_logprobs_and_structured_output_hold(tiny_llama):
    """With prompt lookup on a prompt that repeats, each request's tokens and logprobs equal those
    of the engine without speculation: max_tokens, a stop token inside the accepted tokens, penalties,
    min_tokens, allowed tokens, bad words and a grammar included."""
    phrase = "the quick brown fox jumps over the lazy dog. "
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, disable_by_batch_size=64)
    plain, fast = LLM(str(tiny_llama), "float32"), LLM(str(tiny_llama), "float32", EngineConfig(speculative=spec))
    prompt = plain.tokenizer.encode(phrase * 4)
    base = plain.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0].token_ids
    choice = json.dumps([phrase * 2, "hello world"])
    cases = [SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=2),
             SamplingParams(max_tokens=7, temperature=0),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[base[5]]),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, repetition_penalty=1.3, min_tokens=4),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, bad_words=[base[3:5]]),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, allowed_token_ids=sorted(set(prompt) - {base[2]})),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, constraint=("choice", choice)),
             SamplingParams(max_tokens=MAX_NEW, temperature=0, constraint=("regex", "(the quick brown )+fox")),
             # the grammar needs " brown", which allowed_token_ids leaves out: the request fails there
             SamplingParams(max_tokens=MAX_NEW, temperature=0, constraint=("regex", "(the quick brown )+fox"),
                            allowed_token_ids=sorted(set(prompt) - set(plain.tokenizer.encode(" brown"))))]
    want = plain.generate([prompt] * len(cases), cases)
    got = fast.generate([prompt] * len(cases), cases)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason and g.text == w.text
        assert g.error == w.error
    assert (want[-1].finish_reason, want[-1].text) == ("error", "the quick")
    assert "allowed_token_ids and the response format together allow none" in want[-1].error
    assert want[4].token_ids[:5] != base[:5] and want[5].token_ids[:3] != base[:3]  # the masks changed them
    assert [lp.logprob for lp in got[0].logprobs] == pytest.approx([lp.logprob for lp in want[0].logprobs], abs=1e-4)
    assert [lp.top[0][0] for lp in got[0].logprobs] == [lp.top[0][0] for lp in want[0].logprobs]
    st = fast.engine.stats["spec_decode"]
    assert st["num_accepted_tokens"] > 0
    assert fast.engine.block_pool.num_free == fast.engine.block_pool.num_blocks


def test_classes_and_batch_size_turn_speculation_down(models):
    target, _, prompts, ref = models
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, classes=("interactive",), disable_by_batch_size=2)
    eng = spec_engine(target, spec)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    eng.add_request("bg", prompts[6], params, priority="background")
    while eng.has_unfinished():
        eng.step()
    assert eng.stats["spec_decode"]["num_verification_steps"] == 0  # background does not speculate
    for i in range(3):  # more running than disable_by_batch_size: nobody speculates
        eng.add_request(f"i{i}", prompts[4], params, priority="interactive")
    eng.step()
    assert len(eng.scheduler.running) == 3
    while eng.has_unfinished():
        eng.step()
    assert eng.stats["spec_decode"]["num_verification_steps"] == 0
    eng.add_request("alone", prompts[4], params, priority="interactive")
    while eng.has_unfinished():
        eng.step()
    assert eng.stats["spec_decode"]["num_verification_steps"] > 0


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    ng = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert ng.lookup([5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 3, 6, 7], 3).tokens == [8, 2, 3]  # "6 7" latest with 3 after
    assert ng.lookup([5, 6, 7, 8, 9, 6, 7], 4).tokens == [8, 9, 6, 7]
    assert ng.lookup([1, 2, 3, 4], 2) is None  # no earlier occurrence of any suffix
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


def test_a_predicted_output_is_proposed_and_changes_no_token(models):
    """OpenAI's `prediction` on an engine that speculates not: its tokens are proposed (the engine
    makes a speculator for it) and verified, so each output equals Transformers' greedy one whether
    the prediction is the answer, the answer with an edit, something else, or longer than the answer,
    beside requests without one, with and without preemption. Every block comes back."""
    target, _, prompts, ref = models
    preds = [ref[0], ref[1][:5] + [7, 8, 9] + ref[1][8:], [5] * 30, ref[3] + ref[4], None, ref[5], None]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, prediction=p) for p in preds]
    for blocks in (64, 24):  # 24 blocks of 8 tokens cannot hold them all: some are preempted
        eng = spec_engine(target, None, blocks=blocks)
        assert eng.speculator is None
        assert eng.generate(prompts, params) == ref
        st = eng.stats["spec_decode"]
        assert 0 < st["num_accepted_tokens"] <= st["num_draft_tokens"] and st["num_verification_steps"] > 0
        assert eng.block_pool.num_free == eng.block_pool.num_blocks
    assert eng.stats["num_preemptions"] > 0
    # where the prediction proposes nothing (a wrong one), the model's own prompt lookup still does
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, disable_by_batch_size=64)
    looked = spec_engine(target, spec, blocks=64)
    assert looked.generate(prompts[4:], [SamplingParams(max_tokens=MAX_NEW, temperature=0, prediction=[5] * 30)]
                           * 3) == ref[4:]
    assert looked.stats["spec_decode"]["num_accepted_tokens"] > 0
    # alone, the exact prediction is all accepted: a token and its k proposed ones per step
    eng = spec_engine(target, None, blocks=64)
    eng.generate([prompts[0]], [SamplingParams(max_tokens=MAX_NEW, temperature=0, prediction=ref[0])])
    st = eng.stats["spec_decode"]
    assert st["num_accepted_tokens"] == st["num_draft_tokens"] and st["num_verification_steps"] < MAX_NEW // 2


def test_the_prediction_proposer_follows_the_output_through_an_edit():
    """What follows the output's longest suffix (of two tokens at least, but for the first token
    alone) in the prediction, at the occurrence at or after where the last proposal began
    (the prediction repeats itself); an output that left the prediction gets none until it rejoins."""
    pred = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 10, 11]
    prop = PredictionProposer()

    def seq(out):
        s = Sequence("r", [100, 101], SamplingParams(prediction=pred))
        s.token_ids += out
        return s

    assert prop.lookup(seq([1]), 3).tokens == [2, 3, 9]  # the first token, alone
    assert prop.lookup(seq([1, 2, 3]), 3).tokens == [9, 1, 2]
    assert prop.lookup(seq([1, 2, 3, 9, 1, 2, 3]), 2).tokens == [4, 5]  # "1 2 3" again: the later one
    assert prop.lookup(seq([1, 2, 3, 9, 1, 2, 3, 4, 7]), 2) is None  # an edit: 7 is not in it
    assert prop.lookup(seq([1, 2, 3, 9, 1, 2, 3, 4, 7, 5]), 2) is None  # one token in both is no sign
    assert prop.lookup(seq([1, 2, 3, 9, 1, 2, 3, 4, 7, 5, 6]), 2).tokens == [10, 11]  # rejoined
    prop.retain(set())
    assert prop.cursor == {}


def check_mesh_speculates(m, prompts: list, texts: list[str], num_tokens: list[int] | None = None) -> dict:
    """Each prompt, greedy through the mesh's OpenAI API, gives its expected text (and token count);
    then, once the workers' heartbeats bring them, /metrics counts accepted draft tokens (no more
    than were proposed) and verification steps. Returns those counters."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        r = client.completions.create(model=m.model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == text
        if num_tokens is not None:
            assert r.usage.completion_tokens == num_tokens[i]
    deadline, values = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # the counters come with the workers' heartbeats
        text = httpx.get(m.url + "/metrics").text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("meshserve:spec_decode_")}
        if values.get("meshserve:spec_decode_num_accepted_tokens_total", 0) > 0:
            break
        time.sleep(0.2)
    accepted = values["meshserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= values["meshserve:spec_decode_num_draft_tokens_total"], values
    steps = values["meshserve:spec_decode_num_verification_steps_total"]
    assert steps > 0
    assert values["meshserve:spec_decode_acceptance_rate"] == pytest.approx(
        accepted / values["meshserve:spec_decode_num_draft_tokens_total"])
    assert values["meshserve:spec_decode_tokens_per_verification_step"] == pytest.approx((accepted + steps) / steps)
    return values


def test_meshserve_up_speculative_ngram(tiny_llama, tmp_path):
    """`meshserve up --speculative ngram` (a prefill and a decode worker: the decode worker speculates
    on the sequences handed to it) gives the text of the engine without speculation, and /metrics
    counts the accepted tokens of a prompt that repeats itself."""
    from mesh_util import Mesh

    prompt = "def add(a, b):\n    return a + b\n" * 3
    want = LLM(str(tiny_llama), "float32").generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0]
    spec = LLM(str(tiny_llama), "float32", EngineConfig(speculative=SpeculativeConfig("ngram", 4)))
    assert spec.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0].text == want.text
    assert spec.engine.stats["spec_decode"]["num_accepted_tokens"] > 0  # the prompt the mesh gets has acceptances
    with Mesh(tiny_llama, tmp_path, prefill=1, decode=1,
              extra=["--speculative", "ngram", "--num-speculative-tokens", "4"]) as m:
        check_mesh_speculates(m, [prompt], [want.text])
        status = m.ask("scheduler.status")
        assert status["spec_decode"]["num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory):
    """A second tiny model with the target's tokenizer and vocabulary, for `--speculative-model`: the
    target's weights with noise (so it agrees with the target often, not always)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = shutil.copytree(tiny_llama, tmp_path_factory.mktemp("draft") / "draft")
    sd = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    save_file({k: (v + 0.1 * v.std() * torch.randn(v.shape, generator=g)).contiguous() for k, v in sd.items()},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_meshserve_up_speculative_model(tiny_llama, draft_dir, tmp_path):
    """`meshserve up --speculative-model D` with a prefill and a decode worker: the decode worker's
    draft rebuilds its mirror of each handed-off sequence from its tokens, the greedy text equals
    Transformers' on the target, and /metrics counts the draft's proposals and acceptances."""
    from mesh_util import Mesh
    from transformers import AutoModelForCausalLM

    from meshserve.shared.models_repo import load_tokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (9, 30)]
    want = hf_greedy(hf, prompts, MAX_NEW, [2])
    tok = load_tokenizer(str(tiny_llama))
    with Mesh(tiny_llama, tmp_path, prefill=1, decode=1,
              extra=["--speculative-model", str(draft_dir), "--num-speculative-tokens", "3"]) as m:
        check_mesh_speculates(m, prompts, [tok.decode(ref) for ref in want], [len(ref) for ref in want])
        deadline = time.monotonic() + 30

        def decode_streamed() -> list[int]:
            return [w["tokens_streamed"] for w in m.ask("scheduler.status")["workers"] if w["role"] == "decode"]

        while decode_streamed() == [0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert decode_streamed()[0] > 0  # the decode worker, after the handoff, streamed (and speculated)
        assert m.ask("scheduler.status")["spec_decode"]["num_draft_tokens"] > 0


def test_speculation_turns_itself_off_where_verifying_makes_tokens_slower_and_back_on():
    """Payoff: decode-only steps measured both ways. Plain steps at 200 tokens/s against verifying
    steps at 100: after its warm-up it proposes only on its probes; once verifying gives 500
    tokens/s it proposes again."""
    from meshserve.shared.engine.speculative import Payoff

    p = Payoff()

    def run(steps: int, verify_rate: float) -> list[bool]:
        out = []
        for _ in range(steps):
            on = p.proposes()
            p.observe(0.01, round(0.01 * (verify_rate if on else 200.0)), verified=on)
            out.append(on)
        return out

    warm = run(64, 100.0)
    assert p.measured and not p.pays()
    assert 0 < warm[:32].count(False) < 32  # the warm-up measured plain steps too
    slow = run(320, 100.0)
    assert sum(slow) == 320 // Payoff.PROBE_EVERY  # only the probes propose
    fast = run(320, 500.0)
    assert p.pays() and fast[-100:].count(True) >= 96  # back on, bar the probes the other way


def test_a_failed_model_switch_keeps_the_workers_draft_in_use(tiny_llama, draft_dir, tmp_path):
    """A speculative worker asked to switch to a model that fails to load stays on its model and its
    draft, and the loader still counts it as a user of both (the failed load counted it off them: were
    the draft not registered again, the loader could evict it under the worker)."""
    import shutil

    import httpx
    from mesh_util import Mesh
    from openai import OpenAI

    broken = shutil.copytree(tiny_llama, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- {{name: target, path: '{tiny_llama}'}}\n- {{name: broken, path: '{broken}'}}\n")
    alone = LLM(str(tiny_llama), "float32").generate([[5, 9, 14, 5, 9, 14, 5]],
                                                        SamplingParams(max_tokens=MAX_NEW, temperature=0))[0].text
    with Mesh(tiny_llama, tmp_path, prefill=0, decode=1,
              extra=["--models", str(manifest), "--speculative-model", str(draft_dir),
                     "--num-speculative-tokens", "3"]) as m:
        def users() -> dict[str, list[str]]:
            return {x["model"]: x["users"] for x in m.ask("models.node0.status")["models"] if x["users"]}

        before = users()
        assert set(before) == {str(tiny_llama), str(draft_dir)} and before[str(tiny_llama)] == before[str(draft_dir)]
        client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = httpx.post(m.url + "/v1/completions", json={"model": "broken", "prompt": [5, 9], "max_tokens": 2},
                       timeout=120)
        assert r.status_code >= 400 and "loading it failed" in r.json()["error"]["message"], r.text
        assert users() == before
        assert client.completions.create(model="target", prompt=[5, 9, 14, 5, 9, 14, 5], max_tokens=MAX_NEW,
                                         temperature=0).choices[0].text == alone


def test_manifest_chooses_speculation_per_model(tiny_llama, draft_dir, tmp_path):
    """One worker, three models of one vocabulary: `speculative` in each manifest entry (prompt lookup,
    a draft model, or false against the workers' --speculative ngram) is what the worker's engine
    runs on each model as it switches between them; each model's greedy text is its own alone."""
    from mesh_util import Mesh
    from openai import OpenAI
    from tiny_model import make_tiny_llama

    plain = make_tiny_llama(tmp_path / "plain", seed=5)
    other = make_tiny_llama(tmp_path / "other", seed=4)
    manifest = tmp_path / "models.yaml"
    manifest.write_text(f"- {{name: lookup, path: '{tiny_llama}', speculative: {{method: ngram, "
                        "num_speculative_tokens: 4}}\n"
                        f"- {{name: drafted, path: '{other}', speculative: {{method: draft, model: '{draft_dir}', "
                        "num_speculative_tokens: 3}}\n"
                        f"- {{name: plain, path: '{plain}', speculative: false}}\n")
    prompt = "def add(a, b):\n    return a + b\n" * 3
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    want = {name: LLM(str(path), "float32").generate([prompt], params)[0].text
            for name, path in (("lookup", tiny_llama), ("drafted", other), ("plain", plain))}
    with Mesh(tiny_llama, tmp_path, prefill=0, decode=1, extra=["--models", str(manifest), "--speculative", "ngram"],
              env={"MESHSERVE_CACHE": str(tmp_path / "cache")}) as m:
        client = OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def counters(name: str) -> dict:
            """The worker's engine's counters once its heartbeat shows it on `name` after the request."""
            deadline = time.monotonic() + 30
            while True:
                st = m.ask("scheduler.status")
                w = st["workers"][0]
                if w["model"] == name and w["tokens_streamed"] >= streamed + MAX_NEW:
                    return st["spec_decode"]
                assert time.monotonic() < deadline, st["workers"]
                time.sleep(0.2)

        before = {}
        for name in ("lookup", "drafted", "plain", "lookup"):
            streamed = m.ask("scheduler.status")["workers"][0]["tokens_streamed"]
            r = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == want[name], name
            got = counters(name)  # the worker's counters over its engines: they never go back at a switch
            grew = {k: got.get(k, 0) - before.get(k, 0) for k in ("num_draft_tokens", "num_verification_steps")}
            assert min(grew.values()) >= 0, (name, before, got)
            if name == "plain":
                assert grew["num_verification_steps"] == 0, (name, grew)
            else:
                assert grew["num_draft_tokens"] > 0 and grew["num_verification_steps"] > 0, (name, grew)
            before = got
