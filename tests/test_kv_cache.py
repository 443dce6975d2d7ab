"""The engine's KV bookkeeping without a model: the block pool, the per-sequence manager on top of
it, and the scheduler's block demand. Examples first, then property-based tests (hypothesis):
random sequences of allocate / compute / free / cache / spill / restore / detach / adopt / lease /
give-back keep the invariants, against a model of the arena that records what each block holds."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshserve.shared.engine.block_pool import BlockPool
from meshserve.shared.engine.kv_cache_manager import KVCacheManager
from meshserve.shared.engine.scheduler import Scheduler, SchedulerConfig
from meshserve.shared.engine.sequence import SamplingParams, Sequence
from meshserve.shared.prefix_hash import prompt_block_hashes

BS = 4


def seq(tokens, rid="r", max_tokens=4) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def compute(kv: KVCacheManager, s: Sequence, n: int) -> bool:
    """What a step does for one sequence: blocks for n more tokens, then they are computed."""
    if not kv.allocate(s, n):
        return False
    s.num_computed_tokens += n
    kv.cache_computed_blocks(s)
    return True


# -- the pool by example


def test_pool_takes_least_recently_used_and_a_freed_prefix_stays_findable():
    pool = BlockPool(4)
    a, b = pool.take(), pool.take()
    assert (a, b) == (0, 1) and pool.num_free == 2 and pool.num_held == 4
    pool.cache(a, 111)
    pool.cache(b, 111)  # another block already holds this key: b stays uncached
    assert pool.lookup(111) == a and pool.key_of(b) is None
    pool.unref(a)
    pool.unref(b)
    assert pool.is_free(a) and pool.lookup(111) == a  # free, still cached
    pool.ref(a)  # a prefix hit takes it back out of the free queue
    assert not pool.is_free(a) and pool.ref_count(a) == 1
    pool.unref(a)
    assert [pool.take() for _ in range(4)] == [2, 3, 1, 0]  # LRU order; the cached one last
    assert pool.lookup(111) is None and pool.drain_events() == ([111], [111]) and pool.drain_events() == ([], [])
    pool.check()


def test_pool_puts_uncached_free_blocks_first_and_names_what_would_be_overwritten():
    pool = BlockPool(6)
    for b in range(6):
        pool.take()
    for b in (0, 1, 2):
        pool.cache(b, 100 + b)
    for b in range(6):
        pool.unref(b)  # free queue: 0 1 2 (cached) 3 4 5
    assert pool.cached_in_next(2) == []  # the 3 uncached ones go first: nothing cached among the next 2
    assert pool.cached_in_next(4) == [(0, 100)]  # 3 uncached go first, then the LRU cached one
    assert [pool.take() for _ in range(3)] == [3, 4, 5]
    dest, victims = pool.restore_targets(2, keep={0})
    assert dest == [] and victims == [(1, 101), (2, 102)]  # 0 is kept (a prefix about to be hit)
    pool.forget(1)
    pool.restore(1, 555)
    assert pool.lookup(555) == 1 and pool.lookup(101) is None
    pool.check()


def test_pool_leases_and_gives_back_the_least_useful_blocks_first():
    pool = BlockPool(10, free_blocks=[])  # the mesh: a worker starts holding nothing
    assert pool.num_held == 0 and pool.usage == 0.0
    pool.add_free([1, 2, 3])  # queue: 3 2 1 (fresh ones go first)
    b = pool.take()
    pool.cache(b, 42)
    pool.unref(b)  # queue: 2 1 3 (cached)
    pool.add_free([7, 8])  # queue: 8 7 2 1 3: fresh blocks before the cached one
    assert pool.take() == 8 and pool.num_held == 5 and pool.usage == 1 - 4 / 5
    assert pool.release_surplus(3) == 3 and pool.drain_releases() == [7, 2, 1]  # uncached first
    assert pool.release_surplus(5) == 1 and pool.drain_releases() == [3]  # then the cached, its key dropped
    assert pool.drain_events() == ([42], [42]) and pool.num_held == 1 and pool.lookup(42) is None
    pool.check()


def test_blocks_beyond_a_shrunk_arena_leave_when_free_and_the_rest_once_freed():
    """The node's arena shrank to 4 blocks (services/worker/kv_blocks.py `release_outside`): the
    free and idle shared blocks from 4 on leave now, cached ones with their keys; referenced ones
    leave once freed; blocks below 4 stay, cached or not."""
    pool = BlockPool(8, free_blocks=[])
    pool.add_free(range(8))
    taken = {pool.take() for _ in range(8)}
    assert taken == set(range(8))
    pool.cache(2, 20)
    pool.cache(5, 50)
    pool.cache(6, 60)
    for b in (2, 5, 7):
        pool.unref(b)  # free: 2 (cached), 5 (cached), 7
    assert pool.hand_over(6)  # 6: cached and handed over: idle shared here
    pool.drain_events()
    assert pool.cached_from(4) == [(5, 50)]
    assert pool.release_from(4) == 1  # 4 is still referenced
    assert sorted(pool.drain_releases()) == [5, 6, 7] and pool.drain_events() == ([], [50, 60])
    assert pool.lookup(20) == 2 and pool.is_free(2) and pool.num_held == 5
    pool.unref(4)
    assert pool.release_from(4) == 0 and pool.drain_releases() == [4]
    pool.check()


def test_handed_over_blocks_shared_cached_ones_stay_read_only_until_released():
    pool = BlockPool(8, max_shared_cached=1)
    blocks = [pool.take() for _ in range(3)]
    pool.cache(blocks[0], 10)
    pool.cache(blocks[1], 11)
    assert [pool.hand_over(b) for b in blocks] == [True, True, False]
    assert pool.num_held == 6  # the uncached block left, and the idle shared one beyond the cap
    assert pool.drain_releases() == [blocks[0]] and pool.lookup(10) is None and pool.lookup(11) == blocks[1]
    assert not pool.is_free(blocks[1]) and not pool.is_exclusive(blocks[1])
    pool.ref(blocks[1])  # a hit on the shared prefix
    pool.unref(blocks[1])
    assert not pool.is_free(blocks[1])  # back to idle shared, never overwritten here
    pool.check()


def test_adopting_a_block_already_held_idle_takes_it_out_of_its_queue():
    pool = BlockPool(4)
    b = pool.take()
    pool.cache(b, 7)
    pool.hand_over(b)  # idle shared here
    pool.adopt(b, shared=True)  # the same prefix comes back with another handed-off sequence
    assert pool.ref_count(b) == 1 and pool.num_held == 4
    pool.check()
    pool.unref(b)
    pool.adopt(3, shared=False)  # a free block adopted (held already): out of the free queue
    assert not pool.is_free(3) and pool.num_held == 4
    pool.check()


# -- the per-sequence manager by example


def test_manager_prefix_hits_blocks_short_and_free():
    kv = KVCacheManager(BlockPool(6), BS, model="m")
    a = seq(list(range(10)), "a")
    assert compute(kv, a, 10)
    assert len(a.block_table) == 3 and a.num_published_blocks == 2
    b = seq(list(range(8)) + [99, 98, 97], "b")
    assert kv.prefix_keys(b.token_ids) == prompt_block_hashes(list(range(8)) + [99, 98], BS, "m")
    assert kv.blocks_short(b, 11) == 0
    assert kv.allocate(b, 11) and b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and kv.pool.ref_count(a.block_table[0]) == 2
    assert kv.prefix_hits == 8 and kv.prefix_queries == 21
    c = seq(list(range(50, 70)), "c")
    assert kv.blocks_short(c, 20) == 3 and not kv.allocate(c, 20)  # 2 free, 5 needed
    assert kv.num_freeable(a) == 1  # its first two blocks are b's too
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free == 6 and a.block_table == [] and a.num_computed_tokens == 0
    kv.pool.check()


def test_manager_hands_a_sequence_to_another_engine():
    # One arena of 8 blocks: the prefill engine holds 0-3, the decode engine 4-7.
    prefill = KVCacheManager(BlockPool(8, free_blocks=[0, 1, 2, 3]), BS, model="m")
    decode = KVCacheManager(BlockPool(8, free_blocks=[4, 5, 6, 7]), BS, model="m")
    s = seq(list(range(9)))
    assert compute(prefill, s, 9)
    blocks, shared = prefill.detach(s)
    assert blocks == [0, 1, 2] and shared == [0, 1] and s.block_table == []
    assert prefill.pool.num_held == 3 and not prefill.pool.is_free(0)  # 2 kept read-only, the tail left
    t = seq(list(range(9)) + [5])
    decode.adopt(t, blocks, shared, num_computed_tokens=9, num_cached_tokens=0)
    assert t.block_table == blocks and t.num_computed_tokens == 9 and decode.pool.num_held == 7
    assert compute(decode, t, 1)
    decode.free(t)
    assert decode.pool.drain_releases() == [] and decode.pool.is_free(2)  # shared ones idle, the tail free
    assert decode.pool.lookup(s.block_hashes[0]) == 0  # the decode side caches the prefix too
    decode.pool.check()
    prefill.pool.check()


# -- property: random operations keep the pool's and the manager's invariants

PREFIXES = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 9, 9]]  # block-sized chunks that prompts share


class KVMachine(RuleBasedStateMachine):
    """One engine's pool in an arena of N blocks: it starts with some, leases more, gives some back,
    hands sequences to another worker and adopts them (and foreign ones). The model says which
    blocks it owns, what each block of the arena holds, and which tokens each cached key names."""

    N = 24

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.N, free_blocks=range(8), max_shared_cached=3)
        self.kv = KVCacheManager(self.pool, BS, model="m")
        self.owned = set(range(8))
        self.elsewhere: Counter[int] = Counter()  # blocks another worker holds (handed over from here)
        self.live: list[Sequence] = []
        self.away: list[tuple[Sequence, list[int], list[int]]] = []  # detached, not yet adopted back
        self.content: dict[int, tuple] = {}  # block -> the tokens it holds
        self.key_tokens: dict[int, tuple] = {}  # key -> the tokens of its block
        self.spilled: dict[int, tuple] = {}  # keys in the "host tier"
        self.n = 0

    def _unowned(self) -> list[int]:
        return [b for b in range(self.N) if b not in self.owned and b not in self.elsewhere]

    def _write(self, s: Sequence, start: int, end: int) -> None:
        for p in range(start, end):
            b = s.block_table[p // BS]
            row = list(self.content.get(b, (None,) * BS))
            row[p % BS] = s.token_ids[p]
            self.content[b] = tuple(row)

    def _published(self, s: Sequence, before: int) -> None:
        for i in range(before, s.num_published_blocks):
            key = s.block_hashes[i]
            self.key_tokens.setdefault(key, tuple(s.token_ids[i * BS:(i + 1) * BS]))

    def _drain(self) -> None:
        released = self.pool.drain_releases()
        assert len(set(released)) == len(released) and set(released) <= self.owned
        self.owned -= set(released)

    @rule(prefix=st.lists(st.sampled_from(range(len(PREFIXES))), max_size=3),
          tail=st.lists(st.integers(10, 14), min_size=1, max_size=6), chunk=st.integers(1, 12))
    def admit(self, prefix, tail, chunk):
        self.n += 1
        s = seq([t for i in prefix for t in PREFIXES[i]] + tail, f"s{self.n}", max_tokens=3)
        before = s.num_published_blocks
        if self.kv.allocate(s, chunk):
            start = s.num_computed_tokens  # after the prefix hits
            n = min(chunk, s.num_tokens - start)
            self._write(s, start, start + n)
            s.num_computed_tokens += n
            self.kv.cache_computed_blocks(s)
            self._published(s, before)
            self.live.append(s)
        else:
            assert s.block_table == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 12))
    def step(self, i, chunk):
        """The sequence's next chunk (a decode when one token is left), a sampled token after it."""
        s = self.live[i % len(self.live)]
        n = min(chunk, s.num_tokens - s.num_computed_tokens)
        before = s.num_published_blocks
        if not self.kv.allocate(s, n):
            return
        self._write(s, s.num_computed_tokens, s.num_computed_tokens + n)
        s.num_computed_tokens += n
        self.kv.cache_computed_blocks(s)
        self._published(s, before)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(10 + s.num_tokens % 5)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        self.kv.free(self.live.pop(i % len(self.live)))
        self._drain()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def detach(self, i):
        s = self.live.pop(i % len(self.live))
        blocks, shared = self.kv.detach(s)
        assert set(shared) <= set(blocks) and s.block_table == []
        self.owned -= set(blocks) - set(shared)
        self.elsewhere.update(blocks)
        self.away.append((s, blocks, shared))
        self._drain()

    @precondition(lambda self: self.away)
    @rule(i=st.integers(0, 99), back=st.booleans())
    def adopt_or_finish_away(self, i, back):
        """The other worker hands the sequence back here, or finishes it (its blocks go back to the arena)."""
        s, blocks, shared = self.away.pop(i % len(self.away))
        self.elsewhere.subtract(blocks)
        self.elsewhere = +self.elsewhere
        if back:
            t = Sequence(s.request_id, s.prompt_token_ids, s.params)
            t.token_ids = list(s.token_ids)
            self.kv.adopt(t, blocks, shared, s.num_computed_tokens, s.num_cached_tokens)
            self.owned |= set(blocks)
            self.live.append(t)

    @rule(k=st.integers(1, 6), shared=st.booleans())
    def adopt_foreign(self, k, shared):
        """A sequence prefilled by another worker on this node, on blocks this pool never held."""
        blocks = self._unowned()[:k]
        assume(blocks)
        self.n += 1
        t = seq([20 + (self.n + j) % 7 for j in range(len(blocks) * BS)] + [1], f"f{self.n}", max_tokens=3)
        t.block_table = blocks  # what the other worker computed into them
        self._write(t, 0, len(blocks) * BS)
        t.block_table = []
        self.kv.adopt(t, blocks, blocks[:1] if shared else [], num_computed_tokens=len(blocks) * BS)
        self.owned |= set(blocks)
        self.live.append(t)

    @rule(k=st.integers(1, 8))
    def lease(self, k):
        blocks = self._unowned()[:k]
        self.pool.add_free(blocks)
        self.owned |= set(blocks)

    @rule(k=st.integers(0, 8))
    def give_back(self, k):
        free = self.pool.num_free
        assert self.pool.release_surplus(k) == min(k, free) and self.pool.num_free == free - min(k, free)
        self._drain()

    @rule(k=st.integers(1, 24))
    def spill(self, k):
        """The cached blocks the next k allocations would overwrite go to the host tier."""
        for b, key in self.pool.cached_in_next(k):
            assert self.pool.is_free(b) and self.content[b] == self.key_tokens[key]
            self.spilled[key] = self.key_tokens[key]
            self.pool.forget(b)

    @precondition(lambda self: self.spilled)
    @rule(m=st.integers(1, 4))
    def restore(self, m):
        keys = [k for k in self.spilled if self.pool.lookup(k) is None][:m]
        dest, victims = self.pool.restore_targets(len(keys), keep=set())
        dest += [b for b, _ in victims]
        for b, key in victims:
            self.spilled[key] = self.key_tokens[key]
            self.pool.forget(b)
        for key, b in zip(keys, dest):
            assert self.pool.is_free(b)
            self.pool.restore(b, key)
            self.content[b] = self.spilled[key]

    @invariant()
    def consistent(self):
        pool = self.pool
        pool.check()
        assert pool.num_held == len(self.owned), "free + referenced + shared != owned"
        refs = Counter(b for s in self.live for b in s.block_table)
        for b in range(self.N):
            assert pool.ref_count(b) == refs[b] >= 0
            if pool.is_free(b):
                assert b in self.owned and not refs[b], "a block both free and referenced"
        for key in pool.cached_keys():
            b = pool.lookup(key)
            assert b in self.owned and pool.key_of(b) == key
            assert self.content.get(b) == self.key_tokens[key], "a cached key whose block holds other tokens"
        for s in self.live:
            assert len(s.block_table) * BS >= s.num_computed_tokens


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


