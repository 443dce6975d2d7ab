"""The scheduler's routing rules on their own: cache-aware prefill choice, load balancing, decode choice."""

from __future__ import annotations

import time

from meshserve.services.scheduler.routing import (LOAD_WEIGHT, WorkerView, pick_decode,
                                                   pick_idle_for_short_prompt, pick_prefill, uncached_blocks)
from meshserve.shared.prefix_hash import prompt_block_hashes
from meshserve.shared.schemas import Heartbeat


def view(wid: str, role: str = "prefill", waiting: int = 0, running: int = 0, free: int = 100,
         cached: set[int] | None = None) -> WorkerView:
    hb = Heartbeat(worker_id=wid, role=role, model="m", node_id="n", num_running=running, num_waiting=waiting,
                   free_blocks=free, held_blocks=free, total_blocks=1000, block_size=16, max_model_len=4096,
                   time=time.time())
    return WorkerView(hb, cached=cached or set())


def test_prefix_of_cached_blocks_counts_until_the_first_miss():
    hashes = prompt_block_hashes(list(range(64)), 16, "m")
    assert len(hashes) == 4
    assert uncached_blocks(hashes, set(hashes)) == 0
    assert uncached_blocks(hashes, {hashes[0], hashes[2]}) == 3  # the chain breaks at block 1
    assert prompt_block_hashes(list(range(64)), 16, "other") != hashes  # keys name the model too


def test_shared_system_prompt_goes_where_it_is_cached_until_that_worker_is_busy():
    system = list(range(1000, 1000 + 16 * 20))  # 20 blocks shared by every request
    hashes = prompt_block_hashes(system + [1, 2, 3] * 6, 16, "m")
    warm, cold = view("warm", cached=set(hashes[:20])), view("cold")
    assert pick_prefill([cold, warm], hashes) is warm
    # Each queued request costs LOAD_WEIGHT blocks: once the warm worker's queue outweighs the
    # 20 blocks it saves, new requests spill over to the cold worker.
    warm.assigned = {f"r{i}" for i in range(int(20 / LOAD_WEIGHT) + 1)}
    assert pick_prefill([cold, warm], hashes) is cold


def test_decode_goes_to_free_blocks_then_fewest_running():
    a, b, c = view("a", "decode", free=50), view("b", "decode", free=200, running=9), view("c", "decode", free=200)
    assert pick_decode([a, b, c]) is c
    assert pick_decode([]) is None


def test_idle_decode_worker_takes_short_prompts_only():
    idle, busy = view("idle", "decode"), view("busy", "decode", waiting=2)
    assert pick_idle_for_short_prompt([busy, idle], 20, 32, []) is idle
    assert pick_idle_for_short_prompt([busy, idle], 200, 32, []) is None  # long: a prefill worker's job
    idle.assigned = {"r1"}
    assert pick_idle_for_short_prompt([busy, idle], 20, 32, []) is None  # nobody is idle now
