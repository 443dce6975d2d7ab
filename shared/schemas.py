"""The messages services exchange over NATS. Both ends import these; payloads are orjson.

These are the one definition of what crosses the bus: no engine type appears here (this module is
torch-free; the gateway and the scheduler import it). The engine converts at its own door
(shared/engine/wire.py): the wire's Sampling to its SamplingParams, its TokenLogprobs to Logprob.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from .limits import Priority, check_sampling
from .kv_layout import arena_key
from .model.config import Quantization

Role = Literal["prefill", "decode", "mixed"]


class Message(BaseModel):
    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def decode(cls, data: bytes):
        return cls.model_validate(orjson.loads(data))


class Sampling(Message):
    """A request's sampling parameters on the wire (the engine's SamplingParams, less the stop
    strings: those stay at the gateway, which detokenizes)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[list[int]] = Field(default_factory=list)  # tokenized (the engine's SamplingParams)
    constraint: tuple[str, str] | None = None  # structured output: (kind, spec), shared/engine/constraints.py
    # where a reasoning model's constraint starts (shared/reasoning.py's constraint_tags)
    reasoning_end: list[int] | None = None
    reasoning_start: list[int] | None = None
    prediction: list[int] | None = None  # OpenAI's Predicted Outputs, tokenized: proposed, never forced
    prompt_logprobs: int | None = None

    def check(self) -> None:
        """Raises limits.LimitError for a parameter out of its range."""
        check_sampling(self)


class LoRARef(Message):
    """The LoRA adapter a request runs with, as the gateway checked it (shared/lora.py): its served
    name, its directory (each worker reads the files itself: they are small) and its identity (a hash
    of the files), which the prefix-cache keys include. The request's `model` is the adapter's base."""

    name: str
    path: str
    key: str

    @property
    def engine_name(self) -> str:
        """What a worker's engine calls it: a changed adapter under the same name is another adapter."""
        return f"{self.name}@{self.key}"


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
    tenant: str | None = None  # who sent it (the gateway found it by API key); None: no tenants file
    # Bumped by the gateway at each re-submission (lost worker, scheduler restart, bus restart):
    # chunks, handoffs and dones of an older attempt are stale and ignored (docs/faults.md).
    attempt: int = 0
    # n > 1: the request id of the first choice (same prompt). The scheduler sends this one to that
    # one's worker while it is there, and the engine holds it until that prompt is in the prefix cache.
    after: str | None = None
    # A LoRA adapter of `model` (docs/models.md "Adapters"); None: the base model alone. Requests of
    # different adapters of one base run on the same workers and share their steps.
    lora: LoRARef | None = None
    # vLLM's cache_salt: only requests with the same salt share prefix-cache blocks (prefix_hash.namespace).
    cache_salt: str | None = None


NOT_READY = "not_ready"  # SubmitReply.error_code of a 503 while no worker serves the model yet (a starting mesh)


class SubmitReply(Message):
    ok: bool
    error: str | None = None
    status_code: int = 200
    # A refusal the client should hear in OpenAI's terms: error type and code, and when to retry (seconds).
    error_type: str | None = None
    error_code: str | None = None
    retry_after: float | None = None
    scheduler_id: str | None = None  # which scheduler accepted it (a restarted one has a new id)


class Usage(Message):
    """A tenant's request ended at its gateway (finished, failed or abandoned): the scheduler frees
    its concurrency slot and charges what it used against the tenant's tokens_per_minute."""

    request_id: str
    output_tokens: int = 0


class Logprob(Message):
    logprob: float  # of the sampled token
    top: list[tuple[int, float]] = Field(default_factory=list)  # the most likely alternatives, best first
    rank: int | None = None  # of the token in its distribution (1: the most likely); prompt logprobs only


