"""What a request may ask for, checked in one place: priority names, sampling ranges, the context
length and the vocabulary range. The gateway (before submitting), the mesh scheduler (before routing)
and the engine (LLMEngine.add_request) all call these, so the rules and their messages cannot drift.
Torch-free: the gateway and the scheduler import it.

Each check raises LimitError (a ValueError), which names the request field at fault (`param`) and
OpenAI's error code where there is one; callers turn it into their own error type.
"""

from __future__ import annotations

from typing import Literal, get_args

# Scheduling priorities, best first; a lower level is served first (shared/engine/scheduler.py).
Priority = Literal["interactive", "normal", "background"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
NORMAL = PRIORITIES.index("normal")


class LimitError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_priority(name) -> str:
    """A priority as the API takes it: one of the names."""
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
