"""Model hyper-parameters, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# Weight formats a model can be loaded in besides its dtype (--quantization; kernels/int8_linear.py).
Quantization = Literal["int8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
MAX_CONTEXT = 32768  # the longest context the engine takes from a model's config by default
# Hugging Face architectures that are this decoder (shared/model/llama.py); others are refused, not
# run wrong (Gemma's activation and scaled embedding, Phi-3's fused names, ...).
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts biases on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    sliding_window: int | None = None  # Mistral's (and Qwen2's when used): how far back attention reaches
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before RoPE
    # A GGUF's rope_freqs (how llama.cpp stores Llama 3's rope scaling): each frequency divided by its factor
    rope_freq_factors: list[float] | None = None

    @property
    def context_length(self) -> int:
        """The model's context as served (an engine's default max_model_len): its own, at most its
        sliding window (within which attention is full attention, all this decoder computes) and
        MAX_CONTEXT."""
        return min(self.max_position_embeddings, self.sliding_window or MAX_CONTEXT, MAX_CONTEXT)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in HF_ARCHITECTURES:
            raise ValueError(f"the model's architecture {arch} is not supported (supported: "
                             f"{', '.join(HF_ARCHITECTURES)})")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        window = d.get("sliding_window") if d.get("use_sliding_window", "Qwen" not in arch) else None
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # Transformers 5 moved theta and scaling into rope_parameters.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = dict(rp)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", "Qwen2" in arch),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            sliding_window=int(window) if window else None,
            qk_norm=arch == "Qwen3ForCausalLM",
        )
