"""What a request may ask for, checked in one place: priority names, sampling ranges, the context
length and the vocabulary range. The gateway (before submitting), the mesh scheduler (before routing)
and the engine (LLMEngine.add_request) all call these, so the rules and their messages cannot drift.
Torch-free: the gateway and the scheduler import it.

Each check raises LimitError (a ValueError), which names the request field at fault (`param`) and
OpenAI's error code where there is one; callers turn it into their own error type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# Scheduling priorities, best first; a lower level is served first (shared/engine/scheduler.py).
Priority = Literal["interactive", "normal", "background"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
NORMAL = PRIORITIES.index("normal")


class LimitError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def class_of(value):
    """A request's `priority` as a class name: a name is itself; an integer, vLLM's (lower runs
    earlier, 0 the default), is interactive below 0, normal at 0 and background above. Anything
    else is returned as it is (check_priority refuses it)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return "interactive" if value < 0 else "normal" if value == 0 else "background"
    return value


def check_priority(name) -> str:
    """A priority as the API takes it: one of the names (or vLLM's integers, class_of)."""
    name = class_of(name)
    if name not in PRIORITIES:
        raise LimitError(f"priority must be one of {', '.join(PRIORITIES)}", param="priority")
    return name


def priority_level(priority: int | str) -> int:
    """0 (interactive), 1 (normal) or 2 (background), from the level or its name."""
    level = PRIORITIES.index(priority) if priority in PRIORITIES else priority
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level < len(PRIORITIES):
        raise LimitError(f"priority must be one of {', '.join(PRIORITIES)} (or 0-{len(PRIORITIES) - 1})",
                         param="priority")
    return level


def check_sampling(p) -> None:
    """The ranges of the sampling parameters, for anything with their fields (the wire's Sampling,
    the engine's SamplingParams)."""
    if p.max_tokens < (0 if getattr(p, "prompt_logprobs", None) is not None else 1):
        raise LimitError("max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
    if p.temperature < 0:
        raise LimitError("temperature must be non-negative", param="temperature")
    if not 0 < p.top_p <= 1:
        raise LimitError("top_p must be in (0, 1]", param="top_p")
    if p.top_k < -1:
        raise LimitError("top_k must be -1, 0 (off) or positive", param="top_k")
    if not 0 <= p.min_p <= 1:
        raise LimitError("min_p must be in [0, 1]", param="min_p")
    if p.logprobs is not None and not 0 <= p.logprobs <= 20:
        raise LimitError("logprobs must be between 0 and 20", param="logprobs")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= 20:
        raise LimitError("prompt logprobs must be between 0 and 20", param="logprobs")
    if any(not -100 <= b <= 100 for b in (p.logit_bias or {}).values()):
        raise LimitError("logit_bias values must be between -100 and 100", param="logit_bias")
    if not p.repetition_penalty > 0:
        raise LimitError("repetition_penalty must be positive", param="repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            raise LimitError(f"{name} must be between -2 and 2", param=name)
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise LimitError("allowed_token_ids must not be empty", param="allowed_token_ids")
    if any(not w for w in p.bad_words):
        raise LimitError("a bad word must have at least one token", param="bad_words")
    if not 0 <= p.min_tokens <= max(p.max_tokens, 0):
        raise LimitError("min_tokens must be between 0 and max_tokens", param="min_tokens")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise LimitError(f"prompt token ids must be in [0, {vocab_size})", param=param)


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str = "prompt") -> None:
    """The prompt and the tokens to generate must fit the context. max_tokens None: only the prompt
    is known yet (a chat without max_tokens gets the rest of the context), which must leave room
    for one token."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise LimitError(f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length "
                             f"is {max_model_len} tokens, output included", param=param,
                             code="context_length_exceeded")
        return
    n = num_prompt_tokens + max_tokens
    if n > max_model_len:
        raise LimitError(f"this model's maximum context length is {max_model_len} tokens; the request asks for "
                         f"{n} ({num_prompt_tokens} in the prompt, {max_tokens} to generate)", param=param,
                         code="context_length_exceeded")


# -- the size of a request: what the gateway accepts before any work is done (all configurable:
# `meshserve serve gateway` and `meshserve up` take each as a flag, docs/security.md)

MAX_LOGPROBS = 20  # the engine's own bound (check_sampling above): a configured limit may only be lower


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 4 * 1024 * 1024  # HTTP 413 above it
    max_messages: int = 2048  # OpenAI's own bound on a chat's messages
    max_stop: int = 16  # stop sequences
    max_logprobs: int = MAX_LOGPROBS  # logprobs / top_logprobs
    max_json_depth: int = 64  # nesting of arrays and objects in the body (JSON schemas included)
    # A chat request's own template (vLLM's field of the same name, behind the same flag): rendered
    # sandboxed, but a template may still loop for as long as it likes in the gateway.
    trust_request_chat_template: bool = False


REQUEST_LIMIT_FLAGS = ("max-body-bytes", "max-messages", "max-stop", "max-logprobs", "max-json-depth")
_HELP = {"max-body-bytes": "largest request body in bytes; larger ones get HTTP 413",
         "max-messages": "most messages in a chat request",
         "max-stop": "most stop sequences in a request",
         "max-logprobs": f"most logprobs / top_logprobs a request may ask for (at most {MAX_LOGPROBS})",
         "max-json-depth": "deepest nesting of arrays and objects in a request body"}


def add_request_limit_arguments(parser, defaults: bool = True) -> None:
    """The limits as flags; defaults=False leaves them None (the launcher passes on only those given)."""
    base = RequestLimits()
    for flag in REQUEST_LIMIT_FLAGS:
        value = getattr(base, flag.replace("-", "_"))
        parser.add_argument(f"--{flag}", type=_bounded(flag), default=value if defaults else None,
                            help=f"{_HELP[flag]} (default: {value})")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat requests that bring their own chat_template (off: refused with a 400, since "
                             "a template runs in the gateway for as long as it loops)")


def _bounded(flag: str):
    def parse(text: str) -> int:
        import argparse

        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < (0 if flag == "max-logprobs" else 1) or (flag == "max-logprobs" and n > MAX_LOGPROBS):
            raise argparse.ArgumentTypeError(f"--{flag} must be {'0-' + str(MAX_LOGPROBS) if flag == 'max-logprobs' else 'positive'}")
        return n
    return parse


def limits_from_args(args) -> RequestLimits:
    base = RequestLimits()
    return RequestLimits(**{f: getattr(args, f, None) if getattr(args, f, None) is not None else getattr(base, f)
                            for f in (flag.replace("-", "_") for flag in REQUEST_LIMIT_FLAGS)},
                         trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)))


def json_depth_exceeds(value, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` in a decoded JSON value (iterative: a
    hostile body cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def check_request_size(body, limits: RequestLimits) -> None:
    """A decoded body's counts against the limits, before it is validated field by field (its size
    and nesting are checked where it is decoded: the gateway's Gateway.decode_body)."""
    if not isinstance(body, dict):
        return
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise LimitError(f"{len(messages)} messages; at most {limits.max_messages} are accepted", param="messages")
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > limits.max_stop:
        raise LimitError(f"{len(stop)} stop sequences; at most {limits.max_stop} are accepted", param="stop")
    for name in ("logprobs", "top_logprobs"):
        n = body.get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > limits.max_logprobs:
            raise LimitError(f"{name} must be at most {limits.max_logprobs}", param=name)