# -- property: the scheduler's block demand bounds what a step takes


class CountingPool(BlockPool):
    taken = 0

    def take(self) -> int:
        self.taken += 1
        return super().take()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=12),
       st.integers(1, 4), st.sampled_from([8, 16, 32]), st.integers(2, 6), st.integers(12, 40))
def test_a_step_takes_at_most_the_blocks_the_scheduler_says(reqs, arrive_per_step, budget, max_seqs, num_blocks):
    pool = CountingPool(num_blocks)
    kv = KVCacheManager(pool, BS, model="m")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, prefill_chunk_size=budget, max_num_seqs=max_seqs,
                                      max_prefill_tokens_with_decodes=budget // 2), kv)
    queue = [seq([1 + (j * 7 + i) % 5 for j in range(n)], f"q{i}", max_tokens=m) for i, (n, m, _) in enumerate(reqs)]
    for s, (_, _, priority) in zip(queue, reqs):
        s.priority = priority
    for _ in range(2000):
        for _ in range(arrive_per_step):
            if queue and kv.blocks_needed(queue[0].num_tokens + queue[0].params.max_tokens) <= num_blocks:
                sched.add(queue.pop(0))
            elif queue:
                queue.pop(0)
        if not sched.has_work():
            if not queue:
                break
            continue
        demand, before = sched.blocks_next_step(), pool.taken
        assert sched.blocks_next_step(2) >= demand
        batch = sched.schedule()
        assert pool.taken - before <= demand
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed_tokens += n
            kv.cache_computed_blocks(s)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(1)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
        pool.check()
    assert not sched.has_work() and pool.num_free == num_blocks


@pytest.mark.parametrize("running_prefill", [False, True])
def test_block_demand_formula(running_prefill):
    kv = KVCacheManager(BlockPool(64), BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8), kv)
    assert sched.blocks_next_step() == 0 and sched.blocks_next_step(2) == 32 // BS + 2
    a = seq(list(range(12)), "a")
    sched.add(a)
    sched.schedule()  # a computes its prompt
    a.num_computed_tokens = a.num_tokens - (5 if running_prefill else 1)
    assert sched.blocks_next_step() == (1 + 32 // BS + 1 if running_prefill else 1)
    sched.add(seq([1, 2, 3], "b"))
    assert sched.blocks_next_step() == 1 + 32 // BS + (2 if running_prefill else 1)
