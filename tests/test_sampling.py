"""The engine's request options against their oracles: logit bias, penalties and min_tokens against
Transformers' logits processors on the same weights, prompt logprobs (echo) against Transformers'
forward pass (with and without prefix-cache hits, chunked, preempted), n > 1 siblings sharing the
prompt's blocks, and structured output (every reply valid, whatever the batch, chunking, preemption
or handoff between engines)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from json_schemas import SCHEMAS

from meshserve.shared.engine import constraints
from meshserve.shared.engine.llm_engine import EngineConfig, LLMEngine, RequestError
from meshserve.shared.engine.scheduler import SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.model.llama import LlamaModel
from meshserve.shared.model.weights import load_hf_dir
from meshserve.shared.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    cfg, sd = load_hf_dir(tiny_llama)
    model = LlamaModel.from_hf(cfg, sd, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    return model, hf, Tokenizer.from_hf_dir(tiny_llama)


def engine(model, tokenizer=None, chunk=512, prefix=True, blocks=1024, block_size=16) -> LLMEngine:
    sched = SchedulerConfig(max_num_batched_tokens=max(chunk, 32), prefill_chunk_size=chunk)
    return LLMEngine(model, EngineConfig(block_size=block_size, num_kv_blocks=blocks, enable_prefix_caching=prefix,
                                         scheduler=sched), tokenizer=tokenizer)


def prompts(vocab: int, lengths=(5, 17, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


class OpenAIPenalties:
    """OpenAI's presence/frequency penalties as a Transformers logits processor (Transformers has
    none): logit - frequency * count - presence * (count > 0), over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.n, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        count = torch.zeros_like(scores)
        gen = input_ids[:, self.n:]
        if gen.shape[1]:
            count.scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
        return scores - self.frequency * count - self.presence * (count > 0)


def hf_generate(hf, prompt: list[int], max_new: int, **kw) -> list[int]:
    from transformers import LogitsProcessorList

    extra = kw.pop("openai", None)
    procs = LogitsProcessorList([OpenAIPenalties(len(prompt), *extra)] if extra else [])
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, eos_token_id=[EOS], pad_token_id=0,
                          logits_processor=procs, **kw)
    return out[0, len(prompt):].tolist()


# (our SamplingParams fields, Transformers' generate() arguments)
CASES = [
    (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    (dict(logit_bias={7: 8.0, 9: -100.0, 11: 5.0}), dict(sequence_bias={(7,): 8.0, (9,): -100.0, (11,): 5.0})),
    (dict(logit_bias={EOS: 100.0}, min_tokens=5), dict(sequence_bias={(EOS,): 100.0}, min_new_tokens=5)),
    (dict(presence_penalty=1.5, frequency_penalty=0.8), dict(openai=(1.5, 0.8))),
    (dict(presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={20: 3.0}),
     dict(openai=(-1.0, 2.0), repetition_penalty=1.3, sequence_bias={(20,): 3.0})),
    (dict(allowed_token_ids=[5, 9, 13, EOS, 40], logit_bias={9: 2.0}),
     dict(prefix_allowed_tokens_fn=lambda batch, ids: [5, 9, 13, EOS, 40], sequence_bias={(9,): 2.0})),
]


def test_processors_match_transformers(tiny):
    """Each processor case on every prompt, all in one batch beside plain greedy rows."""
    model, hf, _ = tiny
    ps = prompts(model.cfg.vocab_size)
    eng = engine(model, chunk=7)
    max_new = 12
    reqs, want = [], []
    for c, (ours, theirs) in enumerate(CASES):
        for i, p in enumerate(ps):
            reqs.append(eng.add_request(f"c{c}-{i}", p, SamplingParams(max_tokens=max_new, temperature=0, **ours)))
            want.append(hf_generate(hf, p, max_new, **theirs))
    plain = [eng.add_request(f"plain{i}", p, SamplingParams(max_tokens=max_new, temperature=0)) for i, p in enumerate(ps)]
    while eng.has_unfinished():
        eng.step()
    for s, w in zip(reqs, want):
        assert s.output_token_ids == w, s.request_id
    for s, p in zip(plain, ps):
        assert s.output_token_ids == hf_generate(hf, p, max_new)
    # the bias changes the output, and min_tokens holds the (biased) EOS back exactly that long
    k = len(ps)
    assert [s.output_token_ids for s in reqs[2 * k:3 * k]] != [s.output_token_ids for s in plain]
    for s in reqs[3 * k:4 * k]:
        assert EOS not in s.output_token_ids[:5] and s.output_token_ids[5:] == [EOS]


def test_bad_words_match_transformers(tiny):
    """vLLM's bad_words against Transformers' `bad_words_ids`: each prompt bans a one-token word
    and a two-token word taken from its own greedy output, so both must change it. (Transformers
    also matches a word across the prompt's end, vLLM and we only in the output: the words are
    chosen so that it cannot.)"""
    model, hf, _ = tiny
    ps = prompts(model.cfg.vocab_size)
    eng = engine(model, chunk=7)
    max_new, runs = 12, []
    for i, p in enumerate(ps):
        plain = hf_generate(hf, p, max_new)
        words = [[plain[6]], [plain[1], plain[2]]]
        assert p[-1] != plain[1] and words[0] != [EOS]
        want = hf_generate(hf, p, max_new, bad_words_ids=words)
        assert want != plain and plain[6] not in want
        runs.append((eng.add_request(f"b{i}", p, SamplingParams(max_tokens=max_new, temperature=0, bad_words=words)),
                     want))
    while eng.has_unfinished():
        eng.step()
    for s, want in runs:
        assert s.output_token_ids == want, s.request_id


def test_bad_processor_values_are_refused(tiny):
    model, _, _ = tiny
    eng = engine(model)
    for params in (SamplingParams(logit_bias={5: 101.0}), SamplingParams(logit_bias={10**6: 1.0}),
                   SamplingParams(repetition_penalty=0), SamplingParams(presence_penalty=3),
                   SamplingParams(max_tokens=4, min_tokens=5), SamplingParams(max_tokens=0),
                   SamplingParams(allowed_token_ids=[]), SamplingParams(allowed_token_ids=[10**6]),
                   SamplingParams(bad_words=[[5], []]), SamplingParams(bad_words=[[-1]])):
        with pytest.raises(RequestError):
            eng.add_request("x", [5, 6], params)


def hf_prompt_logprobs(hf, prompt: list[int], tol: float = 1e-4) -> tuple[torch.Tensor, list[range]]:
    """Each prompt token's logprob after the ones before it, and the ranks it may have there (1:
    the likeliest) when logprobs within `tol` of its own may fall either side."""
    with torch.inference_mode():
        lp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)[:-1]
    own = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].unsqueeze(1)
    lo, hi = ((lp > own + tol).sum(-1) + 1).tolist(), ((lp > own - tol).sum(-1) + 1).tolist()
    return own.squeeze(1), [range(a, b + 1) for a, b in zip(lo, hi)]