# A request someone holds without streaming its tokens (queued in the scheduler, waiting or in
# prefill in a worker's engine) says so this often (TokenChunk.queued); a gateway that heard nothing
# of one for STALL_S knows it was lost on the way and re-submits it. MESHSERVE_KEEPALIVE_S sets it
# for the whole mesh (every service reads it; tests shorten it).
KEEPALIVE_S = float(os.environ.get("MESHSERVE_KEEPALIVE_S", "20"))
STALL_S = 2.25 * KEEPALIVE_S  # a keepalive lost with a reconnecting bus does not make a stall


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
    error_status: int | None = None  # 400: the request itself cannot run (too long, ...); None: by `error`
    attempt: int = 0  # the GenerateRequest.attempt it belongs to
    prompt_logprobs: list[Logprob | None] | None = None  # the prompt's (echo), in the first chunk
    # No tokens, only news that the request is still waiting its turn (in the scheduler's queue, or
    # queued or preempted in a worker's engine): the gateway's no-token timeout starts again.
    queued: bool = False


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
    arena: str | None = None  # the key of the arena on node_id the block ids are of (None: its first)


class Abort(Message):
    request_id: str
    reason: str = "abort"
    # Set when a gateway re-submits: abort attempts up to this one (workers hear it directly,
    # since the scheduler that routed them may be gone); None: the request, whatever its attempt.
    attempt: int | None = None


class ServiceHello(Message):
    """Published every second by a scheduler (and a kv-pool, per node): a new id means a restart."""

    service_id: str


class Done(Message):
    """A worker finished (or dropped) a request: the scheduler stops tracking it."""

    request_id: str
    worker_id: str
    finish_reason: str | None = None
    attempt: int = 0


class Heartbeat(Message):
    worker_id: str
    role: Role
    model: str
    node_id: str
    num_running: int
    num_waiting: int
    free_blocks: int  # leased and unused
    held_blocks: int  # leased (used, cached or free)
    total_blocks: int  # of its arena on the node
    block_size: int
    max_model_len: int
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    max_num_seqs: int = 0  # sequences it runs at most (0: unknown); the scheduler's "full"
    max_num_batched_tokens: int = 0  # tokens of one step (0: unknown); the scheduler's queue depth unit
    num_priority_preemptions: int = 0  # of num_preemptions, those that made room for a higher priority
    running_by_priority: dict[str, int] = Field(default_factory=dict)  # {"interactive": n, ...}
    waiting_by_priority: dict[str, int] = Field(default_factory=dict)  # its engine's queue and inbox
    # Requests the scheduler sent it so far, by class: the scheduler counts those it sent since
    # and has not heard of yet as waiting there (admission does not wait for a heartbeat).
    received_by_priority: dict[str, int] = Field(default_factory=dict)
    preemptions_by_mode: dict[str, int] = Field(default_factory=dict)  # {"swap": n, "recompute": m}
    # Speculative decoding's counters (shared/engine/speculative.py SpecStats): num_draft_tokens,
    # num_accepted_tokens, num_verification_steps; empty when the worker does not speculate.
    spec_decode: dict[str, int] = Field(default_factory=dict)
    # The counters above, for each model it served (its running engine's and those before): /metrics
    # shows them per model.
    counters_by_model: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # CPU seconds of the worker's event-loop thread so far (NATS in and out, the token messages,
    # block leases): what the mesh adds around the engine's steps; and the tokens it streamed.
    io_cpu_s: float = 0.0
    step_s: float = 0.0  # recent mean wall time of its engine steps (0: none yet)
    # The CUDA IPC handles of the node's allocations it still has open (shared/cuda_ipc.py
    # open_handles): the loader and the kv-pool free a retired GPU buffer only once no worker lists it.
    ipc_open: list[str] = Field(default_factory=list)
    tokens_streamed: int = 0
    # Work still to do here, for the elastic roles (services/scheduler/roles.py): prompt tokens not
    # yet computed, and output tokens not yet generated (max_tokens less those done).
    pending_prefill_tokens: int = 0
    pending_decode_tokens: int = 0
    # Its steps' measured rates (shared/engine/policy.py StepRates; 0: no such step yet): prompt
    # tokens per second in prefill steps, output tokens per second in decode-only steps. Their ratio
    # is what an output token weighs against a prompt token in the elastic roles' drain times.
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    # SIGTERM: it takes nothing new, hands its sequences on (or finishes them) and exits.
    draining: bool = False
    # Node-level compute priority (services/worker/compute_claims.py): how many times, and for how
    # many seconds in all, it held a step back for another worker's claim; whether it claims now.
    compute_yields: int = 0
    compute_yield_s: float = 0.0
    compute_claim: bool = False
    # Steps it ended early for an interactive request or a role switch that arrived (LLMEngine.urgent).
    interrupted_steps: int = 0
    threads: dict[str, Any] = Field(default_factory=dict)  # its thread tuner's stats (threads.py); {}: fixed
    arena: str = ""  # the key of the node's KV arena its model's blocks are in (shared/kv_layout.py)
    time: float


