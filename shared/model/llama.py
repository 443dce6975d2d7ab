"""A Llama-family decoder written for serving.

One step runs one flattened batch of tokens from many sequences (no padding). Projections are
fused (q|k|v and gate|up) so a layer is a handful of large matrix products: on a CPU the number
of tensor operations per step, not the FLOPs, bounds small-batch decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.kernels.linear import Linear
from meshserve.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv

from .config import ModelConfig
from .rope import apply_rope, rope_cos_sin


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int | None = None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        h, L = cfg.hidden_size, cfg.num_hidden_layers
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        e = lambda *s: nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.embed = e(cfg.vocab_size, h)
        self.qkv = nn.ParameterList([e(qkv, h) for _ in range(L)])
        self.qkv_bias = nn.ParameterList([e(qkv) for _ in range(L)]) if cfg.attention_bias else None
        self.o = nn.ParameterList([e(h, cfg.num_attention_heads * cfg.head_dim) for _ in range(L)])
        self.gate_up = nn.ParameterList([e(2 * cfg.intermediate_size, h) for _ in range(L)])
        self.down = nn.ParameterList([e(h, cfg.intermediate_size) for _ in range(L)])
        self.attn_norm = nn.ParameterList([e(h) for _ in range(L)])
        self.mlp_norm = nn.ParameterList([e(h) for _ in range(L)])
        self.norm = e(h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else e(cfg.vocab_size, h)
        cos, sin = rope_cos_sin(cfg, max_positions or cfg.max_position_embeddings)
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self.scale = cfg.head_dim ** -0.5

    @torch.no_grad()
    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Takes Hugging Face names; fuses q|k|v and gate|up."""
        cp = lambda dst, src: dst.copy_(src.to(self.dtype))  # noqa: E731
        cp(self.embed, sd["model.embed_tokens.weight"])
        cp(self.norm, sd["model.norm.weight"])
        if not self.cfg.tie_word_embeddings:
            cp(self.lm_head, sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
        for i in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            cp(self.qkv[i], torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"]))
            if self.qkv_bias is not None:
                cp(self.qkv_bias[i], torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"]))
            cp(self.o[i], sd[a + "o_proj.weight"])
            cp(self.gate_up[i], torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            cp(self.down[i], sd[p + "mlp.down_proj.weight"])
            cp(self.attn_norm[i], sd[p + "input_layernorm.weight"])
            cp(self.mlp_norm[i], sd[p + "post_attention_layernorm.weight"])
        self.prepare()

    def prepare(self, pack: bool = True) -> None:
        """Builds the per-layer projections the forward pass calls (packing them if worthwhile)."""
        L = self.cfg.num_hidden_layers
        bias = (lambda i: self.qkv_bias[i]) if self.qkv_bias is not None else (lambda i: None)  # noqa: E731
        self.proj = [dict(qkv=Linear(self.qkv[i], bias(i), pack), o=Linear(self.o[i], None, pack),
                          gate_up=Linear(self.gate_up[i], None, pack), down=Linear(self.down[i], None, pack))
                     for i in range(L)]
        self.head = Linear(self.lm_head, None, pack)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [N]. kv_cache: [layers, 2, num_slots, kv_heads, head_dim].
        Returns the final hidden states [N, hidden]."""
        cfg = self.cfg
        n, hq, hkv, d = input_ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        attn_norm, mlp_norm = list(self.attn_norm), list(self.mlp_norm)
        for i, proj in enumerate(self.proj):
            h = self._rms(x, attn_norm[i])
            qkv = proj["qkv"](h)
            qk = apply_rope(qkv[:, :(hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            x = x + proj["o"](attn)
            h = self._rms(x, mlp_norm[i])
            gate, up = proj["gate_up"](h).chunk(2, dim=-1)
            x = x + proj["down"](F.silu(gate) * up)
        return self._rms(x, self.norm)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
