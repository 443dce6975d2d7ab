"""The OpenAI-compatible API: request and response schemas, and their mapping onto the mesh's
wire types (a request's sampling becomes shared/schemas.py's Sampling; the engine converts that at
its own door, shared/engine/wire.py).

Used by the offline batch runner and by the gateway, so both speak exactly the same dialect; torch-free.
Unknown fields are ignored (as vLLM does); fields that would change the output are honoured or
rejected with a 400 naming them.
"""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .limits import LimitError, RequestLimits, check_request_size, class_of
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


def validate_body(cls: type[BaseModel], body: Any) -> BaseModel:
    """A JSON body as `cls`, or OpenAIError(400) naming the first field that is wrong ("unknown
    field" for one a model that forbids extras does not have): the completion requests, the
    gateway's small endpoints (/tokenize, /detokenize, the LoRA admin routes)."""
    from pydantic import ValidationError

    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise OpenAIError(f"{param + ': ' if param else ''}{msg}", param=param) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # choices per request: a batch of prompts times n

# OpenAI's defaults, for what neither the request nor the model's generation_config.json sets.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (newer name of the guided_* fields): one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the answer expected (say the file being edited), proposed to the
    model for speculative verification: answers come faster where they match it, and are the same."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def prediction_usage(prediction: list[int], outputs: list[list[int]]) -> dict:
    """OpenAI's completion_tokens_details of a predicted answer: of the prediction's tokens, those
    that appear in each output (in order: the longest matching blocks) and those that do not."""
    from difflib import SequenceMatcher

    accepted = sum(b.size for out in outputs
                   for b in SequenceMatcher(None, prediction, out, autojunk=False).get_matching_blocks())
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": len(prediction) * len(outputs) - accepted}


def _refuse(message: str, param: str) -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param)


@lru_cache(maxsize=256)
def _constraint_error(kind: str, spec: str) -> str | None:
    from .engine.constraints import ConstraintError, check

    try:
        check(kind, spec)
    except ConstraintError as e:
        return str(e)
    return None


def check_constraint(kind: str, spec: str, param: str) -> tuple[str, str]:
    """The constraint, or OpenAIError(400) naming the field when it does not compile."""
    err = _constraint_error(kind, spec)
    if err:
        raise _refuse(f"invalid {kind.replace('_', ' ')}: {err}", param)
    return kind, spec


