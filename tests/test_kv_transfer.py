"""KV blocks across nodes: the chunked pull between kv-pools (real nats-server, a small max_payload,
faults injected on the source side) and a two-node mesh of real processes (prefill on node0,
decode on node1) whose greedy outputs must equal the in-process engine's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import subprocess
import time
from collections import Counter

import nats
import orjson
import pytest
import torch
from openai import OpenAI

from mesh_util import Mesh, Node, free_port
from meshserve.services.kv_pool import transfer
from meshserve.services.kv_pool.blocks import ArenaBlocks
from meshserve.services.kv_pool.main import BlockLedger
from meshserve.cli.launcher import nats_server_binary
from meshserve.services.scheduler.routing import pick_decode
from meshserve.services.gateway.streams import confirm_subscriptions
from meshserve.shared.bus import Bus
from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.sequence import SamplingParams
from meshserve.shared.schemas import GenerateRequest, Handoff, Sampling, TokenChunk
from test_routing import view

# -- the pull between two kv-pools, in process, over a real nats-server with a small max_payload

MAX_PAYLOAD = 20_000


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory):
    # A port free a moment ago may still be held by a server another test is stopping: our server
    # then fails to bind and exits, while the connect check would reach the old one. So the check
    # also asks that our process is alive, and a taken port is tried again with another.
    for _ in range(5):
        port = free_port()
        conf = tmp_path_factory.mktemp("nats") / "nats.conf"
        conf.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {MAX_PAYLOAD}\n")
        proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)
        time.sleep(0.1)
        if proc.poll() is None:
            break
    else:
        pytest.fail("nats-server could not bind a free port")
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)


def arena(num_blocks: int, seed: int | None = None) -> ArenaBlocks:
    # fp32 blocks of 2 layers x 2 x 16 tokens x 4 heads x 48 dims: 48 KiB, larger than one chunk.
    t = torch.zeros(2, 2, num_blocks * 16, 4, 48)
    if seed is not None:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
    return ArenaBlocks(t, 16)


def block(a: ArenaBlocks, b: int) -> torch.Tensor:
    return a.read(b)


class Source:
    """One node's side: an arena, a ledger in which `holder` holds some blocks, the fetch server."""

    def __init__(self, bus: Bus, node: str, server_cls=transfer.FetchServer, ttl: float = 120.0):
        self.blocks = arena(32, seed=1)
        self.ledger = BlockLedger(32)
        self.stats = transfer.TransferStats()
        self.server = server_cls(bus, lambda key: (self.blocks, self.ledger.held, self.ledger.release), self.stats,
                                 ttl=ttl)
        self.bus, self.node = bus, node

    async def serve(self) -> None:
        for verb, cb in (("fetch", self.server.on_open), ("chunk", self.server.on_chunk),
                         ("close", self.server.on_close)):
            await self.bus.nc.subscribe(self.bus.subjects.kv(verb, self.node), cb=cb)
        await confirm_subscriptions(self.bus.nc)  # one flush can return before the last SUB is sent


def run_pair(url: str, body, server_cls=transfer.FetchServer):
    async def go():
        a = await Bus.connect(url, namespace="t")
        b = await Bus.connect(url, namespace="t")
        src = Source(a, "node-a", server_cls)
        await src.serve()
        try:
            return await body(src, b)
        finally:
            await a.close()
            await b.close()

    return asyncio.run(go())


def test_arena_blocks_as_bytes_in_any_split():
    src, dst = arena(8, seed=3), arena(8)
    data = src.read_range([5, 1, 7], 0, 3 * src.block_bytes)
    assert len(data) == 3 * src.block_bytes
    for off in range(0, len(data), 10_007):  # chunk edges inside blocks and inside segments
        dst.write_range([0, 2, 3], off, data[off:off + 10_007])
    for s, d in ((5, 0), (1, 2), (7, 3)):
        assert torch.equal(block(src, s), block(dst, d))
    assert not block(dst, 1).any()


