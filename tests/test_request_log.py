"""The gateway's request log (services/gateway/request_log.py), written by a real gateway process
against a real nats-server, with test_gateway.py's stand-in scheduler: one line per request that
ended (finished, failed, timed out, given up by its client), rotation by size, `--no-request-log`,
and `meshserve up` forwarding the options to its gateway.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import orjson
import pytest

from meshserve.services.gateway.request_log import RequestLog
from test_gateway import LOSES_WORKER, SERVED, SILENT, SLOW, NS, StandIn, free_port, nats_url, tokenizer, wait_for  # noqa: F401

MAX_BYTES = 1500


def start_gateway(nats_url: str, model, tmp, *log_args: str):
    port = free_port()
    out = tmp / f"gateway-{port}.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.services.gateway.main", "--nats-url", nats_url, "--namespace", NS,
             "--port", str(port), "--model", str(model), "--served-model-name", SERVED, "--max-model-len", "128",
             "--stream-timeout", "1", *log_args], stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, out.read_text()
        try:
            return httpx.get(f"{base}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "the gateway")
    return proc, base, out


def stop_gateway(proc, out):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, out.read_text()


def read_log(directory) -> list[dict]:
    """Every line of requests.jsonl and its rotations, oldest first. A rotation between listing the
    files and reading them (a name gone, or moved on) makes it read them all again."""
    def listing():
        return sorted(directory.glob("requests.jsonl*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit()
                      else 0)

    while True:
        files = listing()
        try:
            data = [f.read_bytes() for f in files]
        except FileNotFoundError:
            continue
        if files == listing():
            return [orjson.loads(line) for d in data for line in d.splitlines()]


def test_gateway_writes_the_request_log(nats_url, tiny_llama, tokenizer, tmp_path):  # noqa: F811
    logdir = tmp_path / "logs"
    proc, base, out = start_gateway(nats_url, tiny_llama, tmp_path, "--request-log", str(logdir / "requests.jsonl"),
                                    "--request-log-max-bytes", str(MAX_BYTES), "--request-log-backups", "20")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=20)
        with StandIn(nats_url, tokenizer) as mesh:
            t0 = time.time()
            # finished, not streamed: the line is there when the response is
            r = client.completions.create(model=SERVED, prompt="Hello there", max_tokens=5)
            rec = read_log(logdir)[-1]
            assert rec["id"] == r.id.removeprefix("cmpl-") and rec["model"] == SERVED
            assert (rec["class"], rec["endpoint"], rec["stream"]) == ("normal", "completions", False)
            assert rec["prompt_tokens"] == r.usage.prompt_tokens == len(tokenizer.encode("Hello there"))
            assert rec["output_tokens"] == 5 and rec["max_tokens"] == 5 and rec["cached_tokens"] == 3
            assert rec["finish_reason"] == "length" and rec["error"] is None and rec["workers"] == ["w1"]
            assert t0 - 0.5 <= rec["arrival"] <= time.time() and 0 < rec["ttft"] <= rec["e2e"] < 10

            # finished, streamed, another class: written before [DONE]
            stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"priority": "interactive"})
            chunks = list(stream)
            rec = read_log(logdir)[-1]
            assert rec["id"] == chunks[0].id.removeprefix("chatcmpl-")
            assert (rec["class"], rec["endpoint"], rec["stream"]) == ("interactive", "chat", True)
            assert rec["output_tokens"] == chunks[-1].usage.completion_tokens == len(mesh.script) + 1
            assert rec["prompt_tokens"] == chunks[-1].usage.prompt_tokens and rec["finish_reason"] == "stop"

            # invalid: logged with its status, before it was tokenized
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "top_p": 0, "priority": "background"})
            assert r.status_code == 400
            rec = read_log(logdir)[-1]
            assert rec["error"]["status"] == 400 and "top_p" in rec["error"]["message"]
            assert rec["prompt_tokens"] is None and rec["class"] == "background" and rec["finish_reason"] is None
            assert rec["workers"] == []

            # its worker lost midway: both workers whose tokens the client got, in turn
            r = client.completions.create(model=SERVED, prompt="x", max_tokens=8, seed=LOSES_WORKER)
            rec = read_log(logdir)[-1]
            assert rec["output_tokens"] == 8 and rec["workers"] == ["w1", "w2"], rec

            # no token in time: 504
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "seed": SILENT}, timeout=10)
            assert r.status_code == 504
            rec = read_log(logdir)[-1]
            assert rec["error"]["status"] == 504 and rec["ttft"] is None and rec["output_tokens"] == 0
            assert rec["workers"] == []
            assert rec["e2e"] >= 1.0

            # the client leaves mid-stream: 499, with the tokens it got so far
            n_before = len(read_log(logdir))
            with httpx.stream("POST", f"{base}/v1/completions",
                              json={"prompt": "x", "max_tokens": 20, "seed": SLOW, "stream": True}) as r:
                next(r.iter_lines())
            rid = mesh.submits[-1].request_id
            rec = wait_for(lambda: next((x for x in read_log(logdir)[n_before:] if x["id"] == rid), None), 10,
                           "the cancelled request's line")
            assert rec["error"]["status"] == 499 and rec["finish_reason"] is None
            assert 2 <= rec["output_tokens"] < 20 and rec["ttft"] is not None

            # more requests: the file rotates, nothing is lost while backups remain
            for _ in range(6):
                client.completions.create(model=SERVED, prompt="x", max_tokens=2)
    finally:
        stop_gateway(proc, out)
    files = sorted(p.name for p in logdir.iterdir())
    assert "requests.jsonl.1" in files and "requests.jsonl.2" in files, files
    assert all(p.stat().st_size <= MAX_BYTES for p in logdir.iterdir())
    recs = read_log(logdir)
    assert len(recs) == 12 and [r["output_tokens"] for r in recs[-6:]] == [2] * 6
    assert all(a["arrival"] <= b["arrival"] for a, b in zip(recs, recs[1:]))
    assert f"request log: {logdir / 'requests.jsonl'}" in out.read_text()


def test_no_request_log(nats_url, tiny_llama, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    path = tmp_path / "never.jsonl"
    proc, base, out = start_gateway(nats_url, tiny_llama, tmp_path, "--request-log", str(path), "--no-request-log")
    try:
        with StandIn(nats_url, tokenizer):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200
    finally:
        stop_gateway(proc, out)
    assert not path.exists() and "request log:" not in out.read_text()


def test_rotation_keeps_n_backups(tmp_path):
    path = tmp_path / "r.jsonl"
    rl = RequestLog(path, max_bytes=100, backups=2)
    for i in range(10):
        rl.write({"i": i, "pad": "x" * 30})  # ~42 bytes a line: two lines a file
    rl.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    lines = [orjson.loads(x)["i"] for name in ("r.jsonl.2", "r.jsonl.1", "r.jsonl")
             for x in (tmp_path / name).read_bytes().splitlines()]
    assert lines == [4, 5, 6, 7, 8, 9]
    # reopened, it appends where it left off
    rl = RequestLog(path, max_bytes=100, backups=2)
    rl.write({"i": 10})
    rl.close()
    lines = [orjson.loads(x)["i"] for name in ("r.jsonl.2", "r.jsonl.1", "r.jsonl")
             for x in (tmp_path / name).read_bytes().splitlines()]
    assert lines[-3:] == [8, 9, 10] and lines == list(range(lines[0], 11))


def test_unwritable_log_does_not_fail(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rl = RequestLog(blocker / "sub" / "requests.jsonl")  # a directory under a file: cannot exist
    rl.write({"i": 1})  # warns, does not raise
    rl.close()


@pytest.mark.parametrize("argv,want", [([], []), (["--no-request-log"], ["--no-request-log"]),
                                       (["--request-log", "/x/r.jsonl"], ["--request-log", "/x/r.jsonl"])])
def test_up_forwards_the_options(argv, want):
    from meshserve.cli.main import build_parser
    from meshserve.cli.launcher import gateway_log_options

    args = build_parser().parse_args(["up", *argv])
    assert gateway_log_options(args) == want
