"""Tool calling in chat completions: the constraint that forces a call, and reading calls back.

- `tool_choice: "required"`: the output is a JSON array of calls, `[{"name": ..., "parameters":
  {...}}]` (one call unless `parallel_tool_calls`), each item a declared function with arguments
  that match its parameter schema: the grammar (constraints.py) allows nothing else.
- a named function: the output is that function's arguments, a JSON object matching its schema.
- `"auto"`: the model writes what it wants; calls in its own format are read back: Hermes-style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5, Hermes, SmolLM3 ...).
  Text outside them is the message's content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class AutoParser:
    """Reads a streamed "auto" output: content goes on as it comes, except a tail that could be the
    start of `<tool_call>`; once a call opens, the rest is held and read at the end."""

    def __init__(self):
        self.text = ""
        self.emitted = 0  # of text, handed out as content
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """The content that is safe to send now."""
        self.text += delta
        if self.in_calls:
            return ""
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

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls). Calls that do not parse stay content."""
        if not self.in_calls:
            rest, self.emitted = self.text[self.emitted:], len(self.text)
            return rest, []
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


def parse_auto(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole "auto" output."""
    p = AutoParser()
    head = p.feed(text)
    rest, calls = p.finish()
    content = head + rest
    return (content.strip() if calls else content), calls


def read_calls(mode: str, text: str, named: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole chat output under tool_choice mode ("none", "auto", "required",
    "named" with the function's name)."""
    if mode == "named":
        return None, [ToolCall(named, text)]
    if mode == "required":
        calls = parse_required(text)
        return (None if calls else text), calls
    if mode == "auto":
        content, calls = parse_auto(text)
        return (content or None) if calls else content, calls
    return text, []
