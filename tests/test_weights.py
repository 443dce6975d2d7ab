"""Weight loading: HF safetensors directories and GGUF files must give Transformers' tensors exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshserve.shared.model.config import ModelConfig
from meshserve.shared.model.weights import load_gguf, load_hf_dir, unpermute_qk
from tiny_model import llama_cpp_permute, make_tiny_llama, write_tiny_gguf


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def transformers_gguf_model(path: Path):
    """(config, state_dict) of Transformers' own GGUF loading of ``path``, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    try:
        import accelerate  # noqa: F401  (Transformers requires it for from_pretrained(gguf_file=...))
    except ImportError:
        # Same conversion code path, without accelerate: build the model, then let
        # Transformers convert (dequantize + reverse-permute) the GGUF tensors for it.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        sd = {k: v.to(torch.float32) for k, v in tensors.items()}
        if config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return config, sd
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.config, model.state_dict()


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]):
    assert sorted(ours) == sorted(ref)
    for k in ours:
        assert ours[k].shape == ref[k].shape, k
        assert ours[k].dtype == ref[k].dtype, k
        assert torch.equal(ours[k], ref[k]), k


# ---------------------------------------------------------------- HF directory


@pytest.mark.parametrize("tied", [False, True])
def test_hf_dir_roundtrip(tiny_llama, tiny_llama_tied, tied):
    from safetensors.torch import load_file

    d = tiny_llama_tied if tied else tiny_llama
    cfg, sd = load_hf_dir(d)
    assert_same_tensors(sd, load_file(str(d / "model.safetensors")))
    assert ("lm_head.weight" in sd) is (not tied)
    n = cfg.num_hidden_layers
    assert f"model.layers.{n - 1}.self_attn.q_proj.weight" in sd and "model.norm.weight" in sd
    hf = json.loads((d / "config.json").read_text())
    assert cfg == ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=256, tie_word_embeddings=tied, attention_bias=False, bos_token_id=1,
        eos_token_ids=[2], architecture="LlamaForCausalLM",
    ), hf


def test_hf_dir_matches_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    _, sd = load_hf_dir(tiny_llama)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).state_dict()
    assert_same_tensors(sd, ref)


def test_hf_dir_eos_union_with_generation_config(tmp_path):
    d = make_tiny_llama(tmp_path / "m", num_hidden_layers=1)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 0]
    (d / "generation_config.json").write_text(json.dumps(gen))
    cfg, _ = load_hf_dir(d)
    assert cfg.eos_token_ids == [2, 0]


def test_hf_dir_keeps_stored_dtype(tmp_path):
    d = make_tiny_llama(tmp_path / "bf16", num_hidden_layers=1, dtype=torch.bfloat16)
    _, sd = load_hf_dir(d)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}


# ------------------------------------------------------------------------ GGUF


def test_unpermute_inverts_llama_cpp_permute():
    g = torch.Generator().manual_seed(0)
    for n_head, head_dim, cols in [(4, 16, 64), (2, 16, 64), (9, 64, 8), (3, 8, 0)]:
        w = torch.randn((n_head * head_dim, cols) if cols else (n_head * head_dim,), generator=g)
        p = llama_cpp_permute(w, n_head)
        assert not torch.equal(p, w)
        assert torch.equal(unpermute_qk(p, n_head), w)
        assert np.array_equal(unpermute_qk(p.numpy(), n_head), w.numpy())


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_roundtrip_llama(tiny_llama, tiny_llama_tied, tmp_path, tied):
    d = tiny_llama_tied if tied else tiny_llama
    hf_cfg, hf_sd = load_hf_dir(d)
    path = write_tiny_gguf(d, tmp_path / "tiny.gguf")
    cfg, sd = load_gguf(path)
    assert cfg == hf_cfg
    assert_same_tensors(sd, hf_sd)


def test_gguf_roundtrip_llama_with_qk_bias(tmp_path):
    """llama.cpp permutes q/k biases too; they must come back un-permuted."""
    d = make_tiny_llama(tmp_path / "bias", attention_bias=True, num_hidden_layers=1)
    hf_cfg, hf_sd = load_hf_dir(d)
    cfg, sd = load_gguf(write_tiny_gguf(d, tmp_path / "bias.gguf"))
    assert cfg.attention_bias and hf_cfg.attention_bias
    assert_same_tensors(sd, hf_sd)


