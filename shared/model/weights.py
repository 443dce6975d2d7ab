"""Weight loading: Hugging Face safetensors directories and GGUF files.

Both loaders return ``(ModelConfig, state_dict)`` where the state dict uses the
Hugging Face Llama parameter names and shapes (``[out, in]`` for linear layers).
Keeping a single naming scheme means the model code (``llama.py``) has exactly
one ``load_weights`` path, whatever file format the weights came from.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .gguf_meta import GGUF_ARCHS as _GGUF_ARCHS, field_value as _field_value, gguf_config, gguf_metadata

log = logging.getLogger(__name__)

__all__ = ["load_hf_dir", "load_gguf", "gguf_config", "gguf_metadata", "unpermute_qk"]


# --------------------------------------------------------------------------- HF


def load_hf_dir(path: str | Path, lazy: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every *.safetensors file of a Hugging Face model directory.

    Tensors keep their stored names and dtypes (no renaming, no casting), so a
    round trip through ``save_pretrained`` is exact.  ``eos_token_ids`` is the
    union of config.json's and generation_config.json's, because chat models
    often list their end-of-turn token only in the latter.
    """
    from safetensors.torch import load_file

    path = Path(path)
    with open(path / "config.json", encoding="utf-8") as f:
        cfg_dict = json.load(f)
    cfg = ModelConfig.from_hf_dict(cfg_dict)

    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        with open(gen_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        cfg.eos_token_ids = _union(cfg.eos_token_ids, extra)

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    if lazy:
        return cfg, LazyTensors(files)
    sd: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file))
        dup = sd.keys() & part.keys()
        if dup:
            raise ValueError(f"tensor(s) {sorted(dup)[:3]} appear in more than one file in {path}")
        sd.update(part)
    return cfg, sd


class LazyTensors(Mapping):
    """The tensors of safetensors files, each read when asked for: the model-loader's layered load
    reads a layer's tensors as it writes that layer (load_hf_dir(..., lazy=True))."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._where = {}
        for file in files:
            f = safe_open(str(file), framework="pt")
            for k in f.keys():
                if k in self._where:
                    raise ValueError(f"tensor {k!r} appears in more than one file in {file.parent}")
                self._where[k] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __contains__(self, name) -> bool:  # without reading the tensor (Mapping's would)
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _union(a: list[int], b: list[int]) -> list[int]:
    out = list(a)
    for x in b:
        if x not in out:
            out.append(int(x))
    return out


# ------------------------------------------------------------------------- GGUF
# The config from the metadata (gguf_config) is in gguf_meta.py, without torch.

# GGUF per-layer tensor name -> HF per-layer name (both without the ".weight"/".bias" suffix)
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp writes that have no Hugging Face parameter; skipped quietly (gguf_config reads
# rope_freqs into the config's rope_freq_factors). Any other unknown tensor gets a warning.
_GGUF_SKIP = {"rope_freqs"}


def unpermute_qk(w: torch.Tensor | np.ndarray, n_head: int):
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows.

    HF Llama uses the "rotate_half" RoPE layout (first half of each head pairs
    with the second half); llama.cpp uses interleaved pairs, so its converter
    reorders each head's rows as ``reshape(n_head, 2, d/2).swapaxes(1, 2)``.
    The inverse views the rows as ``(n_head, d/2, 2)`` and swaps back.  For k,
    ``n_head`` is the number of KV heads.  Works on weights ([out, in]) and biases ([out]).
    """
    shape = w.shape
    half = shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        hf = _GGUF_LAYER_NAMES.get(kind)
        return None if hf is None else f"model.layers.{int(layer)}.{hf}.{suffix}"
    hf = _GGUF_GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def _dequantize(t: Any) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 in HF shape (GGUF shapes are reversed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    hf_shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type == GGMLQuantizationType.F32:
        arr = np.array(t.data, dtype=np.float32, copy=True)  # data is a read-only memmap
    else:
        # A plain view of the memmap: gguf slices it per group of rows, and each slice of a memmap
        # pays numpy's memmap bookkeeping (a quarter of the time).
        arr = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
    return arr.reshape(hf_shape)


def load_gguf(path: str | Path, reader: Any = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a llama/qwen2 GGUF file into float32 tensors with Hugging Face names and shapes.

    Quantized tensors are dequantized with ``gguf.quants.dequantize``.  For the
    llama architecture, q/k rows are un-permuted (see ``unpermute_qk``) so the
    result matches what Transformers produces from the original checkpoint.
    ``reader`` may be an already-open ``gguf.GGUFReader`` for the same file.
    """
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    cfg = gguf_config(reader)
    arch = _field_value(reader.fields["general.architecture"]) if "general.architecture" in reader.fields else "llama"
    permuted = _GGUF_ARCHS[arch][2]

    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            if t.name.split(".")[0] not in _GGUF_SKIP:
                log.warning("skipping GGUF tensor %s (no Hugging Face Llama equivalent)", t.name)
            continue
        arr = _dequantize(t)
        if permuted and ".self_attn.q_proj." in name:
            arr = unpermute_qk(arr, cfg.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            arr = unpermute_qk(arr, cfg.num_key_value_heads)
        sd[name] = torch.from_numpy(np.ascontiguousarray(arr))
    return cfg, sd
