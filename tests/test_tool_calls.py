"""Reading tool calls back (shared/tool_calls.py): Hermes-style blocks in a whole or streamed output,
and the forced formats' schemas; the model-driven paths are in test_request_options_mesh.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshserve.shared import tool_calls

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "g"}}]


def test_auto_reads_hermes_calls_whole_and_streamed():
    text = ('Let me check. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = tool_calls.parse_auto(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}),
                                                                                               ("g", {})]
    # streamed in pieces that split the opening tag: content never shows a piece of it
    p, shown = tool_calls.AutoParser(), ""
    for i in range(0, len(text), 3):
        shown += p.feed(text[i:i + 3])
        assert "<" not in shown
    rest, streamed = p.finish()
    assert (shown + rest).strip() == "Let me check." and [c.name for c in streamed] == ["f", "g"]


def test_auto_leaves_text_without_valid_calls_alone():
    for text in ("no calls here < not a tag", "<tool_call>{not json}</tool_call> tail", "<tool_"):
        content, calls = tool_calls.parse_auto(text)
        assert calls == [] and content == text


def test_forced_formats():
    schema = tool_calls.required_schema(TOOLS, parallel=False)
    out = '[{"name": "f", "parameters": {"x": 3}}]'
    jsonschema.validate(json.loads(out), schema)
    assert [(c.name, c.arguments) for c in tool_calls.parse_required(out)] == [("f", '{"x": 3}')]
    bad = json.loads('[{"name": "f", "parameters": {"x": 3}}, {"name": "g", "parameters": {}}]')
    try:
        jsonschema.validate(bad, schema)
        raise AssertionError("two calls without parallel_tool_calls")
    except jsonschema.ValidationError:
        pass
    jsonschema.validate(bad, tool_calls.required_schema(TOOLS, parallel=True))
    assert tool_calls.named_schema(TOOLS, "f") == TOOLS[0]["function"]["parameters"]
    content, calls = tool_calls.read_calls("named", '{"x": 5}', "f")
    assert content is None and calls[0].openai(0)["function"] == {"name": "f", "arguments": '{"x": 5}'}


def test_llama3_json_reads_an_answer_of_json_calls_whole_and_streamed():
    """`--tool-call-parser llama3_json`: an answer whose first non-blank character is `{` is held
    and read as calls (several separated by `;`); anything else streams as content at once; a held
    answer that is not calls comes back whole as content."""
    text = ' \n{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}'
    content, calls = tool_calls.parse_auto(text, "llama3_json")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    for size in (1, 4, len(text)):
        p, shown = tool_calls.AutoParser("llama3_json"), ""
        for i in range(0, len(text), size):
            shown += p.feed(text[i:i + size])
        rest, streamed = p.finish()
        assert shown + rest == "" and [c.name for c in streamed] == ["f", "g"]
    p = tool_calls.AutoParser("llama3_json")
    assert p.feed("Sure") == "Sure" and p.feed(' {"name": "f"}') == ' {"name": "f"}'  # text first: content
    assert p.finish() == ("", [])
    for text in ('{"nam": 1}', "{not json", '{"name": "f", "parameters": {}} and more words'):
        assert tool_calls.parse_auto(text, "llama3_json") == (text, [])
    content, calls = tool_calls.read_calls("auto", '{"name": "f", "parameters": {"x": 2}}', parser="llama3_json")
    assert content is None and calls[0].name == "f"
    # hermes (the default) reads no such calls
    assert tool_calls.read_calls("auto", '{"name": "f", "parameters": {"x": 2}}')[1] == []


@pytest.mark.parametrize("parser,text", [
    ("mistral", ' [TOOL_CALLS][{"name": "f", "arguments": {"x": 1, "s": "a"}}, {"name": "g", "arguments": {}}]'),
    ("mistral", '[{"name": "f", "arguments": {"x": 1, "s": "a"}}, {"name": "g", "arguments": {}}]'),
    ("pythonic", '\n[f(x=1, s="a"), g()]'),
])
def test_mistral_and_pythonic_read_an_answer_of_calls_whole_and_streamed(parser, text):
    """`mistral` (a JSON array after [TOOL_CALLS], which the detokenizer usually drops) and
    `pythonic` (a Python list of calls with literal keyword arguments): held from an opening `[`,
    read at the end, in pieces of any size as whole."""
    want = [("f", {"x": 1, "s": "a"}), ("g", {})]
    content, calls = tool_calls.parse_auto(text, parser)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == want
    for size in range(1, len(text) + 1):
        p, shown = tool_calls.AutoParser(parser), ""
        for i in range(0, len(text), size):
            shown += p.feed(text[i:i + size])
        rest, streamed = p.finish()
        assert shown + rest == "" and [(c.name, json.loads(c.arguments)) for c in streamed] == want, size


@pytest.mark.parametrize("parser", ["mistral", "pythonic"])
def test_an_answer_that_is_not_calls_is_content(parser):
    """Text first streams at once; an opening `[` that does not read as calls comes back whole as
    content; pythonic runs nothing (a call in an argument, a name, an attribute are not literals)."""
    p = tool_calls.AutoParser(parser)
    assert p.feed("See") == "See" and p.feed(" [1]") == " [1]" and p.finish() == ("", [])
    for text in ("[1, 2]", "[link](http://x)", "[]", '[{"nam": 1}]', "[f(1)]", "[f(x=__import__('os'))]",
                 "[f(x=y)]", "[os.system(x='ls')]", "[f(**k)]"):
        assert tool_calls.parse_auto(text, parser) == (text, []), text


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
               '</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'),
    ("pythonic", "[f(x=1), g()]"),
])
def test_parallel_tool_calls_false_keeps_the_first_call(parser, text):
    """parallel_tool_calls: false under auto returns an answer's first call only, whole and streamed."""
    assert [c.name for c in tool_calls.read_calls("auto", text, parser=parser)[1]] == ["f", "g"]
    content, calls = tool_calls.read_calls("auto", text, parser=parser, parallel=False)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    p = tool_calls.AutoParser(parser, parallel=False)
    assert p.feed(text) == "" and [c.name for c in p.finish()[1]] == ["f"]
