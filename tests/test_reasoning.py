"""The reasoning parsers (shared/reasoning.py): a whole output and the same output in pieces of any
size split the same way, tags cut between pieces included; qwen3 reads reasoning only after an
opening <think>, deepseek_r1 from the start until </think>; the prompt's end has the first word.
And structured output through the engine starts after the reasoning."""

from __future__ import annotations

import re

import pytest

from meshserve.shared.reasoning import CLOSED, END, OPEN, START, ReasoningParser, constraint_tags, prompt_state
from tiny_model import CHAT_TEMPLATE, make_tiny_llama


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    """A tiny random model whose tokenizer has <think> and </think> as one token each, as Qwen3's."""
    return make_tiny_llama(tmp_path_factory.mktemp("think") / "model", added_tokens=(START, END))

CASES = {
    # output: (qwen3's (reasoning, answer), deepseek_r1's)
    "<think>\nweigh it </th no</think>\n\nthe answer </think>": (("\nweigh it </th no", "\n\nthe answer </think>"),
                                                               ("\nweigh it </th no", "\n\nthe answer </think>")),
    "  <think>r</think>a": (("r", "a"), ("r", "a")),
    "an answer <think>x</think>": ((None, "an answer <think>x</think>"), ("an answer <think>x", "")),
    "reasoning</think>answer": ((None, "reasoning</think>answer"), ("reasoning", "answer")),
    "<think>cut short by max_tokens": (("cut short by max_tokens", ""), ("cut short by max_tokens", "")),
    "<thi": ((None, "<thi"), ("<thi", "")),
    "": ((None, ""), ("", "")),
}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("output", list(CASES))
def test_pieces_of_any_size_split_as_the_whole(name, output):
    want = CASES[output][0 if name == "qwen3" else 1]
    assert ReasoningParser(name).split(output) == want
    for size in range(1, len(output) + 1):
        p, reasoning, answer = ReasoningParser(name), "", ""
        for i in range(0, len(output), size):
            r, a = p.feed(output[i:i + size])
            reasoning, answer = reasoning + r, answer + a
        r, a = p.finish()
        assert (reasoning + r, answer + a) == (want[0] or "", want[1]), size


def test_reasoning_goes_out_before_its_end_tag_arrives():
    """A stream shows the reasoning as it comes, holding back only what may begin a tag."""
    p = ReasoningParser("qwen3")
    assert p.feed("<think>first") == ("first", "")
    assert p.feed(" then </thi") == (" then ", "")
    assert p.feed("nk>done") == ("", "done")


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("granite")


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_the_prompt_has_the_first_word(name):
    """A prompt that ends inside <think> starts the output in reasoning (Qwen3-Thinking's template:
    only </think> comes out); one that ends with </think> (thinking off) starts it in the answer."""
    assert ReasoningParser(name, OPEN).split("weigh it</think>yes") == ("weigh it", "yes")
    assert ReasoningParser(name, OPEN).split("<think>weigh it</think>yes") == ("weigh it", "yes")
    assert ReasoningParser(name, OPEN).split("cut short") == ("cut short", "")
    assert ReasoningParser(name, CLOSED).split("<think>x</think>y") == (None, "<think>x</think>y")


def test_prompt_state_and_constraint_tags(think_model):
    """The engine's tags of a constrained answer follow the prompt and the parser; a tokenizer that
    splits <think> cannot offer it beside a grammar, so qwen3 then constrains from the first token."""
    from meshserve.shared.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(think_model)
    s, e = tok.encode(START, add_special_tokens=False), tok.encode(END, add_special_tokens=False)
    assert len(s) == len(e) == 1
    ids = tok.encode("<|im_start|>assistant\n")
    assert [prompt_state(tok, ids + tok.encode(x)) for x in ("<think>\n", "<think>\n\n</think>\n\n", "hi")] == \
        [OPEN, CLOSED, None]
    assert constraint_tags("qwen3", None, tok) == {"reasoning_end": e, "reasoning_start": s}
    assert constraint_tags("qwen3", OPEN, tok) == constraint_tags("deepseek_r1", None, tok) == {"reasoning_end": e}
    assert constraint_tags("deepseek_r1", CLOSED, tok) == constraint_tags(None, OPEN, tok) == {}
    split = Tokenizer.from_hf_dir(make_tiny_llama(think_model.parent / "plain"))
    assert len(split.encode(START, add_special_tokens=False)) > 1 and constraint_tags("qwen3", None, split) == {}


