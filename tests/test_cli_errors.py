"""Command-line errors are one clear line on stderr and exit status 2, never a traceback; and
`meshserve bench` against a server whose model it has no tokenizer for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from mesh_util import free_port
from test_bench import FakeOpenAI


def meshserve(*args: str, timeout: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshserve.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_command_line_errors_are_one_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    gemma = tmp_path / "gemma"  # a config of an architecture this decoder is not
    gemma.mkdir()
    (gemma / "config.json").write_text('{"architectures": ["GemmaForCausalLM"], "vocab_size": 8, "hidden_size": 8, '
                                       '"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}')
    cases = [  # (arguments, what the line must say)
        (["models", "pull", "no-such-model"], "unknown model 'no-such-model'"),
        (["up", "--model", "no-such-model", "--port", str(free_port())], "unknown model 'no-such-model'"),
        (["batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")],
         f"No such file or directory: {tmp_path / 'missing.jsonl'}"),
        (["bench", "--workload", "no-such-workload", "--vocab-size", "50"], "no-such-workload"),
        (["bench", "--workload", str(bad_yaml), "--vocab-size", "50"], f"workload {bad_yaml}"),
        (["bench", "--workload", "mixed-chat", "--url", f"http://127.0.0.1:{free_port()}", "--vocab-size", "50"],
         "cannot reach http://127.0.0.1:"),
        (["analyze", str(tmp_path / "no-log.jsonl")], "no-log.jsonl"),
        (["up", "--prefill", "two"], "invalid int value: 'two'"),
        (["up", "--model", str(gemma), "--port", str(free_port())], "GemmaForCausalLM is not supported"),
    ]
    procs = [(args, want, meshserve(*args)) for args, want in cases]  # at once: each start imports a lot
    for args, want, p in procs:
        out, err = p.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert p.returncode == 2, (args, err)
        assert len(lines) == 1 and "Traceback" not in err, (args, err)
        assert lines[0].startswith(f"meshserve {args[0]}: error: ") and want in lines[0], (args, lines[0])
    assert not (tmp_path / "out.jsonl").exists()  # nothing was started or written


@pytest.fixture(scope="module")
def fake():
    with FakeOpenAI() as f:
        yield f


def test_bench_with_no_tokenizer_for_the_model_warns_and_sends_text(fake, tmp_path, default_model_file):
    """A served name that is no model we know, and a server without /tokenize: the default model's
    tokenizer makes the prompts, sent as text, with a warning (not a KeyError traceback)."""
    wl = tmp_path / "w.yaml"
    wl.write_text(yaml.safe_dump({"name": "w", "num_requests": 3, "prompt_len": 12, "output_len": 2}))
    r = subprocess.run([sys.executable, "-m", "meshserve.cli.main", "bench", "--url", fake.url, "--model",
                        "some-org/Some-Model-7B", "--workload", str(wl), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "lengths in the server's tokens are approximate" in r.stderr
    report = json.loads(r.stdout)
    assert report["completed"] == 3 and "approximate" in report["tokenizer"]
    assert report["workload"]["prompt_format"] == "text"
    bodies = [b for _, b in fake.received[-3:]]
    assert all(isinstance(b["prompt"], str) and b["model"] == "some-org/Some-Model-7B" for b in bodies)
