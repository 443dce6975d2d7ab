"""Choosing workers. Pure functions over what heartbeats and KV events said, so they can be
tested and read on their own.

Prefill: cost = CACHE_WEIGHT x (prompt blocks not already cached on the worker) + load, where
load counts the requests queued there in units of an average prompt's blocks. Traffic sharing a
system prompt goes where the prompt is cached until that worker's queue outweighs the saving.
The keys are salted with the model's name (shared/prefix_hash.py `namespace`) and a worker's set is
cleared when it starts on a model, so no request counts another model's blocks (which live in
another KV arena when the shapes differ: services/kv_pool/arenas.py) as hits.
Decode: a worker on the prefill's node (the blocks are handed over by id) unless none is there or
all there are full; then one on another node (the blocks cross NATS). Among those, the most free
KV blocks, then the fewest running sequences.

Admission (the scheduler's own queues): a worker has room for a class while it has a free seat
and the requests of that class waiting there hold fewer prompt tokens than `depth` of its steps
(max_num_batched_tokens each; none waiting is always room). Both are estimated from its last
heartbeat and what happened since (requests sent it has not reported yet, requests that finished
or left it), so on an idle mesh a request goes out at once, not at the next heartbeat. An
interactive request goes to the worker that can start it soonest, room or not (its engine
preempts normal and background sequences there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshserve.shared.schemas import Heartbeat

CACHE_WEIGHT = 1.0
LOAD_WEIGHT = 8.0  # one queued request costs as much as recomputing 8 blocks (128 tokens)
INTERACTIVE_MAX_STEP_S = 0.1  # an interactive prompt goes to an idle decode worker only if it steps this fast
# An interactive prompt may go to a busy decode worker (computed in its next steps, beside its
# decodes) when the prefill workers have interactive prompts waiting ahead of it: up to this many
# tokens (a decoding worker's steps take 128 prompt tokens each), and only where steps are this short.
INTERACTIVE_SPILL_MAX_TOKENS = 512
INTERACTIVE_SPILL_MAX_STEP_S = 0.25


@dataclass
class WorkerView:
    hb: Heartbeat
    last_seen: float = field(default_factory=time.monotonic)
    cached: set[int] = field(default_factory=set)  # prefix-cache keys it reported
    assigned: set[str] = field(default_factory=set)  # requests sent to it and not yet done
    # Of those, the ones sent to prefill, in the order sent: id -> (class, prompt tokens).
    admitted: dict[str, tuple[str, int]] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)  # requests sent to prefill so far, by class
    left_since_heartbeat: int = 0  # requests that finished here or moved on since its last heartbeat

    @property
    def load(self) -> float:
        return self.hb.num_waiting + len(self.assigned) + 0.25 * self.hb.num_running


def _waiting(w: WorkerView, c: str) -> list[int]:
    """The prompt tokens of the requests of class c waiting on the worker: as many as its heartbeat
    reported plus those sent since (never more than are still assigned to it), the latest sent."""
    unheard = max(0, w.sent.get(c, 0) - w.hb.received_by_priority.get(c, 0))
    mine = [n for cls, n in w.admitted.values() if cls == c]
    k = min(len(mine), w.hb.waiting_by_priority.get(c, 0) + unheard)
    return mine[len(mine) - k:]


def waiting_there(w: WorkerView, cls: str | None = None) -> int:
    """Requests of class cls (None: all) waiting on the worker."""
    return sum(len(_waiting(w, c)) for c in ([cls] if cls is not None else list(w.sent)))


def free_seats(w: WorkerView) -> int:
    if w.hb.max_num_seqs <= 0:
        return 1 << 30  # unknown: unbounded
    running = max(0, w.hb.num_running - w.left_since_heartbeat)
    return w.hb.max_num_seqs - running - waiting_there(w)


def has_room(w: WorkerView, cls: str, depth: int, fcfs: bool = False) -> bool:
    """A free seat, and less than `depth` steps of prompt tokens of the class (fcfs: of all) waiting
    (`depth` requests when the worker's step budget is unknown)."""
    if free_seats(w) <= 0:
        return False
    waiting = [n for c in (list(w.sent) if fcfs else [cls]) for n in _waiting(w, c)]
    budget = w.hb.max_num_batched_tokens
    return not waiting or (sum(waiting) < depth * budget if budget > 0 else len(waiting) < depth)


def pick_admission(workers: list[WorkerView], cls: str, prompt_hashes: list[int], depth: int,
                   fcfs: bool = False) -> WorkerView | None:
    """A worker with room for the class, the cheapest by prefill_cost; None: it waits here."""
    return pick_prefill([w for w in workers if has_room(w, cls, depth, fcfs)], prompt_hashes)


def pick_soonest(workers: list[WorkerView], prompt_hashes: list[int], cls: str = "interactive",
                 spill: list[WorkerView] = ()) -> WorkerView | None:
    """Where a request of cls starts soonest: a free seat first (else its engine preempts lower
    classes there), then the fewest of its class waiting ahead of it, then a prefill worker before a
    decode worker that would compute it beside its decodes (`spill`, from spill_candidates), then
    prefill_cost. A burst of interactive prompts thus alternates between a node's prefill worker
    and its decode worker instead of queueing behind each other on one."""
    extra = [w for w in spill if all(w is not c for c in workers)]  # not already a candidate
    spilled = {id(w) for w in extra}
    return min([*workers, *extra], key=lambda w: (free_seats(w) <= 0, waiting_there(w, cls), id(w) in spilled,
                                                  prefill_cost(w, prompt_hashes), w.hb.worker_id), default=None)


def spill_candidates(decoders: list[WorkerView], prompt_len: int) -> list[WorkerView]:
    """Decode workers that may take an interactive prompt into their next steps (mixed role): its
    first token then waits for their step in progress and a step or few beside their decodes,
    rather than for the interactive prompts queued on the prefill workers (measured: a burst of six
    chat prompts every 2 s beside a background batch queued up to 7 s on one prefill worker)."""
    if prompt_len > INTERACTIVE_SPILL_MAX_TOKENS:
        return []
    return [w for w in decoders if 0 < w.hb.step_s <= INTERACTIVE_SPILL_MAX_STEP_S]


def uncached_blocks(prompt_hashes: list[int], cached: set[int]) -> int:
    hit = 0
    for h in prompt_hashes:  # a prefix: the first miss ends it
        if h not in cached:
            break
        hit += 1
    return len(prompt_hashes) - hit


def prefill_cost(w: WorkerView, prompt_hashes: list[int]) -> float:
    return CACHE_WEIGHT * uncached_blocks(prompt_hashes, w.cached) + LOAD_WEIGHT * w.load


def pick_prefill(workers: list[WorkerView], prompt_hashes: list[int]) -> WorkerView | None:
    return min(workers, key=lambda w: (prefill_cost(w, prompt_hashes), w.hb.worker_id), default=None)


def pick_idle_for_short_prompt(decoders: list[WorkerView], prompt_len: int, limit: int,
                               prompt_hashes: list[int], cls: str = "normal") -> WorkerView | None:
    """A decode worker with nothing queued may prefill a short prompt itself: a few tokens cost
    less to compute in its next step than a handoff costs to arrange (mixed role). Not an
    interactive one where the worker's steps are long (a big batch of long contexts): there the
    prompt waits for the step in progress and rides in the next, where a prefill worker ends its
    batch steps early for it (measured: 0.82 s against 0.39 s mean, float32, a decode worker
    stepping every ~0.4 s)."""
    if prompt_len > limit:
        return None
    idle = [w for w in decoders if w.hb.num_waiting == 0 and not w.assigned
            and (cls != "interactive" or w.hb.step_s <= INTERACTIVE_MAX_STEP_S)]
    return pick_prefill(idle, prompt_hashes)


def decode_full(w: WorkerView) -> bool:
    """Runs (or has been sent) as many sequences as it may run at once."""
    return 0 < w.hb.max_num_seqs <= max(w.hb.num_running + w.hb.num_waiting, len(w.assigned))


def pick_decode(workers: list[WorkerView], node_id: str | None = None) -> WorkerView | None:
    """node_id: where the sequence's blocks are; a worker there is preferred while it has room."""
    room = [w for w in workers if not decode_full(w)] or workers
    local = [w for w in room if w.hb.node_id == node_id]
    return max(local or room, key=lambda w: (w.hb.free_blocks - 4 * len(w.assigned), -w.hb.num_running,
                                             w.hb.worker_id), default=None)
