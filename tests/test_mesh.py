"""The mesh end to end, as users run it: `meshserve up` (real nats-server, six kinds of service
process), the official openai client, a nats-py client. Outputs must equal the in-process engine's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import nats
import orjson
import pytest
from openai import OpenAI

from mesh_util import Mesh, bus_bytes_of_completion
from meshserve.shared.engine.llm import LLM
from meshserve.shared.engine.sequence import SamplingParams

PROMPTS = ["The quick brown fox", "Hello world! Hello there", "def add(a, b):", "Once upon a time there was",
           "Numbers: 0 1 2 3", "Café, naïve, résumé", "What is the capital of France?",
           "Streaming tokens one at a time lets the user read"]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The in-process engine on the same weights: the mesh must produce the same text."""
    llm = LLM(str(tiny_llama), "float32")
    return llm


@pytest.fixture(scope="module")
def mesh(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    m = Mesh(tiny_llama, tmp, prefill=2, decode=2, env={"MESHSERVE_TRACE_FILE": str(tmp / "spans.jsonl")})
    m.trace_file = tmp / "spans.jsonl"
    with m:
        yield m


def expected(llm: LLM, prompt, max_tokens: int) -> str:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def test_openai_client_completions_and_chat(mesh, reference):
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused")
    r = client.completions.create(model=mesh.model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == expected(reference, PROMPTS[0], 12)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"

    stream = client.completions.create(model=mesh.model, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected(reference, PROMPTS[1], 12)
    assert chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "user", "content": "Tell me a joke"}]
    prompt = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = expected(reference, prompt, 10)
    r = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_concurrent_requests_match_in_process_engine(mesh, reference):
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused")
    jobs = [(p, 8 + 3 * i) for i, p in enumerate(PROMPTS * 2)]

    def one(job):
        p, n = job
        return client.completions.create(model=mesh.model, prompt=p, max_tokens=n, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(one, jobs))
    assert got == [expected(reference, p, n) for p, n in jobs]


def test_nats_api(mesh, reference):
    async def go():
        nc = await nats.connect(mesh.nats_url)
        body = {"model": mesh.model, "prompt": PROMPTS[2], "max_tokens": 9, "temperature": 0}
        msg = await nc.request(f"{mesh.namespace}.v1.completions", orjson.dumps(body), timeout=60)
        whole = orjson.loads(msg.data)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"{mesh.namespace}.v1.chat.completions", orjson.dumps(
            {"model": mesh.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
             "temperature": 0, "stream": True}), reply=inbox)
        parts = []
        while True:
            m = await sub.next_msg(timeout=60)
            if m.data == b"[DONE]":
                break
            parts.append(orjson.loads(m.data))
        bad = orjson.loads((await nc.request(f"{mesh.namespace}.v1.completions", b"{}", timeout=10)).data)
        await nc.close()
        return whole, parts, bad

    whole, parts, bad = asyncio.run(go())
    assert whole["choices"][0]["text"] == expected(reference, PROMPTS[2], 9)
    assert parts and all(p["object"] == "chat.completion.chunk" for p in parts)
    assert parts[-1]["choices"][0]["finish_reason"] == "length"
    assert "error" in bad and bad["error"]["message"]