def _schema_text(value: dict | str, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _refuse(f"not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise _refuse("a JSON schema must be an object", param)
    return json.dumps(value)


# Request fields OpenAI defines that change nothing in the output: accepted and ignored.
INERT_FIELDS = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

# Fields OpenAI or vLLM define that this server does not implement, with the value that asks for
# nothing (null, or their default): SDKs send them so, and so they are accepted; any other value
# is refused by name.
NOOP_VALUES: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
    "modalities": ["text"],
    **dict.fromkeys(("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity", "thinking",
                     "documents", "mm_processor_kwargs", "logits_processors", "kv_transfer_params", "vllm_xargs",
                     "structural_tag"))}


class _SamplingFields(BaseModel):
    """Fields both endpoints share. A field that would change the output is honoured or refused
    with a 400 naming it (`check`); of the fields not declared here, only those known to change
    nothing (`INERT_FIELDS`) are accepted, every other one is refused by name."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the model's generation_config.json, else OpenAI's default (OPENAI_DEFAULTS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)  # vLLM's
    bad_words: list[str] | None = None  # vLLM's: words never generated (banned_by_bad_words)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's integers are taken too (limits.class_of): below 0 interactive, 0 normal, above 0 background
    priority: Literal["interactive", "normal", "background"] | int | None = Field(
        default=None, description="the request's class (default: its tenant's, else normal); or vLLM's integer: "
                                  "below 0 interactive, 0 normal, above 0 background")
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: every backend name means llguidance here
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: how the output becomes text (where it is detokenized), and how much of the prompt is kept
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # vLLM's: each prompt token's logprob and rank, and its k most likely alternatives (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's: only requests with the same salt share cached prompt blocks (prefix_hash.namespace)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: the response's id is "cmpl-" / "chatcmpl-" and this (the mesh's own id stays unique)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: the prompt's and the output's token ids beside the text (`prompt_token_ids`, `token_ids`)
    return_token_ids: bool = False
    # vLLM's: logprobs name each token "token_id:<id>" rather than by its text
    return_tokens_as_token_ids: bool = False

    @field_validator("priority", mode="before")
    @classmethod
    def _priority_class(cls, v):
        return class_of(v)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v  # how many: limits.check_request_size

    def check(self, vocab_size: int | None = None) -> None:
        """What pydantic cannot say: raises OpenAIError(400) naming the field."""
        for name, value in sorted((self.model_extra or {}).items()):
            if name in INERT_FIELDS or (name in NOOP_VALUES and value == NOOP_VALUES[name]):
                continue
            why = f"only {json.dumps(NOOP_VALUES[name])} is accepted" if name in NOOP_VALUES else "not supported"
            raise _refuse(f"{why} by this server (it would be ignored, so it is refused)", name)
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of is not supported (only best_of == n, which returns every choice)", "best_of")
        if self.prompt_logprobs is not None and self.stream:
            raise _refuse("not available with stream: true (as vLLM)", "prompt_logprobs")
        if self.guided_whitespace_pattern is not None:
            raise _refuse("not supported: JSON is generated without free whitespace", "guided_whitespace_pattern")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _refuse("must not exceed max_tokens", "min_tokens")
        self.logit_bias_ids(vocab_size)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.allowed_token_ids or ()):
            raise _refuse(f"token ids must be in [0, {vocab_size})", "allowed_token_ids")
        if any(not w.strip() for w in self.bad_words or ()):
            raise _refuse("a bad word must not be empty or only whitespace", "bad_words")
        self.constraint()

    def stop_strings(self) -> list[str]:
        """The stop strings (matched on the text by whoever detokenizes; never on the wire)."""
        return [s for s in (self.stop or []) if s]

    def text_options(self) -> dict[str, Any]:
        """How the output's tokens become text: IncrementalDetokenizer's (and SamplingParams') fields."""
        return {"stop": self.stop_strings(), "skip_special_tokens": self.skip_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output}

    def truncate(self, prompt: list[int]) -> list[int]:
        """The prompt as computed: its last truncate_prompt_tokens tokens, when it is longer."""
        k = self.truncate_prompt_tokens
        return prompt[-k:] if k is not None and len(prompt) > k else prompt

    def logit_bias_ids(self, vocab_size: int | None = None) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            try:
                t = int(k)
            except ValueError:
                raise _refuse(f"keys must be token ids, not {k!r}", "logit_bias") from None
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise _refuse(f"token id {t} is not in [0, {vocab_size})", "logit_bias")
            if not -100 <= v <= 100:
                raise _refuse(f"the bias of token {t} must be between -100 and 100", "logit_bias")
            out[t] = v
        return out

    def token_text(self, tokenizer):
        """What names a token in logprobs: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        if self.return_tokens_as_token_ids:
            return lambda ids: "".join(f"token_id:{t}" for t in ids)
        return tokenizer.decode

    def bad_words_ids(self, tokenizer) -> list[list[int]]:
        """Each bad word as tokens, as vLLM takes them: with its leading whitespace stripped, and with
        one space before it (the word inside a text rather than at its start); each form once."""
        out: list[list[int]] = []
        for word in self.bad_words or ():
            for form in (word.lstrip(), " " + word.lstrip()):
                ids = tokenizer.encode(form, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def constraint(self) -> tuple[str, str] | None:
        """The structured-output constraint (kind, spec) the request asks for, checked; one at most."""
        found: list[tuple[str, str, str]] = []  # (param, kind, spec)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", "json_object", ""))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise _refuse("json_schema.schema is required with type json_schema", "response_format")
            p = "response_format.json_schema.schema"
            found.append((p, "json_schema", _schema_text(rf.json_schema.schema_, p)))
        if self.guided_json is not None:
            found.append(("guided_json", "json_schema", _schema_text(self.guided_json, "guided_json")))
        for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, kind, getattr(self, name)))
        if self.guided_choice is not None:
            found.append(("guided_choice", "choice", json.dumps(self.guided_choice)))
        so = self.structured_outputs
        if so is not None:
            for name, kind in (("json_", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                               ("grammar", "grammar"), ("json_object", "json_object")):
                v = getattr(so, name)
                if v is None or v is False:
                    continue
                param = f"structured_outputs.{name.rstrip('_')}"
                spec = (_schema_text(v, param) if kind == "json_schema" else json.dumps(v) if kind == "choice"
                        else "" if kind == "json_object" else v)
                found.append((param, kind, spec))
        if len(found) > 1:
            raise _refuse(f"only one structured-output constraint per request; {found[0][0]} is given too",
                          found[1][0])
        if not found:
            return None
        param, kind, spec = found[0]
        return check_constraint(kind, spec, param)

    def _sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int, tokenizer,
                  defaults: dict | None = None, constraint: tuple[str, str] | None = None,
                  prompt_logprobs: int | None = None) -> Sampling:
        """defaults: the model's generation defaults (models_repo.generation_defaults), for the
        sampling fields the request leaves unset; tokenizer: the model's (bad words become tokens)."""
        d = {**OPENAI_DEFAULTS, **(defaults or {})}
        asked = [k for k in (prompt_logprobs, self.prompt_logprobs) if k is not None]
        pick = {k: getattr(self, k) if getattr(self, k) is not None else d[k] for k in OPENAI_DEFAULTS}
        return Sampling(
            max_tokens=max_tokens if max_tokens is not None else default_max,
            temperature=pick["temperature"], top_p=pick["top_p"], top_k=int(pick["top_k"]), min_p=pick["min_p"],
            repetition_penalty=pick["repetition_penalty"], presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias_ids(), min_tokens=self.min_tokens,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words_ids(tokenizer), seed=self.seed,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs, constraint=constraint,
            prompt_logprobs=max(asked, default=None))


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt's logprobs only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS (or the like)

    @model_validator(mode="after")
    def _batch(self):
        """A list of texts or of token-id lists is a batch of prompts (OpenAI's and vLLM's form): each
        gets n choices, numbered prompt by prompt. A batch of one is that prompt."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            self.prompt = p = p[0]
        if p == "" or p == [] or any(x == "" or x == [] for x in self.prompts):
            raise ValueError("prompt must not be empty")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts)} prompts x n={self.n} is more than {MAX_CHOICES} choices "
                             "in one request; send fewer prompts each")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids: one, or the batch's."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def prompt_ids(self, prompt: str | list[int], tokenizer) -> tuple[list[int], str]:
        """One of its prompts as computed: its token ids (a text encoded, with the tokenizer's
        special tokens when add_special_tokens; then its last truncate_prompt_tokens) and the text
        echo returns (the text given, or the kept tokens' text when cut or given as ids)."""
        given = list(prompt) if isinstance(prompt, list) else tokenizer.encode(
            prompt, add_special_tokens=self.add_special_tokens)
        ids = self.truncate(given)
        return ids, prompt if isinstance(prompt, str) and ids is given else tokenizer.decode(ids)

    def check(self, vocab_size: int | None = None) -> None:
        super().check(vocab_size)
        if self.suffix:
            raise _refuse("not supported (no fill-in-the-middle)", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise _refuse("must be at least 1 (0 only with echo)", "max_tokens")

    def to_sampling(self, tokenizer, defaults: dict | None = None) -> Sampling:
        """With echo, the prompt's logprobs are computed (and max_tokens may be 0), with as many
        alternatives as `logprobs` or `prompt_logprobs` asks, whichever is more."""
        prompt_lps = (self.logprobs or 0) if self.echo and (self.logprobs is not None or self.max_tokens == 0) else None
        return self._sampling(self.max_tokens, self.logprobs, 16, tokenizer, defaults=defaults,
                                    constraint=self.constraint(), prompt_logprobs=prompt_lps)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported")
                parts.append(part.get("text", ""))
            return "".join(parts)
        return self.content or ""

    def template(self) -> dict[str, Any]:
        """The message as a chat template expects it: Transformers' convention, arguments as objects;
        keys of its own (say `reasoning_content`) go to the template as they are, as Transformers
        passes them."""
        out: dict[str, Any] = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": fn})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS on top of what the template writes
    # vLLM's: the request's own template (rendered sandboxed, as the model's), more variables for
    # it, and a prompt that ends inside the last (assistant) message, which generation continues
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools: refused
    function_call: str | dict[str, Any] | None = None
    # vLLM's: with a reasoning parser (shared/reasoning.py), false leaves the reasoning out
    include_reasoning: bool = True
    prediction: Prediction | None = None
    echo: bool = False  # vLLM's: the answer is prepended with the last message's text when that is the assistant's

    def echoed(self) -> str:
        """The text echo puts before the answer: the last message's, when it is the assistant's
        (continue_final_message), else nothing."""
        return self.messages[-1].text() if self.echo and self.messages[-1].role == "assistant" else ""

    # Variables for the chat templates that read them (TEMPLATE_READS): a template that does not
    # would ignore them, so they are refused there.
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents (Command R, Granite, ...)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # OpenAI's (gpt-oss)

    def check_reasoning(self, parser: str | None) -> None:
        """include_reasoning: false needs the model's reasoning parser (its reasoning is otherwise content)."""
        if not self.include_reasoning and parser is None:
            raise _refuse("false needs a model served with a reasoning parser (--reasoning-parser, or the "
                          "manifest's reasoning_parser); this one has none", "include_reasoning")

    def check(self, vocab_size: int | None = None) -> None:
        super().check(vocab_size)
        for old in ("functions", "function_call"):
            if getattr(self, old) is not None:
                raise _refuse("the deprecated function-calling fields are not supported; use tools and tool_choice",
                              old)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise _refuse("needs tools", "tool_choice")
        mode = self.tool_mode()
        if mode in ("required", "named") and (self.response_format or self.guided_json or self.guided_regex or
                                              self.guided_choice or self.guided_grammar or self.structured_outputs):
            raise _refuse("a forced tool call cannot have another structured-output constraint", "tool_choice")
        if mode == "named":
            name = self.tool_choice.function.get("name")
            if name not in {t.function.name for t in self.tools}:
                raise _refuse(f"names the function {name!r}, which is not among the tools", "tool_choice")
        for i, t in enumerate(self.tools or []):
            if t.function.parameters is not None:
                check_constraint("json_schema", json.dumps(t.function.parameters), f"tools[{i}].function.parameters")
        if self.continue_final_message and self.add_generation_prompt:
            raise _refuse("needs add_generation_prompt: false (the prompt ends inside the last message, not after "
                          "it)", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise _refuse("needs an assistant message last (the one to continue)", "continue_final_message")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_VARIABLES)
        if taken:
            raise _refuse(f"{taken[0]!r} is set by the request itself", "chat_template_kwargs")

    def prompt_ids(self, tokenizer, add_special_tokens: bool | None = None) -> list[int]:
        """The rendered prompt's token ids (with the tokenizer's special tokens on top when
        add_special_tokens: the request's own unless given); not truncated. Raises as render."""
        special = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return tokenizer.encode(self.render(tokenizer), add_special_tokens=special)

    def render(self, tokenizer) -> str:
        """The prompt's text: the messages through the chat template (the request's own, else the
        model's), as Transformers' apply_chat_template(tokenize=False) renders them. Raises
        ValueError for a template that fails or a final message it does not show, OpenAIError for
        a TEMPLATE_READS variable the template does not read."""
        from .tokenizer import template_variables

        messages = self.template_messages()
        given = {name: getattr(self, name) for name in TEMPLATE_READS if getattr(self, name) is not None}
        if given:
            reads = template_variables(self.chat_template or tokenizer.chat_template or "")
            for name in given:
                if name not in reads:
                    raise _refuse("this model's chat template does not read it, so it would be ignored", name)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=self.add_generation_prompt,
                                             tools=self.tool_dicts(), chat_template=self.chat_template,
                                             **{**(self.chat_template_kwargs or {}), **given})
        return continue_final(text, messages[-1]["content"]) if self.continue_final_message else text

    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template receives them (Transformers passes the dicts as they are)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def to_sampling(self, default_max: int, tokenizer, defaults: dict | None = None) -> Sampling:
        from . import tool_calls

        lp = (self.top_logprobs or 0) if self.logprobs else None
        mode, constraint = self.tool_mode(), self.constraint()
        if mode == "required":
            constraint = check_constraint("json_schema", json.dumps(tool_calls.required_schema(
                self.tool_dicts(), self.parallel_tool_calls)), "tools")
        elif mode == "named":
            constraint = check_constraint("json_schema", json.dumps(tool_calls.named_schema(
                self.tool_dicts(), self.tool_choice.function["name"])), "tools")
        sampling = self._sampling(self.max_completion_tokens or self.max_tokens, lp, default_max, tokenizer,
                                  defaults=defaults, constraint=constraint)
        if self.prediction is not None:
            sampling.prediction = tokenizer.encode(self.prediction.text(), add_special_tokens=False) or None
        return sampling

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template() for m in self.messages]


TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template"})
TEMPLATE_READS = ("documents", "reasoning_effort")  # the request's fields its chat template must read


def continue_final(text: str, final: str) -> str:
    """A rendered conversation cut right after its final message's content, so that generation
    continues that message (Transformers' continue_final_message: a template may strip the
    content's trailing whitespace, so the cut is after the stripped content unless it kept it)."""
    core = final.strip()
    if not core:
        raise ValueError("the final message is empty: nothing to continue (use add_generation_prompt)")
    if core not in text:
        raise ValueError("the final message does not appear in the rendered chat template")
    at, kept = text.rindex(core), final.lstrip()
    return text[:at + (len(kept) if text[at:at + len(kept)] == kept else len(core))]


def parse_request(kind: Literal["completions", "chat"], body: Any, vocab_size: int | None = None,
                  limits: RequestLimits | None = None) -> CompletionRequest | ChatCompletionRequest:
    """Validates a request body; raises OpenAIError(400) saying what is wrong, naming the field."""
    cls = CompletionRequest if kind == "completions" else ChatCompletionRequest
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        check_request_size(body, limits or RequestLimits())
    except LimitError as e:
        raise OpenAIError(str(e), param=e.param, code=e.code) from None
    req = validate_body(cls, body)
    if getattr(req, "chat_template", None) is not None and not (limits or RequestLimits()).trust_request_chat_template:
        raise _refuse("a request's own chat template is refused unless the gateway runs with "
                      "--trust-request-chat-template", "chat_template")
    req.check(vocab_size)
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, details: dict | None = None) -> dict:
    """details: completion_tokens_details (prediction_usage's), when there are any."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if details:
        u["completion_tokens_details"] = details
    return u


# Logprobs below: the wire's Logprob, or anything with its two fields (the engine's TokenLogprobs).


def completion_logprobs(tokens: list[int], logprobs: list[Logprob | None], decode, text_offset: int = 0,
                        top: int | None = None) -> dict:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset;
    `top`: at most that many alternatives of each (None: all there are)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = text_offset
    for t, lp in zip(tokens, logprobs):
        s = decode([t])
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.logprob if lp else None)
        out["top_logprobs"].append({decode([a]): v for a, v in lp.top[:top]} if lp else None)
        out["text_offset"].append(off)
        off += len(s)
    return out


def prompt_logprobs(tokens: list[int], logprobs: list[Logprob | None], decode, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: for each prompt token (the first has none) {token id: {logprob,
    rank, decoded_token}}, the token's own entry, then its `top` best alternatives'."""
    out: list[dict | None] = []
    for t, lp in zip(tokens, logprobs):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode([t])}}
        for rank, (a, v) in enumerate(lp.top[:top], 1):
            entry.setdefault(str(a), {"logprob": v, "rank": rank, "decoded_token": decode([a])})
        out.append(entry)
    return out