class ComputeClaim(Message):
    """A worker -> the other workers of its node (`<ns>.compute.<node>.claim`): it computes prompt
    work of class `priority` (active), or no longer does (not active). A claim is a lease: it is
    repeated while it lasts, and one not heard again within `lease_s` has ended (its worker died).
    `cores`: those its steps run on (empty: the whole node); only workers sharing one yield."""

    worker_id: str
    priority: Priority = "interactive"
    active: bool = True
    lease_s: float = 1.0
    cores: list[int] = Field(default_factory=list)


class RoleSwitch(Message):
    """Scheduler -> one worker: change role (prefill <-> decode) at the next iteration boundary.
    To decode: it keeps its sequences and decodes them itself. To prefill: it hands its decoding
    sequences to other decode workers (block ids, as after a prefill). Nothing is reloaded."""

    role: Literal["prefill", "decode"]
    reason: str = ""


class KVEvent(Message):
    """Blocks whose prefix-cache keys appeared (stored) or vanished (removed) on a worker."""

    worker_id: str
    stored: list[int] = Field(default_factory=list)
    removed: list[int] = Field(default_factory=list)
    cleared: bool = False  # the worker started afresh: forget all it had
    node_id: str = ""
    tier: Literal["arena", "host"] = "arena"  # host: the kv-pool's swap tier (worker_id names the pool)
    arena: str | None = None  # the arena (host: whose swap tier) the keys are in; None: the node's first


class KVShape(Message):
    """A model's KV shape, what a node makes one arena for (its fields are ModelConfig's, so
    shared/kv_layout.py reads it as it reads a config); `dtype` is the arena's element dtype: the
    model's, or int8 for any model under --kv-cache-dtype int8."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    dtype: str

    @property
    def key(self) -> str:
        return arena_key(self, self.dtype)


class ArenaRequest(Message):
    """A worker asks its node's kv-pool for the arena of its model's KV shape; the pool makes it on the
    first ask (services/kv_pool/arenas.py) or answers an error saying why it cannot."""

    worker_id: str = ""
    model: str | None = None  # the served model that asks (logs, the arena's users)
    shape: KVShape | None = None  # None: the node's first arena, made at start


class ArenaDescriptor(Message):
    """Where one of the node's KV arenas lives and its shape: workers map it, nothing is copied."""

    node_id: str
    key: str = ""  # shared/kv_layout.py arena_key: what messages with block ids name it by
    path: str  # shared-memory file (cpu), or where the GPU memory lives, e.g. "cuda:0" (cuda)
    backend: Literal["cpu", "cuda"] = "cpu"
    ipc: dict | None = None  # cuda: shared/cuda_ipc.py's descriptor of the arena's allocation (uint8)
    dtype: str
    shape: list[int]  # [layers, 2, num_slots, kv_heads, row]; row: head_dim (+ 4 for int8, kv_layout.py)
    block_size: int
    num_blocks: int  # the blocks leased now (the arena's size when the worker asked; `ArenaResized`)
    capacity_blocks: int = 0  # the blocks `shape` has room for (0: num_blocks): a shared file's can grow to it
    swap_blocks: int = 0  # capacity of the kv-pool's host swap tier (0: none)
    epoch: str = ""  # the kv-pool process's id: its hellos carry it, a new one means a new ledger
    arena_id: str = ""  # this arena's own id: one retired and made again (same key) has a new one


