"""Reasoning parsers: a reasoning model's output split into its reasoning and its answer, as vLLM's
`--reasoning-parser` does, for chat responses (`reasoning_content`, and vLLM's newer `reasoning`).

Both parsers read `<think> ... </think>`:
- `qwen3`: reasoning only between `<think>` and `</think>` at the start of the output; an output
  that does not open with `<think>` (thinking turned off, `enable_thinking: false`) is all answer.
- `deepseek_r1`: the output starts in reasoning (the chat template opens `<think>` in the prompt;
  one the model writes itself is dropped) until `</think>`; without it, it is all reasoning.

Either way the rendered prompt has the first word (`prompt_state`): a prompt that ends inside
`<think>` (Qwen3-Thinking's and DeepSeek-R1's newer templates) starts the output in reasoning, one
that ends with `</think>` (`enable_thinking: false`) starts it in the answer.

The text comes in pieces (a stream's deltas), and a tag may be cut between two: a piece's tail
that may begin a tag is held back until the next piece says. Leading whitespace before `<think>`
is allowed, as models write it.

A structured-output constraint applies to the answer only (`constraint_tags`: the engine starts
it after `</think>`), as vLLM's does with a reasoning parser.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSED = "open", "closed"  # prompt_state's


def add_reasoning_argument(parser) -> None:
    """The gateway's (and `meshserve up`'s) --reasoning-parser."""
    parser.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                        help="split chat answers into `reasoning_content` and `content` (vLLM's; docs/openai-api.md): "
                             "for --model, and the manifest's models that name none (default: none)")


def prompt_state(tokenizer, prompt_ids: list[int]) -> str | None:
    """How the rendered prompt leaves the reasoning: OPEN (it ends with <think>: the output starts
    in reasoning), CLOSED (it ends with </think>: thinking is off), or None (as the parser says)."""
    tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False).rstrip()
    return OPEN if tail.endswith(START) else CLOSED if tail.endswith(END) else None


def constraint_tags(parser: str | None, state: str | None, tokenizer) -> dict:
    """The engine's reasoning_end / reasoning_start (SamplingParams) of a constrained chat answer:
    the constraint starts after the reasoning. qwen3 with no word from the prompt reasons only when
    the output opens with <think>, which the engine can offer beside the grammar only as one token
    (Qwen3's is); a tokenizer that splits it gets the constraint from the first token."""
    if parser is None or state == CLOSED:
        return {}
    end = tokenizer.encode(END, add_special_tokens=False)
    if parser == "qwen3" and state is None:
        start = tokenizer.encode(START, add_special_tokens=False)
        return {"reasoning_end": end, "reasoning_start": start} if len(start) == 1 else {}
    return {"reasoning_end": end}


def reasoning_setup(parser: str | None, tokenizer, prompt_ids: list[int], sampling):
    """A chat request's (sampling, prompt_state's word) for a model with this reasoning parser: a
    constrained answer's sampling gets the engine's reasoning tags (constraint_tags). No parser:
    the sampling as it is, and None."""
    if parser is None:
        return sampling, None
    state = prompt_state(tokenizer, prompt_ids)
    if sampling.constraint is not None:
        sampling = sampling.model_copy(update=constraint_tags(parser, state, tokenizer))
    return sampling, state


class ReasoningParser:
    def __init__(self, name: str, prompt: str | None = None):
        """prompt: prompt_state's word on the output's start."""
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
        self.name = name
        # "open": before the output shows whether it thinks; "reasoning"; "answer"
        self.state = "answer" if prompt == CLOSED else "open"
        # what an output that does not open with <think> is
        self.default = "reasoning" if name == "deepseek_r1" or prompt == OPEN else "answer"
        self.thought = False  # it reached its reasoning (split says None when it never did)
        self.held = ""  # text not yet given out: it may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of output -> (reasoning, answer) text it adds."""
        self.held += text
        reasoning, answer = [], []
        while self.held:
            if self.state == "open":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held, self.state = stripped[len(START):], "reasoning"
                elif START.startswith(stripped):  # all whitespace, or a prefix of the tag: wait
                    break
                else:
                    self.state = self.default
                self.thought = self.state == "reasoning"
            elif self.state == "reasoning":
                at = self.held.find(END)
                if at >= 0:
                    reasoning.append(self.held[:at])
                    self.held, self.state = self.held[at + len(END):], "answer"
                    continue
                keep = _tag_prefix_len(self.held, END)
                reasoning.append(self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            else:
                answer.append(self.held)
                self.held = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back, where it belongs."""
        held, self.held = self.held, ""
        if self.state == "open" and self.default == "reasoning":
            self.state = "reasoning"
            self.thought = True
        if self.state == "reasoning":
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output -> (reasoning, or None when it has none, answer)."""
        r1, a1 = self.feed(text)
        r2, a2 = self.finish()
        return (r1 + r2 if self.thought else None), a1 + a2


def reasoning_fields(reasoning: str | None, include: bool = True) -> dict:
    """A chat message's (or delta's) reasoning under vLLM's two names (`reasoning_content`, and the
    newer `reasoning`); none when there is none or the request's include_reasoning is false."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning is not None and include else {}


def split_answer(parser: str | None, text: str, include: bool = True, prompt: str | None = None) -> tuple[dict, str]:
    """A whole chat answer -> (its message's reasoning fields, its content text); parser None: all
    content. prompt: prompt_state's word."""
    if parser is None:
        return {}, text
    reasoning, answer = ReasoningParser(parser, prompt).split(text)
    return reasoning_fields(reasoning, include), answer


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
