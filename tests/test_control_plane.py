"""The control plane without the engine: processes that do no tensor math never load torch (each
checked in a fresh interpreter), subjects come from one checked scheme, error replies are told by a
header and not by their bytes, the request limits have one definition, the kv-pool's numpy arena
sees the same bytes as the workers' torch view of it, and what a start keeps for the next one
(a GGUF's tokenizer, the model-loader's prepared weights) is exactly what it would rebuild."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from mesh_util import free_port
from meshserve.shared.limits import (PRIORITIES, LimitError, check_context_length, check_priority, check_token_ids,
                                     priority_level)
from meshserve.shared.schemas import Message, Sampling
from meshserve.shared.subjects import Subjects


def no_torch_after(code: str) -> None:
    """Runs `code` in a fresh interpreter and fails if it loaded torch (or failed)."""
    r = subprocess.run([sys.executable, "-c", code + "\nimport sys\nassert 'torch' not in sys.modules, "
                        "[m for m in sys.modules if m.startswith('meshserve')]\n"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("code", [
    "import meshserve.shared.schemas, meshserve.shared.subjects, meshserve.shared.bus, meshserve.shared.limits",
    "import meshserve.shared.openai_protocol, meshserve.shared.tokenizer, meshserve.shared.prefix_hash",
    # the gateway: its entry point, what run() imports, and the tokenizer it loads
    "import meshserve.services.gateway.main as m, meshserve.services.gateway.app, meshserve.services.gateway.handler,"
    " meshserve.services.gateway.nats_api, meshserve.services.gateway.streams, uvicorn",
    "import meshserve.services.scheduler.main",
    # the launcher: `meshserve up`'s parser and the launcher module; `serve ROLE` parses only its role
    "from meshserve.cli.main import build_parser\nimport meshserve.cli.launcher\n"
    "build_parser(['up']).parse_args(['up'])\n"
    "for r in ('gateway', 'scheduler', 'kv-pool'): build_parser(['serve', r]).parse_args(['serve', r])",
    # the kv-pool on the CPU backend: its module and its arena, swap tier and transfer code at work
    "import tempfile, os\nos.environ['MESHSERVE_SHM_DIR'] = tempfile.mkdtemp()\n"
    "import meshserve.services.kv_pool.main\n"
    "from meshserve.shared import node_memory\n"
    "from meshserve.services.kv_pool.blocks import ArenaBlocks\n"
    "from meshserve.services.kv_pool.swap import HostTier\n"
    "from meshserve.shared.schemas import SwapRequest\n"
    "buf, path, _ = node_memory.create('arena', 2 * 2 * 64 * 2 * 8 * 2, 'cpu', numpy=True)\n"
    "a = ArenaBlocks.of_bytes(buf, 'bfloat16', [2, 2, 64, 2, 8], 16)\n"
    "a.write_range([1, 2], 100, a.read_range([0, 3], 0, 2 * a.block_bytes)[:700])\n"
    "t = HostTier(4, a.block_bytes)\n"
    "assert t.apply(a, SwapRequest(worker_id='w', swap_out=[(1, 7)], swap_in=[(7, 0)])).restored == 1\n"
    "node_memory.release('cpu', path)",
], ids=["schemas", "protocol+tokenizer", "gateway", "scheduler", "launcher", "kv-pool-cpu"])
def test_processes_that_do_no_tensor_math_never_load_torch(code):
    no_torch_after(code)


def test_the_gateway_process_as_launched_loads_no_torch(tiny_llama):
    """`meshserve serve gateway` up to the point it connects (no NATS here: it fails after loading
    everything it serves with, which is what is checked)."""
    code = ("import sys\nfrom meshserve.cli.main import build_parser\n"
            f"argv = ['serve', 'gateway', '--model', {str(tiny_llama)!r}, '--no-request-log']\n"
            "args = build_parser(argv).parse_args(argv)\n"
            "from meshserve.services.gateway.main import with_defaults\n"
            "from meshserve.shared.models_repo import load_tokenizer\n"
            "import meshserve.services.gateway.app, uvicorn, uvloop\n"
            "assert load_tokenizer(with_defaults(args).model).vocab_size > 0")
    no_torch_after(code)


# -- subjects: one scheme, checked endpoints

def test_subjects_are_built_from_one_scheme_and_keep_their_names():
    s = Subjects("ns")
    assert (s.completions, s.chat_completions) == ("ns.v1.completions", "ns.v1.chat.completions")  # the contract
    assert (s.submit, s.handoff, s.abort, s.done, s.scheduler_status) == (
        "ns.scheduler.submit", "ns.scheduler.handoff", "ns.scheduler.abort", "ns.scheduler.done", "ns.scheduler.status")
    assert s.heartbeat == "ns.workers.heartbeat"
    assert s.worker("decode-node0-7", "adopt") == "ns.worker.decode-node0-7.adopt"
    assert s.kv("lease", "node0") == "ns.kv.node0.lease" and s.kv("events", "*") == "ns.kv.*.events"
    assert s.kv("swap", "ip-10.0.0.1") == "ns.kv.ip-10_0_0_1.swap"  # one token per instance
    assert s.models("load", "node0") == "ns.models.node0.load"
    assert s.compute("claim", "node0") == "ns.compute.node0.claim"
    assert s.tokens("abc") == "ns.tokens.abc"


@pytest.mark.parametrize("build", [
    lambda s: s.kv("leas", "node0"), lambda s: s.worker("w", "prefil"), lambda s: s.scheduler("sumbit"),
    lambda s: s.models("unload", "node0"), lambda s: s.kv("prefill", "node0")])
def test_an_unknown_endpoint_is_an_error_where_the_subject_is_built(build):
    with pytest.raises(ValueError, match="is not an endpoint of"):
        build(Subjects("ns"))


# -- error replies: a header, never the payload's bytes

class Named(Message):
    error: str  # a reply whose JSON starts with {"error" and is not an error


@pytest.fixture(scope="module")
def nats_url():
    from meshserve.cli.launcher import nats_server_binary

    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)


def test_an_error_reply_is_told_by_its_header_not_its_bytes(nats_url):
    from meshserve.shared.bus import ERROR_HEADER, Bus

    async def go():
        bus = await Bus.connect(nats_url, namespace="t")
        try:
            async def failing(msg):
                await bus.respond_error(msg, "cannot load x:\nno such file")

            async def named(msg):
                await msg.respond(Named(error="a field, not a failure").encode())

            await bus.nc.subscribe("t.fail", cb=failing)
            await bus.nc.subscribe("t.named", cb=named)
            raw = await bus.nc.request("t.fail", b"{}", timeout=5)
            assert raw.data == b"" and raw.headers[ERROR_HEADER] == "cannot load x: no such file"
            with pytest.raises(RuntimeError, match="t.fail: cannot load x: no such file"):
                await bus.request("t.fail", Named(error=""), Named, timeout=5)
            assert (await bus.request("t.named", Named(error=""), Named, timeout=5)).error == "a field, not a failure"
        finally:
            await bus.close()

    asyncio.run(go())


# -- the request limits: one definition, used by the gateway, the scheduler and the engine

def test_request_limits_and_their_messages():
    assert PRIORITIES == ("interactive", "normal", "background") and priority_level("background") == 2
    assert check_priority("normal") == "normal"
    assert [check_priority(p) for p in (-3, 0, 2)] == ["interactive", "normal", "background"]  # vLLM's integers
    for bad in ("urgent", True, 1.5):
        with pytest.raises(LimitError, match="priority must be one of interactive, normal, background"):
            check_priority(bad)
    with pytest.raises(LimitError, match=r"\(or 0-2\)"):
        priority_level("urgent")
    check_context_length(10, 6, 16)
    with pytest.raises(LimitError, match=r"maximum context length is 16 tokens; the request asks for 17 "
                                         r"\(10 in the prompt, 7 to generate\)") as e:
        check_context_length(10, 7, 16)
    assert e.value.code == "context_length_exceeded"
    check_context_length(15, None, 16)  # only the prompt known: one token must still fit
    with pytest.raises(LimitError, match="the prompt has 16 tokens"):
        check_context_length(16, None, 16, param="messages")
    with pytest.raises(LimitError, match=r"must be in \[0, 5\)") as e:
        check_token_ids([0, 4, 5], 5)
    assert e.value.param == "prompt"
    with pytest.raises(LimitError, match="top_p"):
        Sampling(top_p=0).check()


def test_the_engine_converts_the_wire_at_its_own_door():
    from meshserve.shared.engine import wire
    from meshserve.shared.engine.sampler import TokenLogprobs

    s = Sampling(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=4, stop_token_ids=[9],
                 ignore_eos=True, logprobs=2)
    p = wire.sampling_params(s, stop=["\n\n"])
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop_token_ids, p.ignore_eos,
            p.logprobs, p.stop) == (7, 0.5, 0.9, 3, 0.1, 4, [9], True, 2, ["\n\n"])
    assert wire.sampling_params(s).stop == []  # stop strings never travel
    lp = wire.logprob(TokenLogprobs(-0.25, [(3, -0.25), (5, -2.0)]))
    assert (lp.logprob, lp.top) == (-0.25, [(3, -0.25), (5, -2.0)]) and wire.logprob(None) is None


# -- the kv-pool's numpy arena and the workers' torch view: the same bytes

def test_numpy_and_torch_views_of_one_arena_agree(tmp_path, monkeypatch):
    import torch

    from meshserve.services.kv_pool.blocks import ArenaBlocks
    from meshserve.services.kv_pool.swap import HostTier
    from meshserve.shared import node_memory, shm
    from meshserve.shared.schemas import SwapRequest

    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    shape = [2, 2, 8 * 16, 2, 8]  # bf16: 2 layers, 8 blocks of 16 tokens, 2 heads of 8
    nbytes = 2 * 2 * 8 * 16 * 2 * 8 * 2
    buf, path, _ = node_memory.create("kv", nbytes, "cpu", numpy=True)
    pool = ArenaBlocks.of_bytes(buf, "bfloat16", shape, 16)
    arena = shm.view(node_memory.open_buffer("cpu", path), 0, "bfloat16", shape)  # as a worker maps it
    worker = ArenaBlocks(arena, 16)
    assert (pool.dtype, pool.block_shape, pool.block_bytes) == (worker.dtype, worker.block_shape, worker.block_bytes)
    arena.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    for b in range(8):
        assert pool.read(b).tobytes() == worker.read(b).numpy().tobytes()
    data = pool.read_range([6, 1], 5, 2 * pool.block_bytes - 9)
    assert data == worker.read_range([6, 1], 5, 2 * pool.block_bytes - 9)
    pool.write_range([0, 3], 5, data)  # partial blocks at both ends, merged
    assert worker.read_range([0, 3], 5, len(data)) == data
    tier = HostTier(2, pool.block_bytes)  # the pool's swap tier copies numpy blocks
    want = worker.read(4).clone()
    assert tier.apply(pool, SwapRequest(worker_id="w", swap_out=[(4, 44)], swap_in=[(44, 7)])).restored == 1
    assert torch.equal(worker.read(7), want)
    node_memory.release("cpu", path)


def test_shm_create_writes_through_a_temporary_name_of_its_own(tmp_path, monkeypatch):
    """A shared file is written under a temporary name and renamed into place; that name keeps the
    whole name (the part after a dot too), so it is never another file's, nor another create's."""
    from meshserve.shared import shm

    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    (tmp_path / "weights.tmp").write_bytes(b"another file")  # what `weights.a`'s temporary name once was
    a, b = shm.create("weights.a", 64), shm.create("weights.b", 32)
    assert (a.name, a.read_bytes(), b.name, b.read_bytes()) == ("weights.a", bytes(64), "weights.b", bytes(32))
    assert (tmp_path / "weights.tmp").read_bytes() == b"another file"
    (tmp_path / "weights.a").write_bytes(b"stale")
    assert shm.create("weights.a", 8).read_bytes() == bytes(8)  # a stale file of that name is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.a", "weights.b", "weights.tmp"]  # nothing left over


# -- what a start keeps for the next: the same as what it would rebuild

def test_a_gguf_tokenizer_is_kept_and_reads_back_the_same(tiny_llama, tmp_path, monkeypatch):
    from tiny_model import write_tiny_gguf

    from meshserve.shared import models_repo
    from meshserve.shared.tokenizer import Tokenizer

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tiny_llama, tmp_path / "t.gguf")
    first = models_repo.load_tokenizer(gguf)  # rebuilt from the metadata, then kept
    kept = models_repo.prepared_dir(gguf, "tokenizer")
    assert (kept / "tokenizer.json").is_file()
    again = models_repo.load_tokenizer(gguf)
    ref = Tokenizer.from_gguf(gguf)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🤖 <b>"}]
    for tok in (first, again):
        assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.chat_template, tok.add_bos_token) == (
            ref.vocab_size, ref.bos_token_id, ref.eos_token_ids, ref.chat_template, ref.add_bos_token)
        assert tok.apply_chat_template(conversation) == ref.apply_chat_template(conversation)
        for text in ("Hello world", "héllo 🤖\n\n  x", "<|im_start|>user\nhi<|im_end|>"):
            assert tok.encode(text) == ref.encode(text) and tok.decode(ref.encode(text)) == ref.decode(ref.encode(text))


@pytest.mark.parametrize("form", ["gguf", "hf-directory"])
def test_prepared_weights_are_kept_and_load_the_same_bytes(tiny_llama, tmp_path, monkeypatch, form):
    """A GGUF's first load dequantizes it, a Hugging Face directory's fuses and lays out its tensors:
    either is kept once prepared, and the next load copies those bytes back. A changed file is
    another model to the cache (a new entry), never a stale hit, and its entry replaces the old."""
    import shutil

    from tiny_model import write_tiny_gguf

    from meshserve.services.model_loader import prepared
    from meshserve.services.model_loader.main import ModelLoader

    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path / "shm"))
    model = write_tiny_gguf(tiny_llama, tmp_path / "t.gguf") if form == "gguf" else \
        Path(shutil.copytree(tiny_llama, tmp_path / "hf"))
    loader = ModelLoader(types.SimpleNamespace(subjects=Subjects("t")), "n0", max_models=4)
    first = loader.load_now(str(model), "bfloat16", None)
    assert first.tier == "source"
    digest = hashlib.sha256(open(first.path, "rb").read()).hexdigest()
    kept = prepared.entry(model, "bfloat16", "cpu")
    assert (kept / "weights.bin").is_file()
    os.unlink(first.path)
    second = loader.load_now(str(model), "bfloat16", None)  # from the kept copy
    assert second.tier == "disk"
    assert hashlib.sha256(open(second.path, "rb").read()).hexdigest() == digest
    assert (second.tensors, second.config) == (first.tensors, first.config)
    loader.load_now(str(model), "bfloat16", "int8")  # another lineage: int8 weights
    int8_kept = prepared.entry(model, "bfloat16-int8", "cpu")
    assert (int8_kept / "weights.bin").is_file()
    weights = model if form == "gguf" else model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    renewed = prepared.entry(model, "bfloat16", "cpu")
    assert renewed != kept
    assert loader.load_now(str(model), "bfloat16", None).tier == "source"
    # the new entry replaces the one made from the earlier bytes; the int8 one is another lineage
    assert (renewed / "weights.bin").is_file() and not kept.exists() and int8_kept.exists()


@pytest.mark.parametrize("size", [0, 100, 4096, 3 * 4096 + 17, (1 << 20) + 5, 9 * (1 << 20) + 4095])
def test_a_prepared_form_is_copied_byte_for_byte_direct_or_not(tmp_path, size):
    """prepared.copy_direct writes whole blocks with O_DIRECT and the tail plainly; where the file
    system has no O_DIRECT (tmpfs) it copies plainly."""
    from meshserve.services.model_loader.prepared import copy_direct

    data = os.urandom(size)
    src = Path("/dev/shm") / f"meshserve-test-copy-{os.getpid()}-{size}"
    src.write_bytes(data)
    try:
        for dst in (tmp_path / "out.bin", Path(f"{src}.out")):
            copy_direct(str(src), dst, chunk=1 << 20)
            assert dst.read_bytes() == data
            dst.unlink()
    finally:
        src.unlink()


def test_a_prepared_form_given_up_when_the_loader_stops_leaves_nothing(tmp_path):
    """The loader closing sets its stop event: a prepared form being written is abandoned between
    two chunks and its partial copy removed (a loader stopped mid-copy left gigabytes behind)."""
    import threading

    from meshserve.services.model_loader import prepared

    src = Path("/dev/shm") / f"meshserve-test-keep-{os.getpid()}"
    src.write_bytes(os.urandom(3 * (1 << 20)))
    stop = threading.Event()
    stop.set()
    try:
        prepared.keep(tmp_path / "cache" / "entry", str(src), [], {}, stop=stop)
    finally:
        src.unlink()
    assert not list((tmp_path / "cache").iterdir())


def test_startup_bench_reads_a_process_memory():
    from meshserve.bench.startup_bench import memory_mb, mesh_processes

    m = memory_mb(os.getpid())
    assert 0 < m["pss_mb"] <= m["rss_mb"]
    assert 0 < m["anon_mb"] <= m["rss_mb"]  # this interpreter's own heap
    assert abs(m["pss_anon_mb"] + m["pss_file_mb"] + m["pss_shmem_mb"] - m["pss_mb"]) <= 0.3  # PSS, split by kind
    assert mesh_processes(os.getpid())["launcher"] == os.getpid()


def test_copy_parts_writes_a_load_part_by_part_into_a_tensor_buffer(tiny_llama, tmp_path, monkeypatch):
    """The CUDA backend's host and disk tiers write a load into its GPU allocation with
    loads.copy_parts; here into a CPU tensor: every byte of every tensor lands where the layout says,
    and each part is reported done once, in order, after its bytes."""
    import torch

    from meshserve.services.model_loader import loads
    from meshserve.services.model_loader.main import ModelLoader
    from meshserve.shared import shm

    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path / "shm"))
    loader = ModelLoader(types.SimpleNamespace(subjects=Subjects("t")), "n0", max_models=4)
    desc = loader.load_now(str(tiny_llama), "float32", None)
    data = open(desc.path, "rb").read()
    parts = loads.part_ranges(desc.tensors, desc.config)
    assert len(parts) == desc.config["num_hidden_layers"] + 2
    buf = torch.zeros(len(data), dtype=torch.uint8)
    seen = []

    def done(k: int) -> None:
        seen.append(k)
        for a, b in parts[k - 1]:
            assert bytes(buf[a:b].numpy()) == data[a:b]

    loads.copy_parts(buf, parts, loads.read_file(desc.path))(done)
    assert seen == list(range(1, len(parts) + 1))
    for t in desc.tensors:
        a = t.offset
        b = a + shm.nbytes(t.dtype, t.shape)
        assert bytes(buf[a:b].numpy()) == data[a:b], t.name
    with pytest.raises(OSError, match="only"):
        loads.copy_parts(buf, [[(0, len(data) + 8)]], loads.read_file(desc.path))(lambda k: None)
