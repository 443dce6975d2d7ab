"""The messages services exchange over NATS. Both ends import these; payloads are orjson."""

from __future__ import annotations

from typing import Literal

import orjson
from pydantic import BaseModel, Field

from .engine.sampler import TokenLogprobs
from .engine.sequence import SamplingParams

Role = Literal["prefill", "decode", "mixed"]
Priority = Literal["interactive", "normal", "background"]


class Message(BaseModel):
    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def decode(cls, data: bytes):
        return cls.model_validate(orjson.loads(data))


class Sampling(Message):
    """SamplingParams on the wire."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    @classmethod
    def from_params(cls, p: SamplingParams) -> "Sampling":
        return cls(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                   min_p=p.min_p, seed=p.seed, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
                   logprobs=p.logprobs)

    def to_params(self) -> SamplingParams:
        # Stop strings stay at the gateway, which detokenizes.
        return SamplingParams(**self.model_dump())


class GenerateRequest(Message):
    """A tokenized request, from the gateway to the scheduler and on to a worker."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling
    priority: Priority = "normal"
    stream_subject: str  # where TokenChunks go
    arrival_time: float
    # Tokens the client has already received (re-dispatch after a worker loss): the new worker
    # recomputes prompt + these and continues from there.
    output_token_ids: list[int] = Field(default_factory=list)
    trace: dict[str, str] = Field(default_factory=dict)  # W3C traceparent carrier


class SubmitReply(Message):
    ok: bool
    error: str | None = None
    status_code: int = 200


class Logprob(Message):
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)

    @classmethod
    def of(cls, lp: TokenLogprobs | None) -> "Logprob | None":
        return None if lp is None else cls(logprob=lp.logprob, top=lp.top)


class TokenChunk(Message):
    """The tokens one engine step produced for one request. `seq` counts chunks per request so
    the gateway can tell a gap or a repeat; `index` is the position of the first token in the output."""

    request_id: str
    seq: int
    index: int
    token_ids: list[int]
    logprobs: list[Logprob | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: str = ""
    error: str | None = None


class Handoff(Message):
    """A prefilled sequence moving from a prefill worker to a decode worker: block ids, not bytes.

    The prefill worker keeps its own reference on `shared_block_ids` (full blocks in its prefix
    cache); one reference on every block moves to the decode worker (the scheduler tells the kv-pool)."""

    request: GenerateRequest
    token_ids: list[int]  # prompt + generated so far
    block_ids: list[int]
    shared_block_ids: list[int] = Field(default_factory=list)
    num_computed_tokens: int
    num_cached_tokens: int
    next_seq: int  # the next TokenChunk seq number
    from_worker: str
    node_id: str


class Abort(Message):
    request_id: str
    reason: str = "abort"


class Done(Message):
    """A worker finished (or dropped) a request: the scheduler stops tracking it."""

    request_id: str
    worker_id: str
    finish_reason: str | None = None


class Heartbeat(Message):
    worker_id: str
    role: Role
    model: str
    node_id: str
    num_running: int
    num_waiting: int
    free_blocks: int  # leased and unused
    held_blocks: int  # leased (used, cached or free)
    total_blocks: int  # of the node's arena
    block_size: int
    max_model_len: int
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    time: float


class KVEvent(Message):
    """Blocks whose prefix-cache keys appeared (stored) or vanished (removed) on a worker."""

    worker_id: str
    stored: list[int] = Field(default_factory=list)
    removed: list[int] = Field(default_factory=list)
    cleared: bool = False  # the worker started afresh: forget all it had


class ArenaDescriptor(Message):
    """Where the node's KV arena lives and its shape: workers map it, nothing is copied."""

    node_id: str
    path: str  # shared-memory file (CPU) or IPC handle (CUDA)
    backend: Literal["cpu", "cuda"] = "cpu"
    dtype: str
    shape: list[int]  # [layers, 2, num_slots, kv_heads, head_dim]
    block_size: int
    num_blocks: int


class LeaseRequest(Message):
    worker_id: str
    num_blocks: int


class LeaseReply(Message):
    block_ids: list[int]
    free_blocks: int


class BlockRefs(Message):
    """Release (or retain) one reference on each block."""

    worker_id: str
    block_ids: list[int]


class BlockTransfer(Message):
    """Moves one reference on each block from one worker to another (a handoff)."""

    from_worker: str
    to_worker: str
    block_ids: list[int]


class TransferReply(Message):
    ok: bool
    error: str | None = None


class TensorSpec(Message):
    name: str
    dtype: str
    shape: list[int]
    offset: int  # bytes into the file


class WeightsDescriptor(Message):
    """A model's weights in one shared-memory file, mapped read-only by every worker on the node."""

    model: str
    path: str
    backend: Literal["cpu", "cuda"] = "cpu"
    config: dict
    tensors: list[TensorSpec]
    tokenizer_path: str


class LoadRequest(Message):
    model: str
    dtype: str = "bfloat16"
