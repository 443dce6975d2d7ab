"""The OpenAI Responses API (`/v1/responses`) as a translation onto chat completions.

A Responses request becomes a chat completions body (its input as messages, `instructions` as the
system message, `max_output_tokens` as `max_completion_tokens`, `text.format` as `response_format`);
the gateway runs that through the chat path, and the chat response or chunks are turned back into
a Response object or the Responses streaming events. So the two endpoints share validation,
sampling and generation, and differ only in their framing.

Fields are in three groups (docs/openai-api.md lists them): translated, inert (accepted, they
change nothing here: `user`, `metadata`, ...), and refused with a 400 naming them (`tools`,
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
    """An input item: a message (the only kind supported; tool calls and outputs are refused)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(default="message", description="message (other item types are refused)")
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None


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
    # refused when they ask for something (see _refuse)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
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
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


INERT = ("parallel_tool_calls", "max_tool_calls", "metadata", "user", "safety_identifier", "service_tier",
         "prompt_cache_key", "prompt_cache_retention", "stream_options", "store (false)", "tool_choice (none/auto)",
         "truncation (disabled)")
REFUSED = ("tools", "tool_choice (required or a function)", "previous_response_id", "conversation", "prompt",
           "reasoning", "truncation (auto)", "background (true)", "store (true)", "context_management", "moderation",
           "include (anything but message.output_text.logprobs)", "text.verbosity", *CHAT_ONLY)


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

    if req.tools:
        raise no("tools", "tools are not supported on /v1/responses; use /v1/chat/completions")
    if req.tool_choice not in (None, "none", "auto"):
        raise no("tool_choice", "only 'none' or 'auto' (with no tools) are supported")
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


def _messages(req: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise OpenAIError("input: must not be empty", param="input")
    for i, item in enumerate(req.input):
        if item.type != "message":
            raise OpenAIError(f"input.{i}.type: items of type {item.type!r} are not supported (only messages)",
                              param=f"input.{i}.type")
        if item.role is None:
            raise OpenAIError(f"input.{i}.role: a message needs a role", param=f"input.{i}.role")
        if isinstance(item.content, list):
            texts = []
            for j, part in enumerate(item.content):
                if part.type not in ("input_text", "output_text") or part.text is None:
                    raise OpenAIError(f"input.{i}.content.{j}: content of type {part.type!r} is not supported "
                                      "(only input_text and output_text)", param=f"input.{i}.content.{j}.type")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = item.content or ""
        messages.append({"role": item.role, "content": content})
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


def reasoning_item(item_id: str, status: str, text: str) -> dict:
    """A model's reasoning (its reasoning parser's, docs/openai-api.md), as OpenAI returns an open
    model's: the text whole, no summary."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


STATUS = {"stop": "completed", "length": "incomplete"}


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
        "tool_choice": req.tool_choice or "auto", "tools": [], "truncation": "disabled",
        "previous_response_id": None, "reasoning": None, "store": False, "background": False,
        "text": {"format": fmt}, "metadata": req.metadata or {}, "user": req.user, "usage": usage,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
    }
