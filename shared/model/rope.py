"""Rotary position embeddings, with the frequency-scaling variants Llama 3 and Qwen 2 (YaRN) use.

The cos/sin table is computed once in fp32 for every position; a step only indexes it. The rotation
itself is a kernel (kernels/layer_ops.py: LayerOps.rope_ and its torch reference, apply_rope)."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def _inv_freq_llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _inv_freq_yarn(base: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    orig = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast", 32.0), s.get("beta_slow", 1.0)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attn_factor


def rope_cos_sin(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_positions, head_dim // 2], fp32."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    attn_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        inv_freq = _inv_freq_llama3(inv_freq, s)
    elif kind == "yarn":
        inv_freq, attn_factor = _inv_freq_yarn(base, dim, s, cfg.max_position_embeddings)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3, yarn)")
    if cfg.rope_freq_factors is not None:  # a GGUF's rope_freqs: Llama 3's scaling as llama.cpp stores it
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos() * attn_factor, freqs.sin() * attn_factor
