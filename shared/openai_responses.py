"""The OpenAI Responses API (`/v1/responses`) as a translation onto chat completions.

A Responses request becomes a chat completions body (its input as messages, `instructions` as the
system message, `max_output_tokens` as `max_completion_tokens`, `text.format` as `response_format`);
the gateway runs that through the chat path, and the chat response or chunks are turned back into
a Response object or the Responses streaming events. So the two endpoints share validation,
sampling and generation, and differ only in their framing.

Function tools are chat's tools: a Responses function tool becomes a chat tool, `function_call` and
`function_call_output` input items the assistant's tool calls and the tools' answers, and the chat
answer's tool calls `function_call` output items.

Fields are in three groups (docs/openai-api.md lists them): translated, inert (accepted, they
change nothing here: `user`, `metadata`, ...), and refused with a 400 naming them (hosted tools,
`previous_response_id`, `store: true`, ...): nothing that would change the output is ignored.
Any other field is passed on to the chat request, so the chat sampling options (`top_k`, `seed`,
`stop`, `priority`, ...) work here too and are refused there when they are not honoured.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .openai_protocol import OpenAIError

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Chat fields that the Responses API names otherwise (or not at all): a client sending one here
# means something we would not do, so it is told what to send instead.
CHAT_ONLY = {
    "messages": "send the conversation as `input`",
    "max_tokens": "use `max_output_tokens`",
    "max_completion_tokens": "use `max_output_tokens`",
    "response_format": "use `text.format`",
    "logprobs": f"use `top_logprobs` and `include: [\"{LOGPROBS_INCLUDE}\"]`",
    "n": "the Responses API makes one output; use /v1/chat/completions for several",
    "prompt_logprobs": "a Response has no place for them; use /v1/chat/completions",
    "return_token_ids": "a Response has no place for them; use /v1/chat/completions",
    "return_tokens_as_token_ids": "use /v1/chat/completions",
    "request_id": "a Response's id is its own; use /v1/chat/completions",
}


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are supported (input_text, output_text)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="input_text or output_text (images, files and audio are refused)")
    text: str | None = None


class InputItem(BaseModel):
    """An input item: a message; a function call the model made before (`function_call`) and its
    result (`function_call_output`); the model's earlier reasoning (`reasoning`). Other item types
    are refused."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(default="message", description="message, function_call, function_call_output or reasoning")
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call and function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output


class FunctionTool(BaseModel):
    """A Responses function tool (the only kind: hosted tools are refused)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesStreamOptions(BaseModel):
    include_obfuscation: bool | None = None  # inert: we send no obfuscation padding


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. Other fields are passed on to the chat request."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (FunctionTool); hosted ones are refused
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required or {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    # refused when they ask for something (see _refuse)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    store: bool | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    # inert: accepted, they change nothing here
    max_tool_calls: int | None = None  # of hosted tools, which this server has none of
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


INERT = ("max_tool_calls", "metadata", "user", "safety_identifier", "service_tier",
         "prompt_cache_key", "prompt_cache_retention", "stream_options", "store (false)", "truncation (disabled)")
REFUSED = ("tools (but function tools)", "tool_choice (but none, auto, required or a function)", "previous_response_id",
           "conversation", "prompt", "reasoning (but effort)", "truncation (auto)", "background (true)", "store (true)",
           "context_management", "moderation", "include (anything but message.output_text.logprobs)",
           "text.verbosity", *CHAT_ONLY)


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validates a body; raises OpenAIError(400) naming the field that is wrong or not honoured."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise OpenAIError(f"{param + ': ' if param else ''}{err['msg']}", param=param) from None
    _refuse(req)
    return req


def _refuse(req: ResponsesRequest) -> None:
    def no(param: str, why: str) -> OpenAIError:
        return OpenAIError(f"{param}: {why}", param=param)

    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise no(f"tools.{i}.type", f"only function tools are supported, not {tool.get('type')!r} "
                                         "(this server runs no hosted tools)")
        try:
            FunctionTool.model_validate(tool)
        except ValidationError as e:
            err = e.errors()[0]
            raise no(".".join(str(x) for x in (f"tools.{i}", *err.get("loc", ()))), err["msg"]) from None
    if isinstance(req.tool_choice, dict) and (req.tool_choice.get("type") != "function" or
                                              not isinstance(req.tool_choice.get("name"), str)):
        raise no("tool_choice", "a choice of a tool must be {\"type\": \"function\", \"name\": ...}")
    if isinstance(req.tool_choice, str) and req.tool_choice not in ("none", "auto", "required"):
        raise no("tool_choice", "one of none, auto, required, or a function")
    for name in ("previous_response_id", "conversation", "prompt", "context_management", "moderation"):
        if getattr(req, name):
            raise no(name, "not supported: this server keeps no responses, conversations or prompts; "
                           "send the whole conversation as `input`")
    if req.reasoning and any(v is not None for k, v in req.reasoning.items() if k != "effort"):
        raise no("reasoning", "only reasoning.effort is supported (for a chat template that reads reasoning_effort)")
    if req.truncation == "auto":
        raise no("truncation", "only 'disabled' is supported (a too-long input is a 400)")
    if req.background:
        raise no("background", "background responses are not supported")
    if req.store:
        raise no("store", "responses are not stored here (nothing can retrieve them); send store: false")
    for x in req.include or []:
        if x != LOGPROBS_INCLUDE:
            raise no("include", f"only {LOGPROBS_INCLUDE!r} is supported, not {x!r}")
    if req.text is not None and req.text.verbosity is not None:
        raise no("text.verbosity", "not supported")
    extra = req.model_extra or {}
    for name, hint in CHAT_ONLY.items():
        if name in extra and not (name == "n" and extra[name] == 1):
            raise no(name, f"not a Responses API field; {hint}")


def _text(parts: str | list[ContentPart] | None, param: str, types: tuple[str, ...]) -> str:
    """A content's text: a string, or text parts of these types (others are refused, naming them)."""
    if not isinstance(parts, list):
        return parts or ""
    for j, part in enumerate(parts):
        if part.type not in types or part.text is None:
            raise OpenAIError(f"{param}.{j}: content of type {part.type!r} is not supported (only "
                              f"{' and '.join(types)})", param=f"{param}.{j}.type")
    return "".join(p.text for p in parts)


