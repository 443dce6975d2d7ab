"""The host swap tier: its LRU bookkeeping alone, a worker's spill and restore against the engine in
process, and a real mesh whose arena is too small to keep a prefix: the prefix comes back from the
kv-pool's host tier, the prompt skips recomputing it, and greedy outputs still equal the engine's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from openai import OpenAI

from mesh_util import Mesh
from meshserve.services.kv_pool.blocks import ArenaBlocks
from meshserve.services.kv_pool.swap import HostTier
from meshserve.services.worker.kv_blocks import KVBlocks
from meshserve.services.worker.kv_pool_client import KVPoolClient
from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.schemas import SwapReply, SwapRequest
from meshserve.shared.subjects import Subjects


def data(v: int, n: int = 8) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_host_tier_keeps_the_most_recently_used_within_its_capacity():
    t = HostTier(3, 8)
    assert all(t.put(k, data(k)) for k in (1, 2, 3))
    assert not t.put(2, data(99))  # there already: refreshed, not copied again
    assert torch.equal(t.get(2), data(2))
    assert t.get(1) is not None  # order now (LRU first): 3, 2, 1
    assert t.put(4, data(4))  # full: 3 goes
    assert 3 not in t and {1, 2, 4} == set(t.index) and len(t) == 3
    assert t.get(3) is None
    assert t.drain_events() == ([1, 2, 3, 4], [3]) and t.drain_events() == ([], [])
    assert torch.equal(t.get(4), data(4)) and torch.equal(t.get(1), data(1))  # slots reused correctly
    s = t.stats()
    assert (s["capacity_blocks"], s["used_blocks"], s["swapped_out"], s["evicted"]) == (3, 3, 4, 1)
    assert (s["lookups"], s["hits"]) == (5, 4)


def test_a_tier_of_no_space_keeps_nothing():
    t = HostTier(0, 8)
    assert not t.enabled and not t.put(1, data(1)) and t.get(1) is None and not len(t)


def test_swap_request_spills_first_then_restores_a_prefix_chain():
    arena = torch.arange(2 * 2 * 8 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 8 * 4, 1, 2)
    blocks = ArenaBlocks(arena, 4)
    t = HostTier(4, blocks.block_bytes)
    before = [blocks.read(b).clone() for b in range(8)]
    assert t.apply(blocks, SwapRequest(worker_id="w", swap_out=[(0, 100), (1, 101)])) == SwapReply(ok=True, stored=2)
    # Block 0 is spilled again (no copy) and refilled with key 101's bytes in the same request;
    # key 999 is missing, so 100 after it is not restored (the chain is broken there).
    r = t.apply(blocks, SwapRequest(worker_id="w", swap_out=[(0, 100)], swap_in=[(101, 0), (999, 5), (100, 6)]))
    assert (r.stored, r.restored) == (0, 1)
    assert torch.equal(blocks.read(0), before[1]) and torch.equal(blocks.read(6), before[6])


# -- a worker's side against its engine, in process (the kv-pool's copy is the same HostTier.apply)

class FakeBus:
    """The kv-pool's `swap` answered in process, on the engine's own KV cache."""

    def __init__(self, kv_cache: torch.Tensor, block_size: int, capacity: int):
        self.subjects = Subjects("t")
        self.blocks = ArenaBlocks(kv_cache, block_size)
        self.host = HostTier(capacity, self.blocks.block_bytes)
        self.requests: list[SwapRequest] = []

    async def request(self, subject, msg, reply, timeout=None):
        assert subject == "t.kv.node0.swap"
        self.requests.append(msg)
        return self.host.apply(self.blocks, msg)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(str(tiny_llama), "float32")


def test_spilled_prefix_comes_back_and_is_a_prefix_hit(tiny_llama, reference):
    from meshserve.shared.engine.llm_engine import EngineConfig

    llm = LLM(str(tiny_llama), "float32", config=EngineConfig(num_kv_blocks=24))
    e, pool, kv = llm.engine, llm.engine.block_pool, llm.engine.kv_cache_manager
    bus = FakeBus(e.kv_cache, kv.block_size, capacity=16)
    mover = KVBlocks(e, KVPoolClient(bus, "node0", "decode-node0-1"), lease_blocks=0, swap_blocks=16,
                     report=lambda kind, h: None)
    prompt = [(7 * j) % 300 + 3 for j in range(70)]  # 4 full blocks
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = reference.generate([prompt], greedy)[0].token_ids

    assert e.generate([prompt], greedy)[0] == want
    cached = pool.cached_keys()
    assert len(cached) >= 4
    asyncio.run(mover.make_room(3))  # enough uncached free blocks: nothing to spill
    assert not bus.requests
    asyncio.run(mover.make_room(pool.num_free))  # the step may take every block: spill them all
    assert not pool.cached_keys() and set(cached) <= set(bus.host.index) and mover.num_spilled == len(cached)
    e.kv_cache.zero_()  # the arena forgets: only the host tier has the prefix now

    hits = kv.prefix_hits
    assert asyncio.run(mover.prepare(prompt)) == 4  # the prompt's 4 full blocks come back
    assert e.generate([prompt], greedy)[0] == want
    assert kv.prefix_hits - hits == 4 * kv.block_size  # found in the prefix cache, not recomputed
    stored, removed = pool.drain_events()
    assert set(cached) <= set(removed) and len(set(stored) & set(cached)) >= 4


# -- a mesh whose arena is too small to keep a prefix

PREFIX = [(7 * j) % 300 + 3 for j in range(120)]  # 7 full blocks (a hit leaves one token to compute)


def other(i: int) -> list[int]:
    return [(11 * j + 17 * i) % 300 + 40 for j in range(120)]


def complete(mesh, prompt) -> tuple[str, int]:
    """Greedy text of 4 tokens and how many prompt tokens were prefix-cache hits."""
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused")
    r = client.completions.create(model=mesh.model, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    details = r.usage.prompt_tokens_details
    return r.choices[0].text, (details.cached_tokens if details else 0) or 0


@pytest.fixture(scope="module")
def small_mesh(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swap-mesh")
    # 52 blocks of 16 tokens in the arena, one worker that prefills and decodes, small steps.
    with Mesh(tiny_llama, tmp, prefill=0, decode=1,
              extra=["--kv-cache-gb", "0.0004", "--swap-space", "0.01", "--max-num-batched-tokens", "64"]) as m:
        yield m


def test_prefix_evicted_from_the_arena_comes_back_from_the_host_tier(small_mesh, reference):
    mesh = small_mesh

    def want(prompt):
        return reference.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].text

    assert complete(mesh, PREFIX) == (want(PREFIX), 0)
    for i in range(8):  # 8 x 8 blocks through a 52-block arena: the prefix's blocks are taken
        assert complete(mesh, other(i))[0] == want(other(i))
    before = mesh.ask("kv.node0.status")["swap"]
    assert before["swapped_out"] >= 7, before

    text, cached = complete(mesh, PREFIX)
    after = mesh.ask("kv.node0.status")
    assert text == want(PREFIX)
    assert cached == 112, "the prefix was recomputed instead of coming back from the host tier"
    assert after["swap"]["hits"] - before["hits"] >= 7 and after["swap"]["swapped_in"] >= 7, after["swap"]
    assert after["cached_blocks"].get("kv-pool-node0", 0) == after["swap"]["used_blocks"] > 0  # host-tier events


# -- a mesh whose arena has room: cached prefixes stay in the worker, nothing is copied to the host


@pytest.fixture(scope="module")
def roomy_mesh(tiny_llama, tmp_path_factory):
    with Mesh(tiny_llama, tmp_path_factory.mktemp("roomy-mesh"), prefill=0, decode=1,
              extra=["--swap-space", "0.01", "--max-num-batched-tokens", "64"]) as m:
        yield m


def test_a_prefix_stays_cached_without_spilling_while_the_arena_has_room(roomy_mesh, reference):
    mesh = roomy_mesh
    want = reference.generate([PREFIX], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].text
    assert complete(mesh, PREFIX) == (want, 0)
    for i in range(40):  # 40 x 8 blocks: more than the worker's first lease of 256 blocks
        complete(mesh, other(100 + i))
    assert complete(mesh, PREFIX) == (want, 112)  # still in the worker's prefix cache
    swap = mesh.ask("kv.node0.status")["swap"]
    assert swap["swapped_out"] == 0, swap  # the worker leased fresh blocks instead of spilling
