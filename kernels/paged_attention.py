"""Paged KV cache operations, CPU reference.

The KV arena of one layer is a flat array of token slots, [num_slots, kv_heads, head_dim], with
slot = block_id * block_size + offset. Two operations touch it on the hot path:

- write_kv: store this step's new keys and values into their slots;
- attention: every query attends over its own sequence's slots, found through its block table.

A step's tokens are flattened: all decode tokens first (one per sequence), then the prefill
chunks. Decodes run as one padded batch; each prefill chunk runs on its own. The CUDA backend
implements the same functions over the same metadata; this file is its oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk inside the flattened step."""

    start: int  # index of its first token in the flattened batch
    length: int  # tokens in this chunk
    context_len: int  # tokens of context after this chunk (cached + chunk)
    slots: torch.Tensor | None  # [context_len] slot ids; None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] slot ids (padded)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] True where valid
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] written into k_cache/v_cache[slot_mapping]."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, q_heads, head_dim]; k, v: this step's new keys/values (already written).

    Returns [num_tokens, q_heads * head_dim]."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(n, hq * d, dtype=q.dtype)
    nd = meta.num_decodes
    if nd:
        # Grouped-query trick: the query heads sharing a KV head become the "query length" axis,
        # so no KV head is ever repeated.
        qd = q[:nd].view(nd, hkv, hq // hkv, d)
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [nd, hkv, T, d]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = o.reshape(nd, hq * d)
    for p in meta.prefills:
        qp = q[p.start:p.start + p.length].transpose(0, 1).unsqueeze(0)  # [1, hq, L, d]
        if p.slots is None:
            kp = k[p.start:p.start + p.length].transpose(0, 1).unsqueeze(0)
            vp = v[p.start:p.start + p.length].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kp = k_cache[p.slots].transpose(0, 1).unsqueeze(0)  # [1, hkv, T, d]
            vp = v_cache[p.slots].transpose(0, 1).unsqueeze(0)
            cached = p.context_len - p.length
            rows = torch.arange(p.length).unsqueeze(1) + cached
            mask = torch.arange(p.context_len).unsqueeze(0) <= rows  # causal with an offset
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
        out[p.start:p.start + p.length] = o[0].transpose(0, 1).reshape(p.length, hq * d)
    return out