def test_handoff_moves_block_ids_not_tensors(mesh, reference, tiny_llama):
    """Count every byte on the bus while a long prompt is prefilled and handed off."""
    from meshserve.shared.model.weights import load_hf_dir

    cfg, _ = load_hf_dir(tiny_llama)
    prompt = reference.tokenizer.encode(" ".join(PROMPTS * 3))[:200]
    kv_bytes = len(prompt) * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4

    body = {"model": mesh.model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    r, seen = bus_bytes_of_completion(mesh.nats_url, mesh.namespace, body)
    assert r["choices"][0]["text"] == expected(reference, prompt, 5)
    handoff = seen.get("scheduler.handoff", 0) + seen.get("worker.adopt", 0)
    assert handoff > 0, f"no handoff seen: {seen}"
    # The handoff carries token and block ids: a few bytes per token, never the KV itself.
    assert handoff < 16 * len(prompt) + 4096 < kv_bytes
    request_bytes = sum(v for k, v in seen.items() if not k.startswith(("workers.", "kv.events")))
    assert request_bytes < kv_bytes / 2, seen


def test_one_trace_across_every_process(mesh):
    client = OpenAI(base_url=mesh.url + "/v1", api_key="unused")
    # Longer than --short-prefill, so a prefill worker computes it and hands it to a decode worker.
    client.completions.create(model=mesh.model, prompt=" ".join(PROMPTS), max_tokens=4, temperature=0)
    time.sleep(1.0)  # the decode span is written when the worker publishes the last token
    spans = [orjson.loads(line) for line in mesh.trace_file.read_bytes().splitlines()]
    last = max((s for s in spans if s["name"] == "gateway.request"), key=lambda s: s["start"])
    trace = [s for s in spans if s["trace_id"] == last["trace_id"]]
    services = {s["service"] for s in trace}
    names = {s["name"] for s in trace}
    assert {"gateway", "scheduler", "prefill", "decode"} <= services, trace
    assert {"gateway.request", "queue", "prefill", "kv.handoff", "decode"} <= names, names
    pids = {s["attributes"].get("worker") for s in trace if s["name"] in ("prefill", "decode")}
    assert len(pids) == 2  # prefill and decode ran in different processes


def test_bad_input_leaves_the_mesh_healthy(mesh):
    import httpx

    r = httpx.post(mesh.url + "/v1/completions", json={"model": mesh.model, "prompt": "x", "max_tokens": 100000})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(mesh.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(mesh.url + "/health").status_code == 200


def test_kill_decode_worker_mid_stream_and_ctrl_c_cleans_up(tiny_llama, tmp_path, reference):
    mesh = Mesh(tiny_llama, tmp_path, prefill=1, decode=2).wait_ready()
    try:
        client = OpenAI(base_url=mesh.url + "/v1", api_key="unused", timeout=120)
        jobs = [(p, 200) for p in PROMPTS[:6]]
        want = [reference.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text
                for p, n in jobs]
        received = [0] * len(jobs)

        def one(i):
            p, n = jobs[i]
            text = ""
            for c in client.completions.create(model=mesh.model, prompt=p, max_tokens=n, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                text += c.choices[0].text if c.choices else ""
                received[i] += 1
            return text

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            futures = [ex.submit(one, i) for i in range(len(jobs))]
            killed = _kill_busy_decode_worker(mesh, started=lambda: max(received) > 0)
            at_kill = list(received)
            texts = [f.result(timeout=120) for f in futures]
        assert killed is not None, "no decode worker was busy"
        assert min(at_kill) < 200  # the kill happened mid-stream
        assert texts == want
    finally:
        kids = mesh.children()
        mesh.stop()
    assert mesh.proc.returncode == 0
    time.sleep(0.5)
    alive = [p for p in kids if _alive(p)]
    assert not alive, f"processes left behind: {alive}"
    assert not list(mesh.shm_dir.glob("meshserve-*")), "shared-memory files left behind"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _kill_busy_decode_worker(mesh: Mesh, started, timeout: float = 60) -> int | None:
    """kill -9 the decode worker that is running a sequence now, as soon as one is and streams have begun.

    Polls the scheduler rather than waiting on the client: on a loaded machine the client's stream
    readers can lag the workers by more than the whole generation."""

    async def find():
        nc = await nats.connect(mesh.nats_url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                r = orjson.loads((await nc.request(f"{mesh.namespace}.scheduler.status", b"", timeout=5)).data)
                decode = [w for w in r["workers"] if w["role"] == "decode" and w["assigned"]]
                if decode and started():
                    return max(decode, key=lambda w: w["assigned"])
                await asyncio.sleep(0.005)
            return None
        finally:
            await nc.close()

    busiest = asyncio.run(find())
    if busiest is None:
        return None
    pid = int(busiest["id"].rsplit("-", 1)[1])  # worker ids end with their pid
    assert pid in mesh.children()
    os.kill(pid, signal.SIGKILL)
    return pid
