"""A request's state inside the engine: its tokens, its blocks, its sampling parameters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from meshserve.shared.limits import NORMAL, PRIORITIES, check_sampling, priority_level  # noqa: F401 - re-exported


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True  # with stop and the next: how the output becomes text (OutputProcessor)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the sampled token's; k: plus the top k
    # Logits processors (sampler.py), applied in this order before temperature and the filters:
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI, -100..100)
    repetition_penalty: float = 1.0  # Transformers': over prompt + output, >0 divides, <0 multiplies
    presence_penalty: float = 0.0  # OpenAI's: over the output, minus this once a token appeared ...
    frequency_penalty: float = 0.0  # ... and minus this times its count
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    allowed_token_ids: list[int] | None = None  # vLLM's: every other token is masked
    # vLLM's bad_words, tokenized: a sequence's last token is masked where the output ends with the
    # ones before it (a one-token word: always).
    bad_words: list[list[int]] = field(default_factory=list)
    # Structured output: (kind, spec), kind one of constraints.KINDS; the grammar's token mask is
    # applied last, so every output is in its language.
    constraint: tuple[str, str] | None = None
    # A reasoning model's reasoning goes free: the constraint starts after reasoning_end (token ids)
    # in the output; with reasoning_start (Qwen3's <think>) only if the output opens with it, else
    # at once. None: at the first token.
    reasoning_end: list[int] | None = None
    reasoning_start: list[int] | None = None
    # OpenAI's Predicted Outputs: the output expected, tokenized; proposed for speculative
    # verification (speculative.py), so it changes the speed, never the tokens.
    prediction: list[int] | None = None
    # The prompt's own logprobs (echo): None: off; k: each prompt token's (the first has none) plus
    # its top k. Such a prompt is computed in full, never taken from the prefix cache.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)

    def validate(self) -> None:
        """Raises ValueError (limits.LimitError) for a parameter out of its range."""
        check_sampling(self)


@dataclass
class Draft:
    """Tokens proposed to follow a sequence, verified by the target model in its next step
    (speculative.py). probs: the distribution each was drawn from ([len(tokens), vocab]), or None
    when each is a point mass (prompt lookup, or a greedy draft model)."""

    tokens: list[int]
    probs: torch.Tensor | None = None

    def truncate(self, k: int) -> "Draft":
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k])


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, priority: int = NORMAL, lora: str | None = None,
                 lora_key: str | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        # Its LoRA adapter (the engine's name for it; None: the base model) and that adapter's
        # identity, which its prefix-cache keys include (blocks of another adapter hold other KV).
        self.lora, self.lora_key = lora, lora_key
        self.cache_salt = cache_salt  # only sequences with the same salt share prefix-cache blocks
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params = params
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_published_blocks = 0  # leading full blocks already offered to the prefix cache
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at admission
        self.num_preemptions = 0
        self.priority = priority  # its class: 0 interactive, 1 normal, 2 background
        self.num_priority_preemptions = 0  # preempted to make room for a higher priority
        # The scheduler's bookkeeping (policy.py): its place in the waiting queue, the prompt tokens
        # of later arrivals of its class that went first, when it last resumed from a preemption, and, while
        # swapped out, how many computed tokens wait in host memory under which block keys.
        self.queue_order = 0
        self.overtaken_tokens = 0
        self.resumed_at: float | None = None
        self.swapped_tokens = 0
        self.swap_keys: list[int] = []
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None  # wall clock, for the queue-wait span
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # The prompt's logprobs, the first token's None (filled as its chunks are computed), until
        # they are handed out with the first output; None when not asked for (or already given).
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.grammar = None  # the constraint's matcher (constraints.py), built on first use ...
        self.grammar_from = 0  # ... for the output from this index (after the reasoning, if any) ...
        self.grammar_tokens = 0  # ... and how many output tokens it has consumed
        self.grammar_phase = None  # constraints.Phase: where the constraint starts
        self.after: "Sequence | None" = None  # a sibling (n > 1): admitted once this one's prompt is cached
        # Speculative decoding: this step's proposal, set before the step is scheduled and cleared
        # after it (nothing of it survives a step, so nothing crosses a handoff or a preemption).
        self.draft: Draft | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        """Its prompt (or a recomputed prefix) is not all computed yet: no token comes of its steps."""
        return not self.num_output_tokens or self.num_tokens - self.num_computed_tokens > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are not all computed: its prompt must not come from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