def test_gguf_roundtrip_qwen2(tmp_path):
    """qwen2 GGUFs are not permuted and carry q/k/v biases."""
    d = make_tiny_llama(tmp_path / "q", attention_bias=True)
    _, hf_sd = load_hf_dir(d)
    cfg, sd = load_gguf(write_tiny_gguf(d, tmp_path / "q.gguf", arch="qwen2"))
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias
    expected = {k: v for k, v in hf_sd.items() if not k.endswith("o_proj.bias")}
    assert_same_tensors(sd, expected)


def test_llama3_rope_from_a_gguf_matches_transformers(tmp_path):
    """llama.cpp keeps Llama 3's rope scaling as rope_freqs (a factor per frequency), not in the
    metadata; once read (it was ignored), the GGUF's greedy tokens are Transformers' on the HF model."""
    from oracle import hf_greedy
    from transformers import AutoModelForCausalLM

    from meshserve.shared.engine.llm import LLM
    from meshserve.shared.engine.sequence import SamplingParams

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    d = make_tiny_llama(tmp_path / "l3", rope_scaling=scaling)
    path = write_tiny_gguf(d, tmp_path / "l3.gguf")
    cfg, _ = load_gguf(path)
    assert cfg.rope_freq_factors is not None and cfg.rope_freq_factors[0] == 1.0 and cfg.rope_freq_factors[-1] == 8.0
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 40, 90)]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, 24, [2])
    got = [c.token_ids for c in LLM(str(path), "float32").generate(prompts, SamplingParams(max_tokens=24,
                                                                                          temperature=0))]
    assert got == want


def test_gguf_roundtrip_qwen3(tiny_llama, tmp_path):
    """qwen3 GGUFs carry each layer's q and k norms (attn_q_norm, attn_k_norm), not permuted."""
    import shutil

    from test_engine import _transformers_model

    d = tmp_path / "q3"
    _transformers_model(d, "Qwen3", head_dim=32)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / f, d / f)
    hf_cfg, hf_sd = load_hf_dir(d)
    cfg, sd = load_gguf(write_tiny_gguf(d, tmp_path / "q3.gguf", arch="qwen3"))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and hf_cfg.qk_norm and cfg.head_dim == 32
    assert "model.layers.1.self_attn.k_norm.weight" in sd
    assert_same_tensors(sd, hf_sd)


def test_tiny_gguf_agrees_with_transformers(tiny_llama, tmp_path):
    """Transformers reads our test GGUF back to the HF tensors too, so the writer above
    follows llama.cpp's conventions (it is not just wrong in the same way as the reader)."""
    path = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf")
    tf_cfg, ref = transformers_gguf_model(path)
    _, hf_sd = load_hf_dir(tiny_llama)
    assert_same_tensors(hf_sd, ref)
    cfg, _ = load_gguf(path)
    assert cfg.num_key_value_heads == tf_cfg.num_key_value_heads
    assert cfg.rms_norm_eps == pytest.approx(tf_cfg.rms_norm_eps)


# --------------------------------------------------------- the default model


def test_default_model_gguf_matches_transformers(default_model_file):
    """SmolLM2-135M-Instruct Q4_1: dequantized tensors equal Transformers' GGUF loading
    tensor for tensor (atol 0), which also proves the q/k un-permutation on a real model."""
    cfg, sd = load_gguf(default_model_file)
    tf_cfg, ref = transformers_gguf_model(default_model_file)

    assert cfg.tie_word_embeddings and tf_cfg.tie_word_embeddings
    assert "lm_head.weight" not in sd
    assert torch.equal(ref.pop("lm_head.weight"), sd["model.embed_tokens.weight"])
    assert_same_tensors(sd, ref)

    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        tf_cfg.vocab_size, tf_cfg.hidden_size, tf_cfg.intermediate_size, tf_cfg.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        tf_cfg.num_attention_heads, tf_cfg.num_key_value_heads, tf_cfg.head_dim)
    assert cfg.max_position_embeddings == tf_cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(tf_cfg.rms_norm_eps, rel=1e-6)
    tf_theta = getattr(tf_cfg, "rope_theta", None) or tf_cfg.rope_parameters["rope_theta"]
    assert cfg.rope_theta == tf_theta == 100000.0
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert dataclasses.asdict(cfg)["architecture"] == "LlamaForCausalLM"
