"""Shared pytest fixtures.  Model fixtures are built with tests/tiny_model.py's
``make_tiny_llama`` so every test suite (loader, engine, server) sees the same tiny model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tiny_model import make_tiny_llama

# Compiled CPU kernels are kept per source version in the cache. Tests that point MESHSERVE_CACHE at a
# fresh folder (prepared weights, a model repository of their own) would move the kernels with it and
# rebuild them in every mesh they start (about a minute each on 2 cores): pin the folder here, before
# any test moves the cache (children inherit it).
def _pin_kernel_cache() -> None:
    from meshserve.kernels import cpu_build

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cpu_build.build_dir()))


_pin_kernel_cache()

# Gateways started by tests log their requests here, not into the user's cache (children inherit it);
# the folder goes when the session ends.
_request_log_dir = None
if "MESHSERVE_REQUEST_LOG" not in os.environ:
    _request_log_dir = tempfile.mkdtemp(prefix="meshserve-test-log-")
    os.environ["MESHSERVE_REQUEST_LOG"] = os.path.join(_request_log_dir, "requests.jsonl")


def pytest_sessionfinish(session, exitstatus):
    if _request_log_dir is not None:
        shutil.rmtree(_request_log_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama (untied lm_head) with tokenizer, in Hugging Face format."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> Path:
    """Same as tiny_llama but with tie_word_embeddings=True (no lm_head.weight on disk)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_biased(tmp_path_factory) -> Path:
    """A tiny Llama whose every projection has a (random) bias: attention_bias (q, k, v and o) and
    mlp_bias (gate, up, down)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-biased"), attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="session")
def default_model_file() -> Path:
    """The default model's cached GGUF; skips when it has not been pulled (no network in tests)."""
    from meshserve.shared import models_repo

    path = models_repo.cached_path(models_repo.DEFAULT_MODEL)
    if path is None:
        pytest.skip(f"default model {models_repo.DEFAULT_MODEL!r} is not cached; pull it once with: "
                    "python -c 'from meshserve.shared.models_repo import pull; pull()'")
    return path


@pytest.fixture(scope="session")
def default_bf16(default_model_file):
    """The default model in bf16 with the perplexity text's tokens and its bf16 perplexity, loaded
    once for the tests that compare a quantization against it (int8 weights, int8 KV)."""
    import torch

    from meshserve.bench.quant_bench import TEXT, perplexity
    from meshserve.shared.model.llama import LlamaModel
    from meshserve.shared.model.weights import load_gguf
    from meshserve.shared.tokenizer import Tokenizer

    cfg, sd = load_gguf(default_model_file)
    ids = Tokenizer.from_gguf(default_model_file).encode(TEXT)
    model = LlamaModel.from_hf(cfg, sd, torch.bfloat16)
    return {"cfg": cfg, "sd": sd, "ids": ids, "model": model, "perplexity": perplexity(model, ids)}


@pytest.fixture(params=["kernel", "amx-gemm"])
def projection_path(request, monkeypatch):
    """Each bf16 projection test runs the AVX-512 kernel at every row count, and, where the CPU has
    AMX, also the GEMM that takes many rows (cpu_build.amx_gemm; from 2 rows on here)."""
    from meshserve.kernels import cpu_build

    _amx_gemm_from(monkeypatch, 0 if request.param == "kernel" else 2)
    if request.param == "amx-gemm" and not cpu_build.amx_gemm(2):
        pytest.skip("no AMX on this CPU")
    yield request.param
    monkeypatch.undo()
    cpu_build.amx_gemm_min_rows.cache_clear()


def _amx_gemm_from(monkeypatch, rows: int) -> None:
    """Projections of `rows` rows or more go to torch's AMX GEMM from now on (0: never)."""
    from meshserve.kernels import cpu_build

    monkeypatch.setenv("MESHSERVE_AMX_GEMM_MIN_ROWS", str(rows))
    cpu_build.amx_gemm_min_rows.cache_clear()


@pytest.fixture
def kernel_projections(monkeypatch):
    """Every projection on its own CPU kernel, whatever the step's size: int8's integer sums make a
    row's result independent of its batch, which the GEMM a CPU with AMX takes for many rows is
    not, nor the bf16 kernel that int8 weights' dequantized copy runs for many rows elsewhere (a
    test comparing two schedules token for token needs that)."""
    from meshserve.kernels import cpu_build, int8_linear

    _amx_gemm_from(monkeypatch, 0)
    monkeypatch.setenv("MESHSERVE_INT8_BF16_MIN_ROWS", "0")
    int8_linear.bf16_kernel_min_rows.cache_clear()
    yield
    monkeypatch.undo()
    cpu_build.amx_gemm_min_rows.cache_clear()
    int8_linear.bf16_kernel_min_rows.cache_clear()
