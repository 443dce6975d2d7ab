"""A GGUF file's model config from its llama.cpp metadata keys, without torch: the weights loader
(weights.py) builds its config here, and the kv-pool reads a model's KV shape through it
(models_repo.model_config) without loading torch."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .config import ModelConfig

log = logging.getLogger("meshserve.shared.model.weights")

# GGUF architecture -> (HF architecture class, has q/k/v bias, q/k rows permuted by llama.cpp)
GGUF_ARCHS = {
    "llama": ("LlamaForCausalLM", False, True),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, False),
}


def field_value(field: Any) -> Any:
    """Decode a GGUFReader field into a Python scalar, string or list."""
    return field.contents()


def gguf_metadata(reader: Any, keys_prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """All metadata of a GGUF file as a plain dict (big arrays included: tokens, merges)."""
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF.") or (keys_prefix and not k.startswith(keys_prefix)):
            continue
        out[k] = field_value(f)
    return out


class _LazyFields:
    """dict-like view of GGUF metadata that decodes a field only when asked
    (decoding the 50k-entry token list just to read a scalar is wasteful)."""

    def __init__(self, reader: Any):
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self._fields.get(key)
        return default if f is None else field_value(f)

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def __getitem__(self, key: str) -> Any:
        return field_value(self._fields[key])


def _f32(x: float) -> float:
    """GGUF stores floats as float32; print the shortest float32 repr back so that
    e.g. 1e-5 comes back as 1e-5 rather than 9.999999747378752e-06."""
    return float(str(np.float32(x)))


def gguf_config(reader: Any) -> ModelConfig:
    """Build a ModelConfig from a GGUF file's llama.cpp metadata keys."""
    md = _LazyFields(reader)
    arch = md.get("general.architecture", "llama")
    if arch not in GGUF_ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(GGUF_ARCHS)})")
    hf_arch, bias, _ = GGUF_ARCHS[arch]

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some archs store one value per layer
        kv_heads = max(kv_heads)
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads

    vocab = get("vocab_size")
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is not None:
            vocab = int(emb.shape[-1])  # GGUF shapes are [ne0=hidden, ne1=vocab]
        else:
            vocab = len(md.get("tokenizer.ggml.tokens", []))

    rope_scaling = None
    stype = get("rope.scaling.type")
    if stype and stype != "none":
        rope_scaling = {"rope_type": stype, "factor": _f32(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    freq_factors = None if freqs is None else [float(x) for x in freqs.data.reshape(-1)]  # head_dim / 2 floats

    names = {t.name for t in reader.tensors}
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if md.get(key) is not None and int(md[key]) not in eos_ids:
            eos_ids.append(int(md[key]))
    bos = md.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=bias or "blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        architecture=hf_arch,
        qk_norm=hf_arch == "Qwen3ForCausalLM",
        rope_freq_factors=freq_factors,
    )