def prompt_fields(req: _SamplingFields, ids: list[int], logprobs: list[Logprob | None] | None, decode) -> dict:
    """vLLM's fields of a choice's prompt, as the request asks: `prompt_logprobs` (its computed
    `logprobs`, None: not computed) and `prompt_token_ids`."""
    out = {}
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(ids, logprobs or [None] * len(ids), decode, req.prompt_logprobs)
    if req.return_token_ids:
        out["prompt_token_ids"] = ids
    return out


def join_logprobs(first: dict, then: dict) -> dict:
    """Two completions logprobs objects, one after the other (echo: the prompt's, then the output's)."""
    return {k: first[k] + then[k] for k in first}


def chat_logprobs(tokens: list[int], logprobs: list[Logprob | None], decode) -> dict:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(t: int, v: float) -> dict:
        s = decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(tokens, logprobs) if lp is not None]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, content: str | None, finish_reason: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """tool_calls: as OpenAI returns them ({id, type, function: {name, arguments}})."""
    message: dict = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, usage_: dict,
                        logprobs: dict | None = None, choices: list[dict] | None = None) -> dict:
    """One choice (text, finish_reason, logprobs), or `choices` (completion_choice) for n > 1."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices or [completion_choice(0, text, finish_reason, logprobs)], "usage": usage_}


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, usage_: dict,
                  logprobs: dict | None = None, choices: list[dict] | None = None) -> dict:
    """One choice (text, finish_reason, logprobs), or `choices` (chat_choice) for n > 1 or tool calls."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices or [chat_choice(0, text, finish_reason, logprobs)], "usage": usage_}


# Streaming: the chunks of one response share its id and `created`, so the caller passes both.


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    """`delta` is {"role": "assistant", "content": ...} in the first chunk, {"content": ...} after, {} at the end
    (or {"tool_calls": [...]} as OpenAI streams calls)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, object_: str, model: str, created: int, usage_: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage (as OpenAI sends)."""
    return {"id": rid, "object": object_, "created": created, "model": model, "choices": [], "usage": usage_}
