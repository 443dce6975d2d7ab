"""The OpenAI-compatible API: request and response schemas, and their mapping onto the mesh's
wire types (a request's sampling becomes shared/schemas.py's Sampling; the engine converts that at
its own door, shared/engine/wire.py).

Used by the offline batch runner and by the gateway, so both speak exactly the same dialect; torch-free.
Unknown fields are ignored (as vLLM does); fields we cannot honour are rejected with a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .schemas import Logprob, Sampling


class OpenAIError(Exception):
    """An error the client caused or must hear about, rendered as OpenAI's error JSON."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code
        self.headers = headers or {}  # e.g. Retry-After on a 429 or 503

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    priority: Literal["interactive", "normal", "background"] | None = Field(
        default=None, description="meshserve's own: the request's class (default: its tenant's, else normal)")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported yet")
        return self

    def stop_strings(self) -> list[str]:
        """The stop strings (matched on the text by whoever detokenizes; never on the wire)."""
        return [s for s in (self.stop or []) if s]

    def _sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> Sampling:
        return Sampling(
            max_tokens=max_tokens if max_tokens is not None else default_max,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("a batch of several prompts is not supported in one request; send one each")
            self.prompt = p[0]
        if self.prompt == "" or self.prompt == []:
            raise ValueError("prompt must not be empty")
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported")
        return self

    def to_sampling(self) -> Sampling:
        return self._sampling(self.max_tokens, self.logprobs, default_max=16)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported")
                parts.append(part.get("text", ""))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    def to_sampling(self, default_max: int) -> Sampling:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.max_completion_tokens or self.max_tokens, lp, default_max)

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_request(kind: Literal["completions", "chat"], body: Any) -> CompletionRequest | ChatCompletionRequest:
    """Validates a request body; raises OpenAIError(400) saying what is wrong."""
    from pydantic import ValidationError

    cls = CompletionRequest if kind == "completions" else ChatCompletionRequest
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise OpenAIError(f"{param + ': ' if param else ''}{err['msg']}", param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


# Logprobs below: the wire's Logprob, or anything with its two fields (the engine's TokenLogprobs).


def completion_logprobs(tokens: list[int], logprobs: list[Logprob | None], decode, text_offset: int = 0) -> dict:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = text_offset
    for t, lp in zip(tokens, logprobs):
        s = decode([t])
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.logprob if lp else None)
        out["top_logprobs"].append({decode([a]): v for a, v in lp.top} if lp else None)
        out["text_offset"].append(off)
        off += len(s)
    return out


def chat_logprobs(tokens: list[int], logprobs: list[Logprob | None], decode) -> dict:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(t: int, v: float) -> dict:
        s = decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(tokens, logprobs) if lp is not None]}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, usage_: dict,
                        logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_}


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, usage_: dict,
                  logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_}


# Streaming: the chunks of one response share its id and `created`, so the caller passes both.


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    """`delta` is {"role": "assistant", "content": ...} in the first chunk, {"content": ...} after, {} at the end."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, object_: str, model: str, created: int, usage_: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage (as OpenAI sends)."""
    return {"id": rid, "object": object_, "created": created, "model": model, "choices": [], "usage": usage_}