def test_pull_splits_below_max_payload_and_releases_the_source(small_nats):
    async def body(src: Source, bus: Bus):
        held = src.ledger.lease("prefill-a", 8)  # 6 with KV, 2 reserved for tokens not computed yet
        src.ledger.retain("prefill-a", held[:2])  # its prefix cache keeps the first two as well
        seen = []

        async def sniff(msg):
            seen.append(len(msg.data) + sum(len(k) + len(v) for k, v in (msg.headers or {}).items()))

        await bus.nc.subscribe("_INBOX.>", cb=sniff)
        dst = arena(32)
        stats = transfer.TransferStats()
        # timeout: a loaded 2-core CI machine once let the in-process source miss the default 5 s
        nbytes, chunks = await transfer.pull(bus, "node-a", "t1", "prefill-a", held[:6], [9, 8, 7, 6, 5, 4], dst,
                                             stats=stats, also_release=held[6:], timeout=30.0)
        deadline = time.monotonic() + 5
        while sum(1 for n in seen if n > 1000) < chunks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the sniffer's copies arrive on their own time
        return src, held, dst, nbytes, chunks, stats, seen

    src, held, dst, nbytes, chunks, stats, seen = run_pair(small_nats, body)
    assert nbytes == 6 * src.blocks.block_bytes and chunks == -(-nbytes // (MAX_PAYLOAD - transfer.HEADROOM)) > 6
    for s, d in zip(held, [9, 8, 7, 6, 5, 4]):
        assert torch.equal(block(src.blocks, s), block(dst, d))
    assert stats.chunks_received == chunks and stats.bytes_received == nbytes and stats.received == 1
    assert src.stats.chunks_sent == chunks and src.stats.bytes_sent == nbytes
    assert max(seen) <= MAX_PAYLOAD
    assert sum(1 for n in seen if n > 1000) == chunks
    # The pull closed: the holder's handed-over references went (the 2 not copied too), the cache's stayed.
    assert src.ledger.held["prefill-a"] == Counter(held[:2]) and not src.server.pulls


def test_a_server_too_small_for_any_chunk_is_an_error_at_once():
    with pytest.raises(transfer.TransferError, match="max_payload"):
        transfer.chunk_limit(3000)
    assert transfer.chunk_limit(1 << 20, 32768) == 32768
    assert transfer.chunk_limit(20_000) == 20_000 - transfer.HEADROOM


class DropsChunk(transfer.FetchServer):
    async def on_chunk(self, msg):
        if b'"index":2' in msg.data:
            return  # lost, every time
        await super().on_chunk(msg)


class CorruptsChunk(transfer.FetchServer):
    async def on_chunk(self, msg):
        if b'"index":1' not in msg.data:
            return await super().on_chunk(msg)
        real = self.bus.nc.publish

        async def flip(subject, data, headers=None):
            await real(subject, bytes([data[0] ^ 1]) + data[1:], headers=headers)
        self.bus.nc.publish = flip
        try:
            await super().on_chunk(msg)
        finally:
            self.bus.nc.publish = real


@pytest.mark.parametrize("case", ["no pool", "not held", "layout", "lost chunk", "corrupt chunk"])
def test_a_transfer_that_cannot_complete_fails_clearly(small_nats, case):
    server = {"lost chunk": DropsChunk, "corrupt chunk": CorruptsChunk}.get(case, transfer.FetchServer)

    async def body(src: Source, bus: Bus):
        held = src.ledger.lease("prefill-a", 4)
        node, holder, dst = "node-a", "prefill-a", arena(32)
        if case == "no pool":
            node = "node-z"
        elif case == "not held":
            holder = "prefill-gone"
        elif case == "layout":
            dst = ArenaBlocks(torch.zeros(2, 2, 32 * 16, 4, 48, dtype=torch.bfloat16), 16)
        t0 = time.monotonic()
        with pytest.raises(transfer.TransferError) as e:
            await transfer.pull(bus, node, "t-" + case, holder, held, [0, 1, 2, 3], dst, timeout=0.5)
        await asyncio.sleep(0.1)
        return str(e.value), time.monotonic() - t0, src.ledger.held.get("prefill-a", Counter())

    error, seconds, still_held = run_pair(small_nats, body, server)
    n = -(-4 * arena(1).block_bytes // (MAX_PAYLOAD - transfer.HEADROOM))
    expect = {"no pool": "no kv-pool answers for node 'node-z'", "not held": "prefill-gone no longer holds",
              "layout": "KV layouts differ", "lost chunk": f"chunk 3 of {n} not answered in 0.5s (2 tries)",
              "corrupt chunk": f"chunk 2 of {n} fails its CRC-32 check"}[case]
    assert expect in error and "t-" + case in error, error
    assert seconds < 3, f"{case}: took {seconds:.1f}s"
    if case in ("lost chunk", "corrupt chunk"):  # it was opened: closing it released the holder's references
        assert not still_held


# -- routing: the prefill's node first, another node when none is there or all there are full

def test_decode_prefers_the_prefill_node_until_full():
    a, b = view("a", "decode", free=50), view("b", "decode", free=500)
    a.hb.node_id, b.hb.node_id = "node0", "node1"
    assert pick_decode([a, b], "node0") is a  # same node, although b has more free blocks
    assert pick_decode([a, b], "node2") is b  # none there: the best elsewhere
    assert pick_decode([b], "node0") is b
    a.hb.max_num_seqs, a.hb.num_running = 4, 4
    assert pick_decode([a, b], "node0") is b  # node0's worker is full
    b.hb.max_num_seqs, b.assigned = 2, {"r1", "r2"}
    assert pick_decode([a, b], "node0") is a  # all full: the same node again


# -- two nodes of real processes: prefill on node0, decode on node1

PROMPTS = ["The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away, far away.",
           "Once upon a time there was a small model that answered every question with a story.",
           "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))",
           "What is the capital of France? The capital of France is Paris, a city on the Seine."]
CHUNK = 32768


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(str(tiny_llama), "float32")


@pytest.fixture(scope="module")
def two_nodes(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-nodes")
    mesh = Mesh(tiny_llama, tmp, prefill=1, decode=0)  # node0: a prefill worker only
    node1 = None
    try:
        node1 = Node(mesh, "node1", tmp, decode=1, kv_pool_args=["--transfer-chunk-bytes", str(CHUNK)])
        mesh.wait_ready()
        node1.wait_ready()
        yield mesh, node1
    finally:
        if node1 is not None:
            node1.stop()
        mesh.stop()


async def _request(nc, subject: str, body: dict | None = None, timeout: float = 10) -> dict:
    return orjson.loads((await nc.request(subject, orjson.dumps(body) if body else b"", timeout=timeout)).data)


def test_prefill_on_node0_decode_on_node1_equals_the_engine(two_nodes, reference):
    mesh, _ = two_nodes
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused")
    jobs = [(p, 6 + 3 * i) for i, p in enumerate(PROMPTS)]

    def one(job):
        p, n = job
        r = client.completions.create(model=mesh.model, prompt=p, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(one, jobs))
    want = [reference.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text
            for p, n in jobs]
    assert got == want

    async def status():
        nc = await nats.connect(mesh.nats_url)
        try:
            return (await _request(nc, f"{mesh.namespace}.kv.node0.status"),
                    await _request(nc, f"{mesh.namespace}.kv.node1.status"))
        finally:
            await nc.close()

    node0, node1 = asyncio.run(status())
    assert node1["transfers"]["received"] >= len(PROMPTS) and not node1["transfers"]["failed"]
    assert node0["transfers"]["served"] >= len(PROMPTS) and node0["transfers"]["bytes_sent"] > 0


def test_cross_node_handoff_bytes_are_the_blocks_in_chunks(two_nodes, reference):
    """Count what crosses the bus while a long prompt is prefilled on node0 and decoded on node1."""
    mesh, _ = two_nodes
    prompt = reference.tokenizer.encode(" ".join(PROMPTS * 2))[:200]
    n_blocks = -(-len(prompt) // 16)

    async def go():
        nc = await nats.connect(mesh.nats_url)
        before = await _request(nc, f"{mesh.namespace}.kv.node1.status")
        chunks: list[int] = []
        other: dict[str, int] = {}

        async def count(msg):
            if msg.headers and transfer.H_INDEX in msg.headers:
                chunks.append(len(msg.data))
            else:
                key = msg.subject.split(".")[1] + "." + msg.subject.split(".")[-1]
                other[key] = other.get(key, 0) + len(msg.data)

        await nc.subscribe(">", cb=count)
        await nc.flush()
        body = {"model": mesh.model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
        r = await _request(nc, f"{mesh.namespace}.v1.completions", body, timeout=60)
        await asyncio.sleep(0.3)
        after = await _request(nc, f"{mesh.namespace}.kv.node1.status")
        node0 = await _request(nc, f"{mesh.namespace}.kv.node0.status")
        await nc.close()
        return r, chunks, other, before, after, node0

    r, chunks, other, before, after, node0 = asyncio.run(go())
    assert r["choices"][0]["text"] == reference.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0].text
    block_bytes = after["block_bytes"]
    control = sum(v for k, v in other.items() if not k.startswith(("workers.", "kv.events")))
    print(f"cross-node handoff: {len(prompt)} tokens, {n_blocks} blocks of {block_bytes} bytes, "
          f"{sum(chunks)} bytes in {len(chunks)} chunks over NATS; everything else of the request: {control} bytes")
    assert sum(chunks) == n_blocks * block_bytes > 0  # the blocks, once each, nothing else
    assert len(chunks) == -(-n_blocks * block_bytes // CHUNK) > 1 and max(chunks) <= CHUNK
    assert after["transfers"]["bytes_received"] - before["transfers"]["bytes_received"] == sum(chunks)
    assert not node0["transfers"]["open_pulls"]  # closed, the prefill worker's references released


def test_a_failed_transfer_is_recomputed_on_the_decode_node(two_nodes, reference, tiny_llama):
    """A handoff whose source blocks are gone (the prefill worker died): node1 says why and recomputes
    from prompt + the first token; the stream continues from the second token, as the engine's."""
    mesh, _ = two_nodes
    prompt = reference.tokenizer.encode(PROMPTS[1])
    want = reference.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids

    async def go():
        nc = await nats.connect(mesh.nats_url)
        workers = (await _request(nc, f"{mesh.namespace}.scheduler.status"))["workers"]
        decode = next(w["id"] for w in workers if w["node_id"] == "node1")
        inbox = f"{mesh.namespace}.tokens.test-cross-node-lost"  # workers may publish only on token subjects
        sub = await nc.subscribe(inbox)
        req = GenerateRequest(request_id="cross-node-lost", model=mesh.model, prompt_token_ids=prompt,
                              sampling=Sampling(max_tokens=6, temperature=0, ignore_eos=True), stream_subject=inbox,
                              arrival_time=time.time())
        h = Handoff(request=req, token_ids=prompt + want[:1], block_ids=list(range(-(-len(prompt) // 16))),
                    num_computed_tokens=len(prompt), num_cached_tokens=0, next_seq=1,
                    from_worker="prefill-node0-999999", node_id="node0")
        t0 = time.monotonic()
        await nc.publish(f"{mesh.namespace}.worker.{decode}.adopt", h.encode())
        chunks = []
        while not (chunks and chunks[-1].finished):
            chunks.append(TokenChunk.decode((await sub.next_msg(timeout=30)).data))
        seconds = time.monotonic() - t0
        status = await _request(nc, f"{mesh.namespace}.kv.node1.status")
        await nc.close()
        return chunks, seconds, status

    chunks, seconds, status = asyncio.run(go())
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))  # numbering goes on from the handoff
    assert chunks[0].index == 1 and [t for c in chunks for t in c.token_ids] == want[1:]
    assert seconds < 10  # a clear failure and a recompute, not a wait for a timeout
    assert "prefill-node0-999999 no longer holds" in status["transfers"]["last_error"]
