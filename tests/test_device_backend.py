"""`--device cpu|cuda` for the mesh, on any machine: the option on `meshserve up` and the node's
services, the launcher forwarding it, the descriptors that carry a CUDA IPC handle, the buffers of
shared/node_memory.py on the CPU backend, and `--device cuda` failing at once, with the reason,
where CUDA cannot run. The GPU half is tests/test_cuda_mesh.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from meshserve.cli.main import build_parser
from meshserve.cli.launcher import DEVICE_ROLES, Launcher
from meshserve.shared import node_memory, shm
from meshserve.shared.schemas import ArenaDescriptor, TensorSpec, WeightsDescriptor

# What shared/cuda_ipc.export() gives for a buffer of cuda_ipc.empty() (a "cudaipc" descriptor).
IPC = {"pid": 4242, "device": 0, "dtype": "uint8", "shape": [1 << 20], "strides": [1], "kind": "cudaipc",
       "handle": "ab" * 64, "alloc_bytes": 1 << 20, "offset": 0}


def test_device_option_defaults_to_cpu_and_takes_cuda():
    p = build_parser()
    assert p.parse_args(["up"]).device == "cpu"
    assert p.parse_args(["up", "--device", "cuda"]).device == "cuda"
    for role in DEVICE_ROLES:
        assert p.parse_args(["serve", role]).device == "cpu"
        assert p.parse_args(["serve", role, "--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        p.parse_args(["up", "--device", "tpu"])
    for role in ("gateway", "scheduler"):  # they hold no tensors
        assert not hasattr(p.parse_args(["serve", role]), "device")


def spawned_by_up(opts: list[str]) -> dict[str, list[str]]:
    """The command line of each process `meshserve up OPTS` starts (on an existing NATS), none run."""
    launcher = Launcher(build_parser().parse_args(["up", "--nats-url", "nats://127.0.0.1:1", *opts]))
    spawned = {}
    launcher.spawn = lambda name, cmd, env=None: spawned.setdefault(name, cmd)
    try:
        launcher.start()
    finally:
        shutil.rmtree(launcher.tmp, ignore_errors=True)
    return spawned


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("prefill", [0, 1])
def test_up_forwards_the_device_to_every_service_of_the_node(device, prefill):
    spawned = spawned_by_up(["--device", device, "--prefill", str(prefill), "--decode", "2"])
    assert "nats-server" not in spawned
    expect = {"model-loader", "kv-pool", "decode-0", "decode-1", "scheduler", "gateway"} | (
        {"prefill-0"} if prefill else set())
    assert set(spawned) == expect
    for name, cmd in spawned.items():
        role = cmd[cmd.index("serve") + 1]
        if role in DEVICE_ROLES:
            assert cmd[cmd.index("--device") + 1] == device, cmd
            build_parser().parse_args(cmd[cmd.index("serve"):])  # what the child parses
        else:
            assert "--device" not in cmd, cmd


@pytest.mark.parametrize("opts,want", [
    (["--prefill", "1", "--decode", "1"], "2"),  # 4 cores, 2 workers
    (["--prefill", "0", "--decode", "1"], "4"),
    (["--prefill", "2", "--decode", "4"], "1"),  # never below 1
    (["--prefill", "1", "--decode", "1", "--worker-threads", "3"], "3"),
    (["--prefill", "1", "--decode", "1", "--device", "cuda"], None),
])
def test_up_divides_the_cores_among_the_workers(monkeypatch, opts, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("MESHSERVE_WORKER_THREADS", raising=False)
    workers = [cmd for name, cmd in spawned_by_up(opts).items() if name.startswith(("prefill", "decode"))]
    assert workers
    for cmd in workers:
        assert (cmd[cmd.index("--threads") + 1] if "--threads" in cmd else None) == want, cmd


def test_descriptors_round_trip_with_a_cuda_ipc_handle():
    spec = [TensorSpec(name="embed", dtype="bfloat16", shape=[384, 64], offset=0),
            TensorSpec(name="norm", dtype="bfloat16", shape=[64], offset=49152)]
    w = WeightsDescriptor(model="m", path="cuda:0", backend="cuda", ipc=IPC, config={"hidden_size": 64},
                          tensors=spec, tokenizer_path="/t")
    assert WeightsDescriptor.decode(w.encode()) == w
    a = ArenaDescriptor(node_id="n", path="cuda:0", backend="cuda", ipc=IPC | {"handle": "cd" * 64}, dtype="float32",
                        shape=[2, 2, 64, 2, 16], block_size=16, num_blocks=4, swap_blocks=3)
    assert ArenaDescriptor.decode(a.encode()) == a
    # The CPU descriptors are as before: no handle, backend cpu by default.
    old = b'{"node_id":"n","path":"/dev/shm/x","dtype":"float32","shape":[2,2,64,2,16],"block_size":16,"num_blocks":4}'
    a = ArenaDescriptor.decode(old)
    assert (a.backend, a.ipc) == ("cpu", None)
    w = WeightsDescriptor.decode(b'{"model":"m","path":"/dev/shm/w","config":{},"tensors":[],"tokenizer_path":"t"}')
    assert (w.backend, w.ipc) == ("cpu", None)
    with pytest.raises(ValueError):
        ArenaDescriptor.decode(a.encode().replace(b'"cpu"', b'"tpu"'))


def test_cpu_buffers_are_one_shared_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_SHM_DIR", str(tmp_path))
    buf, path, ipc = node_memory.create("meshserve-test-buf", 4096, "cpu")
    assert ipc is None and path == str(tmp_path / "meshserve-test-buf") and buf.dtype == torch.uint8
    other = node_memory.open_buffer("cpu", path)
    shm.view(buf, 64, "float32", [4]).copy_(torch.arange(4.0))
    assert torch.equal(shm.view(other, 64, "float32", [4]), torch.arange(4.0))  # the same memory
    assert torch.equal(shm.view(other, 0, "uint8", [2]), torch.zeros(2, dtype=torch.uint8))
    node_memory.release("cpu", path)
    assert not (tmp_path / "meshserve-test-buf").exists()
    with pytest.raises(ValueError, match="without its CUDA IPC handle"):
        node_memory.open_buffer("cuda", "cuda:0", None)


def test_a_worker_refuses_weights_or_an_arena_of_the_other_backend():
    node_memory.check_backend("weights", "cpu", "cpu")
    with pytest.raises(node_memory.DeviceUnavailable, match="same --device"):
        node_memory.check_backend("KV arena", "cuda", "cpu")


needs_no_cuda = pytest.mark.skipif(node_memory.cuda_problem() is None, reason="CUDA can run here")


@needs_no_cuda
@pytest.mark.parametrize("argv", [["up", "--nats-port", "1"],
                                  ["serve", "model-loader", "--nats-url", "nats://127.0.0.1:1"],
                                  ["serve", "kv-pool", "--nats-url", "nats://127.0.0.1:1"],
                                  ["serve", "decode", "--nats-url", "nats://127.0.0.1:1"]])
def test_device_cuda_without_cuda_fails_at_once_with_the_reason(argv):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", *argv, "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--device cuda:" in r.stderr and ("no CUDA device" in r.stderr or "CuPy" in r.stderr), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60  # no connection tried, nothing started (a python start-up at most)


@needs_no_cuda
def test_creating_cuda_memory_without_cuda_says_why():
    with pytest.raises(node_memory.DeviceUnavailable, match="--device cuda"):
        node_memory.create("x", 16, "cuda")
    with pytest.raises(node_memory.DeviceUnavailable, match="unknown device"):
        node_memory.require("tpu")


def test_a_retired_gpu_buffer_is_freed_only_once_no_worker_of_the_node_has_it_open():
    """node_memory.RetiredBuffers, the rule the loader and the kv-pool free evicted GPU memory by
    (CUDA leaves freeing an allocation another process still maps undefined): a buffer goes once
    every worker heard from has reported, after the retirement, without its handle; a worker
    handed a descriptor and not heard from since holds everything; a silent one is gone."""
    import gc
    import weakref

    class Buffer:  # stands for the GPU allocation: freed when the last reference goes
        pass

    book = node_memory.RetiredBuffers(timeout_s=3.0)
    book.heard("w1", ["h-old"], now=0.0)
    book.heard("w2", [], now=0.0)
    book.asked("w3", now=0.5)  # handed a descriptor, no heartbeat yet
    buf = Buffer()
    gone = weakref.ref(buf)
    book.retire("h-old", buf, 1000, "weights of a", now=1.0)
    del buf
    assert book.collect(now=1.1) == [] and book.status()["pending_bytes"] == 1000
    book.heard("w1", [], now=1.2)  # w1 closed it, w2 reported before the retirement only
    book.heard("w3", ["h-other"], now=1.3)
    assert book.collect(now=1.4) == []
    book.heard("w2", ["h-old"], now=1.5)  # still open there (an old engine not collected yet)
    assert book.collect(now=1.6) == []
    book.heard("w2", [], now=2.0)
    assert book.collect(now=2.1) == ["weights of a"]
    gc.collect()
    assert gone() is None, "the book let go of the buffer"
    assert book.status() == {"pending": [], "pending_bytes": 0, "freed": 1, "freed_bytes": 1000}
    # A worker that dies with the handle open: its process closed it; freed after the timeout.
    book.retire("h-b", Buffer(), 10, "KV arena b", now=3.0)
    book.heard("w2", ["h-b"], now=3.1)
    book.heard("w1", [], now=3.2)
    book.heard("w3", [], now=3.2)
    assert book.collect(now=5.0) == []
    book.heard("w1", [], now=6.0)
    book.heard("w3", [], now=6.0)
    assert book.collect(now=6.5) == ["KV arena b"] and "w2" not in book.reports
    # One asked and never heard from holds a buffer until its timeout.
    book.asked("w4", now=7.0)
    book.retire("h-c", Buffer(), 1, "c", now=7.5)
    book.heard("w1", [], now=8.0)
    book.heard("w3", [], now=8.0)
    assert book.collect(now=8.1) == []
    book.heard("w1", [], now=10.5)
    book.heard("w3", [], now=10.5)
    assert book.collect(now=10.6) == ["c"]