class ArenaRetired(Message):
    """The kv-pool retired an arena nobody used (services/kv_pool/arenas.py `retirable`): workers
    that still map it drop their mapping, so its memory goes back to the node."""

    node_id: str
    key: str
    arena_id: str
    reason: str = ""


class ArenaResized(Message):
    """The kv-pool resized an arena in use (services/kv_pool/arenas.py `resizes`): it leases only
    ids below num_blocks now, so workers of that arena give back the blocks at or beyond it as they
    become free (spilling cached ones to the host tier first), and a request that needs more than
    num_blocks is refused."""

    node_id: str
    key: str
    arena_id: str
    num_blocks: int


class LeaseRequest(Message):
    worker_id: str
    num_blocks: int
    arena: str | None = None  # the arena's key (None: the node's first arena); so in every message below
    # The model the blocks are for, and its weights' bytes on the node: the kv-pool leases a model
    # at most its memory quota less its weights (shared/partitions.py).
    model: str | None = None
    weights_bytes: int = 0


class LeaseReply(Message):
    block_ids: list[int]
    free_blocks: int
    quota_blocks: int | None = None  # the most blocks the model may hold on the node (None: no quota)
    model_blocks: int = 0  # the blocks the model's workers hold now, these included
    arena_blocks: int | None = None  # the arena's size now (ArenaResized)


class PoolPressure(Message):
    """The kv-pool could not lease all a worker asked for: workers give back the free blocks they
    keep for their prefix caches (spilling those to the host tier), not only the empty ones."""

    node_id: str
    asked: int
    free_blocks: int
    model: str | None = None  # short by that model's quota, not the arena: only its workers give back
    arena: str | None = None  # the arena that was short: only its workers' blocks can help


class BlockRefs(Message):
    """Release (or retain) one reference on each block."""

    worker_id: str
    block_ids: list[int]
    arena: str | None = None


class BlockTransfer(Message):
    """Moves one reference on each block from one worker to another (a handoff)."""

    from_worker: str
    to_worker: str
    block_ids: list[int]
    arena: str | None = None


class TransferReply(Message):
    ok: bool
    error: str | None = None


class TensorSpec(Message):
    name: str
    dtype: str
    shape: list[int]
    offset: int  # bytes into the file (cpu) or the allocation (cuda)


class WeightsDescriptor(Message):
    """A model's weights in one buffer every worker on the node opens read-only: a shared-memory
    file (backend cpu) or one GPU allocation shared by its CUDA IPC handle (backend cuda)."""

    model: str
    path: str  # the file (cpu), or where the GPU memory lives, e.g. "cuda:0" (cuda)
    backend: Literal["cpu", "cuda"] = "cpu"
    ipc: dict | None = None  # cuda: shared/cuda_ipc.py's descriptor of the allocation (uint8)
    config: dict
    tensors: list[TensorSpec]
    tokenizer_path: str
    quantization: Quantization | None = None
    tier: str | None = None  # where this load found it: mapped, host, disk (prepared) or source
    load_s: float = 0.0  # how long bringing it into the mapped tier took
    # Layered loading (shared/model/layer_gate.py): the loader is still writing the weights, part by
    # part; this shared file's int64 word counts the parts written (-1: failed). None: complete.
    ready_path: str | None = None


class LoadRequest(Message):
    """A model in one format: the loader keeps each (model, dtype, quantization) it is asked for, so
    one source can be served as bf16 and int8 side by side (a model manifest sets these per model)."""

    model: str
    dtype: str = "bfloat16"
    quantization: Quantization | None = None  # "int8": weight-only int8 projections (kernels/int8_linear.py)
    # The worker that will map it: the loader never evicts a model a worker maps, and a worker's
    # new load moves it off the model it mapped before (how a model switch releases the old one).
    worker_id: str | None = None
    name: str | None = None  # its served name (logs and status)
    # Mapped beside the worker's model (its speculative draft), not instead of it: kept in use by the
    # worker until its next model's load.
    beside: bool = False


