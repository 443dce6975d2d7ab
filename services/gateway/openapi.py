"""The gateway's OpenAPI schema (/openapi.json): every route with its real request and response bodies.

The routes parse their bodies themselves (so every error is OpenAI's JSON with a 400, and one
handler serves HTTP and NATS), so FastAPI cannot see the request models in their signatures: the
request bodies are added here from the same pydantic models the handlers validate with. The
response models below describe the dicts the handlers build; tests/test_openai_surface.py checks
real responses against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

# -- shared pieces


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error JSON: what every 4xx and 5xx carries."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(default=None, description="present when "
                                                              "part of the prompt came from the prefix cache")
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, description="present when the chat request had a `prediction`: how many of its tokens "
                                  "the answer has (in order), and how many not")


# -- /v1/completions


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's: one of a prompt token's entries in `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: one per prompt token (the first null)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="with the request's prompt_logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One `data:` line of a streamed completion (the usage chunk has no choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="with the request's prompt_logprobs")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One `data:` line of a streamed chat completion (the usage chunk has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- /v1/responses


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's reasoning (with a reasoning parser), before the message."""

    type: Literal["reasoning"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any]
    content: list[ReasoningText]


class OutputFunctionCall(BaseModel):
    """A call of one of the request's function tools."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="JSON text")
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A Response (`object: "response"`); the request's settings are echoed."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    error: ResponseError | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_logprobs: int | None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    truncation: Literal["disabled"]
    previous_response_id: None
    reasoning: None
    store: bool
    background: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class ResponseEvent(BaseModel):
    """One streamed event (`event: <type>` then `data: <this>`). Which fields come depends on `type`:
    response.created / in_progress / completed / incomplete / failed carry `response`;
    response.output_item.added / done carry `output_index` and `item`; response.content_part.added /
    done carry `item_id`, `output_index`, `content_index` and `part`; response.output_text.delta carries
    `delta` and `logprobs`, response.output_text.done `text` and `logprobs`;
    response.reasoning_text.delta / done carry `delta` / `text`; response.function_call_arguments.delta
    / done carry `item_id`, `output_index` and `delta` / `arguments`; error carries `code`, `message`,
    `param`."""

    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done", "response.reasoning_text.delta",
                  "response.reasoning_text.done", "response.function_call_arguments.delta",
                  "response.function_call_arguments.done", "response.completed",
                  "response.incomplete", "response.failed", "error"]
    sequence_number: int
    response: ResponseObject | None = None
    item: OutputItem | None = None
    arguments: str | None = None
    part: OutputText | None = None
    item_id: str | None = None
    output_index: int | None = None
    content_index: int | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


# -- the rest


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    state: Literal["mapped", "host", "disk", "loading", "failed", "unknown"] = Field(
        description="the hottest model-loader tier it is in on some node, or loading, or failed (see error); "
                    "docs/models.md")
    error: str | None = Field(None, description="why it failed to load")
    workers: int = Field(0, description="workers serving it now")
    aliases: list[str] = []
    version: str | None = None
    pinned: bool = False
    versions: list[dict[str, Any]] | None = Field(None, description="a canary: each version, its share and state")
    variants: list[dict[str, Any]] | None = Field(
        None, description="variants by class and tenant: each variant, its priorities, tenants, format and state")
    lora: dict[str, Any] | None = Field(None, description="a LoRA adapter (its base is `parent`): its path and "
                                                          "source, manifest or runtime")
    reasoning_parser: str | None = Field(None, description="how its chat answers' reasoning is split off (none: null)")
    tool_call_parser: str | None = Field(None, description="how its tool calls are read under tool_choice auto")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    scheduler: dict[str, Any] = Field(description="the scheduler's status: workers, load, KV usage, prefix cache")


# -- building the document

ERRORS = {400: "invalid request", 401: "no or a wrong API key (with a tenants file)",
          403: "a priority above the tenant's maximum", 404: "unknown model",
          429: "over the tenant's limits (with Retry-After)", 499: "the client closed the connection",
          500: "internal error", 503: "the mesh is not ready, or the class's queue is full (with Retry-After)",
          504: "no tokens arrived for --stream-timeout seconds"}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def responses(model: type[BaseModel], stream: type[BaseModel] | None = None, stream_note: str = "",
              errors: tuple[int, ...] = (400, 401, 403, 404, 429, 500, 503, 504)) -> dict:
    """FastAPI's `responses=` for a route: the body on 200 (and, for streams, the SSE events), the errors."""
    ok: dict[str, Any] = {"model": model, "description": "the response"}
    if stream is not None:
        ok["content"] = {"text/event-stream": {"schema": {
            "type": "string", "description": f"with `stream: true`: server-sent events, each data line a "
                                             f"{stream.__name__} object{stream_note}"}}}
    return {200: ok, **{code: {"model": ErrorBody, "description": ERRORS[code]} for code in errors}}


def install(app: FastAPI, request_bodies: dict[str, list[type[BaseModel]]],
            extra_models: list[type[BaseModel]]) -> None:
    """Makes app.openapi() describe each POST route's request body (one of the models listed for its
    path) and keep `extra_models` (the stream event objects) among the components."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})

        def add(model: type[BaseModel]) -> str:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                schemas.setdefault(name, sub)
            name = js.get("title", model.__name__)
            schemas.setdefault(name, js)
            return name

        for path, models in request_bodies.items():
            names = [add(m) for m in models]
            schema = _ref(names[0]) if len(names) == 1 else {"anyOf": [_ref(n) for n in names]}
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": schema}}}
        for m in extra_models:
            add(m)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
