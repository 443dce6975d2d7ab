"""A Llama-family decoder written for serving.

One step runs one flattened batch of tokens from many sequences (no padding). Projections are
fused (q|k|v and gate|up) so a layer is a handful of large matrix products: on a CPU the number
of tensor operations per step, not the FLOPs, bounds small-batch decode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshserve.kernels.fused_decode import FusedDecode
from meshserve.kernels.layer_ops import LayerOps
from meshserve.kernels.int8_linear import quantize_weights
from meshserve.kernels.linear import block_weights, projection
from meshserve.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv

from .config import QUANTIZATIONS, ModelConfig
from .layer_gate import LayerGate
from .lora import LoRABatch
from .rope import rope_cos_sin


def fuse_hf_weights(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                    device: str | torch.device = "cpu", quantization: str | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face names -> this model's names, with q|k|v and gate|up fused, in `dtype`; for a
    CPU, the projections in the blocked layout of kernels/cpu/linear.cpp where it applies.
    quantization "int8": the projections (and a tied embedding, which is also the lm_head) as int8
    weights with per-channel scales (kernels/int8_linear.py), quantized from the source's precision.

    The result is the model's whole state: the model loader writes it into shared memory as is."""
    return {k: v for part in fused_parts(cfg, sd, dtype, device, quantization) for k, v in part.items()}


def fused_parts(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device = "cpu", quantization: str | None = None):
    """`fuse_hf_weights` one part at a time, each made when asked for: first the tensors outside the
    layers (embedding, norm, lm_head), then layer 0, 1, ... (the loader writes a layered load in
    this order, shared/model/layer_gate.py). Every conversion is per tensor, so the parts together
    are exactly the whole."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r} (one of {', '.join(QUANTIZATIONS)})")
    # Fused in the source's precision when quantizing (each tensor is cast or quantized at the end).
    t = (lambda x: x.contiguous()) if quantization else (lambda x: x.to(dtype).contiguous())  # noqa: E731
    names = set(projection_names(cfg))

    def finish(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mine = [n for n in w if n in names]
        if quantization == "int8":  # a tied embedding is looked up from the int8 head: one copy
            return quantize_weights(w, mine, dtype, device)
        if torch.device(device).type == "cpu":
            return block_weights(w, mine, keep={"embed"})  # the embedding is also read by row
        return w

    w = {"embed": t(sd["model.embed_tokens.weight"]), "norm": t(sd["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = t(sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
    yield finish(w)
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        fused = {"qkv": [a + f"{x}_proj" for x in "qkv"], "o": [a + "o_proj"],
                 "gate_up": [p + "mlp.gate_proj", p + "mlp.up_proj"], "down": [p + "mlp.down_proj"]}
        w = {}
        for name, parts in fused.items():
            weights = [sd[x + ".weight"] for x in parts]
            w[f"layers.{i}.{name}"] = t(torch.cat(weights) if len(parts) > 1 else weights[0])
            # Qwen2 biases q|k|v; a Llama with attention_bias also o, and with mlp_bias the MLP's three
            if any(x + ".bias" in sd for x in parts):
                w[f"layers.{i}.{name}_bias"] = t(torch.cat([
                    sd[x + ".bias"] if x + ".bias" in sd else weights[k].new_zeros(weights[k].shape[0])
                    for k, x in enumerate(parts)]))
        if cfg.qk_norm:
            w[f"layers.{i}.q_norm"], w[f"layers.{i}.k_norm"] = t(sd[a + "q_norm.weight"]), t(sd[a + "k_norm.weight"])
        w[f"layers.{i}.attn_norm"] = t(sd[p + "input_layernorm.weight"])
        w[f"layers.{i}.mlp_norm"] = t(sd[p + "post_attention_layernorm.weight"])
        yield finish(w)


def projection_names(cfg: ModelConfig) -> list[str]:
    per_layer = [f"layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in ("qkv", "o", "gate_up", "down")]
    return per_layer + ["embed" if cfg.tie_word_embeddings else "lm_head"]


class Interrupted(Exception):
    """A forward pass ended early at its caller's request (the layer it stopped before)."""