def test_structured_output_starts_after_the_reasoning(think_model):
    """The constraint leaves the reasoning free and holds from the token after </think>: greedy
    output, with and without prompt lookup, equals the reasoning's tokens followed by the
    constrained output of the prompt that ends with them. With an optional opening tag (qwen3), the
    first token may be <think>, and an output that opens otherwise is constrained at once."""
    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.llm_engine import EngineConfig
    from meshserve.shared.engine.sequence import SamplingParams
    from meshserve.shared.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, disable_by_batch_size=64)
    plain, fast = LLM(str(think_model), "float32"), LLM(str(think_model), "float32", EngineConfig(speculative=spec))
    tok = plain.tokenizer
    (s,), (e,) = tok.encode(START, add_special_tokens=False), tok.encode(END, add_special_tokens=False)
    words = tok.encode("the quick brown fox ")
    prompt = (words + [s, e]) * 3 + words  # prompt lookup proposes across </think>
    rx = ("regex", "(the quick brown )+fox")

    def params(**kw):
        return SamplingParams(**{"max_tokens": 16, "temperature": 0, **kw})

    free = plain.generate([prompt], params())[0].token_ids
    assert e not in free and s not in free[:1]
    cases = {  # name: (params, what the output must be)
        "ended": (params(constraint=rx, reasoning_end=[e], logit_bias={e: 100}),
                  lambda: [e] + plain.generate([prompt + [e]], params(max_tokens=15, constraint=rx))[0].token_ids),
        "reasoning": (params(constraint=rx, reasoning_end=[e]), lambda: free),
        "opened": (params(constraint=rx, reasoning_end=[e], reasoning_start=[s], logit_bias={s: 90, e: 100}),
                   lambda: [s, e] + plain.generate([prompt + [s, e]], params(max_tokens=14, constraint=rx))[0].token_ids),
        "not opened": (params(constraint=rx, reasoning_end=[e], reasoning_start=[s], logit_bias={s: -100}),
                       lambda: plain.generate([prompt], params(constraint=rx))[0].token_ids),
    }
    for llm in (plain, fast):
        got = llm.generate([prompt] * len(cases), [p for p, _ in cases.values()])
        for name, (_, want), g in zip(cases, cases.values(), got):
            assert g.token_ids == want(), (name, llm is fast)
    answer = tok.decode(got[0].token_ids[1:])
    assert re.fullmatch(r"(the quick brown )+fox", answer) or ("the quick brown " * 8).startswith(answer), answer
    assert fast.engine.stats["spec_decode"]["num_accepted_tokens"] > 0


# Qwen3's way: thinking on by default; enable_thinking: false closes it in the prompt
QWEN3_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")


def test_a_reasoning_models_answer_is_constrained_through_the_mesh(tmp_path_factory):
    """`--reasoning-parser qwen3` through the gateway: the response format holds for the answer
    after the reasoning, which is free (here forced to open and close at once by logit_bias, a
    random model having no thoughts); with enable_thinking: false the prompt closes the reasoning
    and the format holds from the first token. Whole and streamed alike."""
    from openai import OpenAI

    from mesh_util import Mesh
    from meshserve.shared.tokenizer import Tokenizer

    tmp = tmp_path_factory.mktemp("think-mesh")
    model = make_tiny_llama(tmp / "model", added_tokens=(START, END), chat_template=QWEN3_TEMPLATE)
    tok = Tokenizer.from_hf_dir(model)
    (s,), (e,) = tok.encode(START, add_special_tokens=False), tok.encode(END, add_special_tokens=False)
    with Mesh(model, tmp, prefill=0, decode=1, extra=["--reasoning-parser", "qwen3"]) as m:
        c = OpenAI(base_url=m.url + "/v1", api_key="unused")
        body = dict(model=m.model, messages=[{"role": "user", "content": "Say it"}], max_tokens=12, temperature=0,
                    logit_bias={str(s): 90, str(e): 100}, extra_body={"guided_regex": "(the quick brown )+fox"})

        def answers(**extra) -> tuple[dict, tuple[str, str]]:
            kw = {**body, "extra_body": {**body["extra_body"], **extra}}
            message = c.chat.completions.create(**kw).choices[0].message
            reasoning, content = "", ""
            for chunk in c.chat.completions.create(**kw, stream=True):
                for ch in chunk.choices:
                    reasoning += ch.delta.model_extra.get("reasoning_content") or ""
                    content += ch.delta.content or ""
            return message, (reasoning, content)

        def in_format(text: str) -> bool:
            return bool(re.fullmatch(r"(the quick brown )+fox", text)) or ("the quick brown " * 4).startswith(text)

        thought, streamed = answers()
        assert thought.model_extra["reasoning_content"] == "" and thought.content and in_format(thought.content)
        assert streamed == ("", thought.content)
        closed, streamed = answers(chat_template_kwargs={"enable_thinking": False})
        assert "reasoning_content" not in (closed.model_extra or {}) and in_format(closed.content)
        assert streamed == ("", closed.content)