class PrewarmRequest(Message):
    """Scheduler -> a node's model-loader: bring a model up to `to` before it is asked for (its request
    rate predicts it will be, services/scheduler/prewarm.py); first move the models in `evict` down
    one tier (the coldest by rate; skipped if a worker maps one or it is pinned)."""

    model: str
    dtype: str = "bfloat16"
    quantization: Quantization | None = None
    name: str | None = None
    to: Literal["mapped", "host"] = "mapped"
    evict: list[str] = Field(default_factory=list)  # served names (ids)


class ModelSwitch(Message):
    """Scheduler -> one idle worker: serve another model of the manifest. The worker finishes what it
    runs, maps the model's weights (asking its node's loader), builds a new engine on the same KV
    arena and replies; on failure it keeps the model it had and says why."""

    name: str  # the served name
    path: str
    dtype: str = "bfloat16"
    quantization: Quantization | None = None
    reason: str = ""


class ModelSwitchReply(Message):
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    tier: str | None = None  # where the loader found the weights
    refused: bool = False  # the worker did not try (it is draining): not the model's failure


class SwapRequest(Message):
    """Moves blocks between a worker's leased arena blocks and the node's host swap tier, by ids:
    the kv-pool copies (no KV byte crosses NATS). `swap_out` runs first, so a block may be spilled
    and refilled in one request."""

    worker_id: str
    arena: str | None = None  # its blocks' arena, whose own host tier it is
    swap_out: list[tuple[int, int]] = Field(default_factory=list)  # (block id, its prefix-cache key)
    swap_in: list[tuple[int, int]] = Field(default_factory=list)  # (key, block id to fill), a prefix chain


class SwapReply(Message):
    ok: bool
    stored: int = 0  # of swap_out, newly in the host tier (the others were there already)
    restored: int = 0  # the leading entries of swap_in that were found and copied back
    error: str | None = None


class KVImport(Message):
    """A decode worker asks its node's kv-pool to pull a handed-off sequence's blocks from another
    node into fresh blocks leased to the worker."""

    transfer_id: str
    worker_id: str
    src_node: str
    src_worker: str  # holds one reference on each source block until the transfer closes
    block_ids: list[int]  # the handed-over blocks (all released on the source once it is over)
    num_tokens: int  # of those, the tokens whose KV is computed: only their blocks are copied
    model: str | None = None  # the model the fresh blocks count against (its memory quota)
    arena: str | None = None  # the worker's arena here, where the fresh blocks are
    src_arena: str | None = None  # the source's arena on src_node (Handoff.arena)


class KVImportReply(Message):
    ok: bool
    block_ids: list[int] = Field(default_factory=list)  # on this node, in the order of the source's
    bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    error: str | None = None


class KVFetchOpen(Message):
    """Opens a pull of blocks from a node's arena. The payload is the blocks one after the other,
    each block as its 2 x layers contiguous segments (block_size x kv_heads x row elements; an int8
    row carries its scale, shared/kv_layout.py)."""

    transfer_id: str
    holder: str
    block_ids: list[int]
    arena: str | None = None  # the source node's arena the block ids are of (None: its first)
    dtype: str
    block_shape: list[int]  # [layers, 2, block_size, kv_heads, row]: both ends must agree (dtype too)
    max_chunk_bytes: int
    also_release: list[int] = Field(default_factory=list)  # the holder's blocks not copied (nothing computed)


class KVFetchInfo(Message):
    ok: bool
    total_bytes: int = 0
    chunk_bytes: int = 0
    num_chunks: int = 0
    error: str | None = None


class KVChunkRequest(Message):
    """One chunk of an open pull; the reply is the raw bytes, its index and CRC-32 in headers."""

    transfer_id: str
    index: int


class KVFetchClose(Message):
    transfer_id: str
    release: bool = True  # drop the holder's reference on the source blocks
