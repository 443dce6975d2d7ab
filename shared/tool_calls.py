"""Tool calling in chat completions: the constraint that forces a call, and reading calls back.

- `tool_choice: "required"`: the output is a JSON array of calls, `[{"name": ..., "parameters":
  {...}}]` (one call unless `parallel_tool_calls`), each item a declared function with arguments
  that match its parameter schema: the grammar (constraints.py) allows nothing else.
- a named function: the output is that function's arguments, a JSON object matching its schema.
- `"auto"`: the model writes what it wants; calls in its own format are read back (vLLM's
  `--tool-call-parser`, per model): `hermes` (the default), `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (Qwen 2.5 and 3, Hermes, SmolLM3 ...), text outside them the message's
  content; `llama3_json` (Llama 3.1-3.3), an answer that is one or more JSON objects `{"name": ...,
  "parameters": {...}}` (separated by `;`), after the `<|python_tag|>` the detokenizer drops;
  `mistral` (Mistral's v3 tokenizer format), an answer that is a JSON array of `{"name": ...,
  "arguments": {...}}`, after the `[TOOL_CALLS]` the detokenizer drops; `pythonic` (Llama 3.2
  and 4, ToolACE ...), an answer that is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Paris", days=2)]`, read by `ast`, never evaluated.
  The last three: an answer that opens otherwise, or does not read as calls, is content.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
MISTRAL_TAG = "[TOOL_CALLS]"  # kept when the request asks for special tokens
DEFAULT_PARSER = "hermes"


def add_tool_call_parser_argument(parser) -> None:
    """The gateway's (and `meshserve up`'s and `batch`'s) --tool-call-parser."""
    parser.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                        help="how tool calls are read from an answer under tool_choice auto (vLLM's; "
                             "docs/openai-api.md): for --model, and the manifest's models that name none "
                             "(default: hermes)")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of the output under tool_choice "required"."""
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict], name: str) -> dict:
    """The JSON schema of the output under a named tool_choice: the function's arguments."""
    for t in tools:
        if t["function"]["name"] == name:
            return _parameters(t)
    raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")


def parse_required(text: str) -> list[ToolCall]:
    """Calls from a "required" output (the grammar made it valid; a cut-off one gives none)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def _hermes_call(body: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_of(obj) -> ToolCall | None:
    """A call from `{"name": ..., "arguments" or "parameters": {...}}`; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls of a llama3_json answer: JSON objects with a name, separated by `;` or
    whitespace; None when it is anything else (then it is content)."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = _call_of(obj)
        if call is None:
            return None
        calls.append(call)


def _mistral_calls(text: str) -> list[ToolCall] | None:
    """The calls of a mistral answer: one JSON array of call objects (or one object); None otherwise."""
    text = text.strip().removeprefix(MISTRAL_TAG)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call_of(c) for c in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else None


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls of a pythonic answer: a list of `name(key=literal, ...)`; None otherwise. Only
    literals are read (ast.literal_eval): nothing the model wrote is run."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


# The parsers whose calls are the whole answer: the character such an answer opens with, and its reader.
WHOLE_ANSWER = {"llama3_json": ("{", _llama3_calls), "mistral": ("[", _mistral_calls), "pythonic": ("[", _pythonic_calls)}


class AutoParser:
    """Reads a streamed "auto" output: content goes on as it comes, except a tail that could be the
    start of a call (hermes: `<tool_call>`; the others: an answer whose first non-blank character
    opens their calls, WHOLE_ANSWER); once a call opens, the rest is held and read at the end."""

    def __init__(self, parser: str | None = None, parallel: bool = True):
        """parallel: the request's parallel_tool_calls; false keeps only an answer's first call (as
        vLLM does: the model's answer is not cut, the calls after the first are dropped)."""
        self.parser, self.parallel = parser or DEFAULT_PARSER, parallel
        if self.parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {self.parser!r}; known: {', '.join(PARSERS)}")
        self.text = ""
        self.emitted = 0  # of text, handed out as content
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """The content that is safe to send now."""
        self.text += delta
        if self.in_calls:
            return ""
        if self.parser in WHOLE_ANSWER:
            return self._feed_whole()
        at = self.text.find(OPEN, self.emitted)
        if at >= 0:
            self.in_calls = True
            end = at
        else:
            end = len(self.text)
            for k in range(min(len(OPEN) - 1, end - self.emitted), 0, -1):
                if self.text.endswith(OPEN[:k]):
                    end -= k
                    break
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _feed_whole(self) -> str:
        if self.emitted == 0:
            head = self.text.lstrip()
            opening = WHOLE_ANSWER[self.parser][0]
            if self.parser == "mistral" and MISTRAL_TAG.startswith(head[:len(MISTRAL_TAG)]):
                head = head[len(MISTRAL_TAG):] if head.startswith(MISTRAL_TAG) else ""
            if not head:
                return ""  # blank so far: it may still open a call
            if head.startswith(opening):
                self.in_calls = True
                return ""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls). Calls that do not parse stay content."""
        rest, calls = self._finish()
        return rest, calls if self.parallel else calls[:1]

    def _finish(self) -> tuple[str, list[ToolCall]]:
        if not self.in_calls:
            rest, self.emitted = self.text[self.emitted:], len(self.text)
            return rest, []
        if self.parser in WHOLE_ANSWER:
            calls = WHOLE_ANSWER[self.parser][1](self.text)
            self.emitted = len(self.text)
            return ("", calls) if calls else (self.text, [])
        calls, content, pos = [], "", self.emitted
        while True:
            at = self.text.find(OPEN, pos)
            if at < 0:
                content += self.text[pos:]
                break
            content += self.text[pos:at]
            end = self.text.find(CLOSE, at)
            body = self.text[at + len(OPEN):end if end >= 0 else len(self.text)]
            call = _hermes_call(body.strip())
            if call is None:
                content += self.text[at:end + len(CLOSE) if end >= 0 else len(self.text)]
            else:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(CLOSE)
        self.emitted = len(self.text)
        return (content.strip() if calls else content), calls


def parse_auto(text: str, parser: str | None = None, parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole "auto" output."""
    p = AutoParser(parser, parallel)
    head = p.feed(text)
    rest, calls = p.finish()
    content = head + rest
    return (content.strip() if calls else content), calls


def read_calls(mode: str, text: str, named: str | None = None, parser: str | None = None,
               parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole chat output under tool_choice mode ("none", "auto", "required",
    "named" with the function's name); parser: how "auto" reads them (PARSERS; None: hermes);
    parallel: parallel_tool_calls ("required"'s grammar allows one call without it)."""
    if mode == "named":
        return None, [ToolCall(named, text)]
    if mode == "required":
        calls = parse_required(text)
        return (None if calls else text), calls
    if mode == "auto":
        content, calls = parse_auto(text, parser, parallel)
        return (content or None) if calls else content, calls
    return text, []