@pytest.mark.parametrize("chunk,blocks", [(512, 1024), (7, 1024), (16, 10)])
def test_prompt_logprobs_match_transformers(tiny, chunk, blocks):
    """Every prompt token's logprob (the first None) as Transformers computes it, even when the
    prompt's blocks are in the prefix cache (warmed by a request without logprobs), chunked, or
    preempted (10 blocks of 8 tokens for 3 requests of up to 48 tokens); max_tokens 0 works."""
    model, hf, _ = tiny
    ps = prompts(model.cfg.vocab_size, (5, 33, 40))
    eng = engine(model, chunk=chunk, blocks=blocks, block_size=8)
    warm = eng.add_request("warm", ps[1], SamplingParams(max_tokens=2, temperature=0))
    while eng.has_unfinished():
        eng.step()
    assert sum(eng.block_pool.lookup(k) is not None for k in eng.kv_cache_manager.prefix_keys(ps[1])) >= 4
    outs = {}
    seqs = [eng.add_request(f"p{i}", p, SamplingParams(max_tokens=m, temperature=0, prompt_logprobs=2))
            for i, (p, m) in enumerate(zip(ps, (0, 8, 8)))]
    while eng.has_unfinished():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in outs, "prompt logprobs come once, with the first output"
                outs[o.request_id] = o
    for s, p in zip(seqs, ps):
        o = outs[s.request_id]
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        got = torch.tensor([lp.logprob for lp in o.prompt_logprobs[1:]])
        want, ranks = hf_prompt_logprobs(hf, p)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert all(lp.rank in r for lp, r in zip(o.prompt_logprobs[1:], ranks))
        assert max(lp.rank for lp in o.prompt_logprobs[1:]) > 1
        assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in o.prompt_logprobs[1:])
        assert o.num_cached_tokens == 0  # computed, not taken from the cache
    assert outs["p0"].finished and outs["p0"].new_token_ids == [] and outs["p0"].finish_reason == "length"