def _messages(req: ResponsesRequest) -> list[dict]:
    """The input as chat messages: a run of function_call items is one assistant message's tool
    calls (joining the assistant's text message just before it), a function_call_output a tool
    message, a reasoning item the next assistant message's reasoning_content (templates that keep
    reasoning read it there)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise OpenAIError("input: must not be empty", param="input")
    thought: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        if item.type == "reasoning":
            thought = (thought or "") + _text(item.content, f"{where}.content", ("reasoning_text",))
            continue
        if item.type == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise OpenAIError(f"{where}: a function_call needs call_id, name and arguments", param=where)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or thought is not None:
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            if not item.call_id:
                raise OpenAIError(f"{where}.call_id: a function_call_output needs the call's call_id",
                                  param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{where}.output", ("input_text", "output_text"))})
            continue
        elif item.type == "message":
            if item.role is None:
                raise OpenAIError(f"{where}.role: a message needs a role", param=f"{where}.role")
            messages.append({"role": item.role,
                             "content": _text(item.content, f"{where}.content", ("input_text", "output_text"))})
        else:
            raise OpenAIError(f"{where}.type: items of type {item.type!r} are not supported (only message, "
                              "function_call, function_call_output and reasoning)", param=f"{where}.type")
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thought = thought, None
    if thought is not None:
        raise OpenAIError("input: a reasoning item must come before the assistant's message or function call it "
                          "led to", param="input")
    return messages


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completions body that produces this response (always streamed, with usage: the
    gateway turns the chunks into events, or collects them into one Response)."""
    body = {k: v for k, v in (req.model_extra or {}).items() if k != "n"}  # the chat sampling options
    body |= {"messages": _messages(req), "stream": True, "stream_options": {"include_usage": True}}
    if req.model is not None:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [FunctionTool.model_validate(t).chat() for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice["name"]}}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if (req.reasoning or {}).get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if wants_logprobs(req):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {k: v for k, v in (("name", fmt.name), ("schema", fmt.schema_), ("strict", fmt.strict),
                                     ("description", fmt.description)) if v is not None}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


# -- the response and its events


def response_usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def output_text(text: str, logprobs: list[dict] | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, status: str, call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, status: str, text: str) -> dict:
    """A model's reasoning (its reasoning parser's, docs/openai-api.md), as OpenAI returns an open
    model's: the text whole, no summary."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}


def status_of(finish_reason: str | None) -> str:
    """A chat finish_reason as a Response status ('length' is OpenAI's max_output_tokens)."""
    return STATUS.get(finish_reason or "stop", "completed")


def response_object(rid: str, created_at: int, req: ResponsesRequest, model: str, status: str,
                    output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
    """A Response; the request's own settings are echoed as OpenAI does."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
        "previous_response_id": None, "reasoning": None, "store": False, "background": False,
        "text": {"format": fmt}, "metadata": req.metadata or {}, "user": req.user, "usage": usage,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
    }
