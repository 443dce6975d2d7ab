"""The reasoning parsers (shared/reasoning.py): a whole output and the same output in pieces of any
size split the same way, tags cut between pieces included; qwen3 reads reasoning only after an
opening <think>, deepseek_r1 from the start until </think>."""

from __future__ import annotations

import pytest

from meshserve.shared.reasoning import ReasoningParser

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