def test_n_siblings_share_the_prompt(tiny):
    """Three choices of one 40-token prompt: the second and third wait for the first's prompt and
    find its two full blocks in the prefix cache (they compute 8 tokens each, not 40); each
    choice's seeded stream is the one it has alone."""
    model, _, _ = tiny
    p = prompts(model.cfg.vocab_size, (40,))[0]
    alone = []
    for i in range(3):
        eng = engine(model)
        s = eng.add_request("a", p, SamplingParams(max_tokens=10, seed=7 + i))
        while eng.has_unfinished():
            eng.step()
        alone.append(s.output_token_ids)
    eng = engine(model)
    computed = []
    run = eng.runner.run
    eng.runner.run = lambda batch, *rest: computed.append(sum(n for s, n in zip(batch.seqs, batch.num_tokens)
                                                              if s.num_computed_tokens < s.num_prompt_tokens)) \
        or run(batch, *rest)
    seqs = [eng.add_request("r0", p, SamplingParams(max_tokens=10, seed=7))]
    seqs += [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=10, seed=7 + i), after="r0") for i in (1, 2)]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in seqs] == alone
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32]
    assert sum(computed) == 40 + 8 + 8


def test_structured_outputs_in_one_batch(tiny):
    """Every schema's reply parses and validates, greedy and sampled, beside unconstrained requests,
    with chunked prefill; plus regex, choice, a Lark grammar and json_object."""
    model, _, tok = tiny
    eng = engine(model, tokenizer=tok, chunk=7)
    prompt = tok.encode("Give me JSON: ")
    seqs = []
    for i, schema in enumerate(SCHEMAS):
        sp = SamplingParams(max_tokens=120, temperature=0 if i % 2 else 1.0, seed=i,
                            constraint=("json_schema", json.dumps(schema)))
        seqs.append((eng.add_request(f"s{i}", prompt, sp), schema))
    others = {"regex": (r"[a-c]{2,4}-[0-9]", r"[a-c]{2,4}-[0-9]"), "choice": (json.dumps(["yes", "no"]), "yes|no"),
              "grammar": ('start: "(" num ("+" num)* ")"\nnum: /[0-9]/', r"\([0-9](\+[0-9])*\)")}
    special = {k: eng.add_request(k, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                            constraint=(k, spec))) for k, (spec, _) in others.items()}
    # Any object: its keys are free strings, which a random model rarely closes; a bias towards the
    # quote and brace tokens (composed with the mask) ends it soon.
    close = {t: 6.0 for t in range(tok.vocab_size) if set(tok.decode([t])) & set('"}')}
    obj = eng.add_request("obj", prompt, SamplingParams(max_tokens=120, temperature=0, logit_bias=close,
                                                        constraint=("json_object", "")))
    free = [eng.add_request(f"free{i}", prompt, SamplingParams(max_tokens=20, temperature=0)) for i in range(3)]
    while eng.has_unfinished():
        eng.step()
    for s, schema in seqs:
        assert s.finish_reason == "stop", s.request_id
        jsonschema.validate(json.loads(tok.decode(s.output_token_ids)), schema)
    import re

    for k, s in special.items():
        assert s.finish_reason == "stop" and re.fullmatch(others[k][1], tok.decode(s.output_token_ids)), k
    assert isinstance(json.loads(tok.decode(obj.output_token_ids)), dict)
    assert all(s.num_output_tokens == 20 for s in free)


def test_structured_output_survives_preemption_and_handoff(tiny):
    """A pool too small for all (preemption by recompute), then the sequences move to a second engine
    halfway (the grammar is rebuilt there from their tokens), and every reply is still valid."""
    model, _, tok = tiny
    prompt = tok.encode("Give me JSON: ")
    first = engine(model, tokenizer=tok, blocks=24, block_size=4)
    schemas = SCHEMAS[:8]
    for i, schema in enumerate(schemas):
        first.add_request(f"s{i}", prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                          constraint=("json_schema", json.dumps(schema))))
    for _ in range(12):
        first.step()
    assert first.scheduler.num_preemptions > 0
    second = engine(model, tokenizer=tok)
    moved = []
    for rid, seq in list(first.requests.items()):  # re-dispatch: recomputed there, continued
        moved.append((second.add_request(rid, seq.prompt_token_ids, seq.params,
                                         output_token_ids=seq.output_token_ids), schemas[int(rid[1:])]))
        first.abort(rid)
    assert moved
    while second.has_unfinished():
        second.step()
    for s, schema in moved:
        jsonschema.validate(json.loads(tok.decode(s.output_token_ids)), schema)


def test_invalid_constraints_are_refused(tiny):
    model, _, tok = tiny
    for kind, spec in (("json_schema", '{"type": "strin"}'), ("json_schema", "[1]"), ("regex", "[a-"),
                       ("choice", "[]"), ("grammar", "start: (")):
        with pytest.raises(constraints.ConstraintError):
            constraints.check(kind, spec)
        with pytest.raises(RequestError, match=kind):
            engine(model, tokenizer=tok).add_request("x", [5], SamplingParams(constraint=(kind, spec)))
    with pytest.raises(RequestError, match="tokenizer"):
        engine(model).add_request("x", [5], SamplingParams(constraint=("json_object", "")))