class LlamaModel:
    """Holds references to its weights, never copies: they may live in memory other processes map.
    With a `gate` (layered loading, layer_gate.py) the weights are still being written: each part is
    waited for before it is read, until the gate is done and dropped."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int | None = None,
                 gate: LayerGate | None = None):
        self.cfg, self.weights, self.gate = cfg, weights, gate
        self.dtype = weights["norm"].dtype
        self.norm = weights["norm"]
        L = range(cfg.num_hidden_layers)
        self.attn_norm = [weights[f"layers.{i}.attn_norm"] for i in L]
        self.mlp_norm = [weights[f"layers.{i}.mlp_norm"] for i in L]
        self.qk_norm = [(weights[f"layers.{i}.q_norm"], weights[f"layers.{i}.k_norm"]) for i in L] if cfg.qk_norm \
            else None  # Qwen3's RMSNorm over each q and k head
        self.proj = [{name: projection(weights, f"layers.{i}.{name}", f"layers.{i}.{name}_bias")
                      for name in ("qkv", "o", "gate_up", "down")} for i in L]
        self.head = projection(weights, "embed" if cfg.tie_word_embeddings else "lm_head")
        self.embed = weights.get("embed")  # None: a tied int8 embedding, looked up through the head
        cos, sin = rope_cos_sin(cfg, max_positions or cfg.max_position_embeddings)
        self.device = self.norm.device  # the weights' device; rope tables and the KV arena go there too
        self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)
        self.scale = cfg.head_dim ** -0.5
        self.ops = LayerOps(self.dtype, self.device, cfg.rms_norm_eps)
        # Decode-only steps of a bf16 model with int8 or blocked bf16 weights on the CPU: the layers in one call
        # (kernels/fused_decode.py), bit for bit the per-operation forward below; None elsewhere,
        # and until a layered load is complete (it reads the q|k|v biases when it is built).
        self.fused = self._fused_decode() if gate is None else None

    def _fused_decode(self) -> FusedDecode | None:
        cfg = self.cfg
        return FusedDecode.build(self.proj, self.attn_norm, self.mlp_norm, self.norm, self.cos, self.sin,
                                 cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
                                 self.scale, [w for pair in self.qk_norm or () for w in pair])

    @classmethod
    def from_hf(cls, cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", quantization: str | None = None) -> "LlamaModel":
        weights = fuse_hf_weights(cfg, sd, dtype, device, quantization)
        if torch.device(device).type != "cpu":
            weights = {name: w.to(device) for name, w in weights.items()}
        return cls(cfg, weights)

    def _project(self, i: int, name: str, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """Layer i's projection `name` of x, plus each row's LoRA adapter when the batch has any."""
        y = self.proj[i][name](x)
        return y if lora is None else lora.apply(y, x, i, name)

    def fused_decode_rows(self, rows: int) -> int | None:
        """The most rows a decode-only step of `rows` rows may grow to (verifying proposals) and still
        run fused on the same tiles, so with the same bits per row (0: a step of `rows` rows does not
        run fused; None: no step does)."""
        return self.fused.plan_rows(rows) if self.fused is not None else None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor, lora: LoRABatch | None = None,
                 stop: Callable[[int], bool] | None = None) -> torch.Tensor:
        """input_ids, positions: [N]. kv_cache: [layers, 2, num_slots, kv_heads, head_dim].
        lora: which rows run which adapter (shared/model/lora.py); None: the base model alone.
        stop(i), asked before layer i: True ends the pass there (Interrupted); the KV it wrote is
        past every sequence's computed tokens, so nothing reads it before it is written again. A
        fused decode step (self.fused: decodes only, one C++ call of 10-20 ms) is not asked.
        Returns the final hidden states [N, hidden]."""
        cfg, ops, gate = self.cfg, self.ops, self.gate
        n, hq, hkv, d = input_ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if gate is not None:  # part 0 and layer 0 (whose input norm comes first)
            gate.wait(1)
        # the residual stream, updated in place
        x = F.embedding(input_ids, self.embed) if self.embed is not None else self.head.rows(input_ids, self.dtype)
        if self.fused is not None and lora is None and gate is None and self.fused.applies(n, meta, kv_cache):
            return self.fused(x, positions, meta, kv_cache)
        h = ops.rms_norm(x, self.attn_norm[0])
        next_norm = self.attn_norm[1:] + [self.norm]
        for i in range(len(self.proj)):
            if gate is not None:  # layer i ends with the next layer's input norm
                gate.wait(min(i + 2, cfg.num_hidden_layers))
            if stop is not None and stop(i):
                raise Interrupted(i)
            qkv = self._project(i, "qkv", h, lora)
            if self.qk_norm is not None:
                for (lo, hi), w in zip(((0, hq), (hq, hq + hkv)), self.qk_norm[i]):
                    qkv[:, lo * d:hi * d] = ops.rms_norm(qkv[:, lo * d:hi * d].reshape(-1, d), w).view(n, -1)
            ops.rope_(qkv, positions, self.cos, self.sin, hq + hkv, d)
            q = qkv[:, :hq * d].view(n, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
            write_kv(kv_cache[i], k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, kv_cache[i], meta, self.scale)
            h = ops.add_rms_norm_(self._project(i, "o", attn, lora), x, self.mlp_norm[i])
            g = ops.silu_mul(self._project(i, "gate_up", h, lora))
            h = ops.add_rms_norm_(self._project(i, "down", g, lora), x, next_norm[i])
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.gate.wait(self.cfg.num_hidden_layers + 1)
            if self.gate.done:  # fully loaded: no more checks
                self.gate = None
                self.fused = self._fused_decode()
        return self.head(hidden).float()
