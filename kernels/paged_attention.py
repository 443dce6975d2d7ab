"""Paged KV cache operations, CPU reference.

The KV arena of one layer is a flat array of token slots, [num_slots, kv_heads, head_dim], with
slot = block_id * block_size + offset. Two operations touch it on the hot path:

- write_kv: store this step's new keys and values into their slots;
- attention: every query attends over its own sequence's slots, found through its block table.

A step's tokens are flattened: all decode tokens first (one per sequence), then the prefill
chunks. Decodes run as one padded batch; each prefill chunk runs on its own. The CUDA backend
implements the same functions over the same metadata; this file is its oracle.

On the CPU the decodes go to a compiled kernel (kernels/cpu/paged_attention.cpp) that reads keys
and values straight from the arena through the block tables, and, in a bf16 model on a CPU with
AVX-512 BF16, each prefill chunk to another (kernels/cpu/prefill_attention.h: 3-4x torch's SDPA on
SmolLM2's chunks) that reads them through the chunk's slot ids; the gather + SDPA below stays as
their oracle (`prefill_reference` for the chunks) and as the fallback when they cannot be built or
MESHSERVE_DISABLE_CPU_KERNELS=1. On a CUDA arena, write_kv and the decodes go to the CuPy kernels
of kernels/cuda_ops.py (same call; an int8 arena too), prefill chunks run the torch code below on
the GPU, and the torch path is again the fallback (no CuPy, MESHSERVE_DISABLE_CUDA_KERNELS=1).

An int8 arena (`--kv-cache-dtype int8`, shared/kv_layout.py) holds each (slot, KV head) row as
head_dim int8 values and their float32 scale in the row's last 4 bytes: `write_kv` quantizes
(`quantize_kv`: symmetric, scale = max|row| / 127, per token and head), and every read
dequantizes (`dequantize_kv` here; the CPU decode kernel in its registers, and for a prefill
chunk's SDPA the CPU kernel's `dequantize_slots`, in one pass over the gathered rows). Per token rather than per
block: a block fills one token at a time, and a block-wide scale would have to be fixed before
its later tokens are known (or the block requantized as they come); a token's own scale costs 4
bytes per head (6% at head_dim 64) and makes a row's bytes depend on that row alone, so prefill
chunking, prefix-cache hits and batches never change what is stored. A prefill chunk with no
cached context also reads its keys and values back from the arena, so every token attends over
exactly the quantized cache, however the prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_build, cuda_ops


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk inside the flattened step."""

    start: int  # index of its first token in the flattened batch
    length: int  # tokens in this chunk
    context_len: int  # tokens of context after this chunk (cached + chunk)
    slots: torch.Tensor | None  # [context_len] slot ids; None when the chunk is the whole context
    mask: torch.Tensor | None = None  # [length, context_len] additive causal mask, made by the first layer

    def causal_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Row i sees the cached context and the chunk up to itself. Built once per step (every
        layer shares it) and additive in the queries' dtype, so attention does not convert it."""
        if self.mask is None:
            cached = self.context_len - self.length
            rows = torch.arange(self.length, device=device).unsqueeze(1) + cached
            hidden = torch.arange(self.context_len, device=device).unsqueeze(0) > rows
            self.mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        return self.mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] slot ids (padded)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] True where valid
    # For the compiled decode kernel (decode_slots/decode_mask are then not built):
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64 (padded, valid ids)
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64, context incl. the new token
    # Some sequence has several decode rows (a proposal verified as consecutive decodes): each row's
    # K/V must be in the arena before any row attends (the per-operation path writes all first).
    verify_rows: bool = False
    block_size: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)


def decode_kernel(kv: torch.Tensor):
    """The compiled decode kernel (the CPU module, or cuda_ops on a CUDA arena) when decodes over this
    arena run it, else None (the gather + SDPA reference, which needs decode_slots/decode_mask)."""
    if cuda_ops.handles(kv):
        return cuda_ops if cuda_ops.decode_supported(cuda_ops.head_dim_of(kv), kv.dtype) else None
    if kv.device.type != "cpu" or kv.dtype not in (torch.float32, torch.bfloat16, torch.int8) or not kv.is_contiguous():
        return None
    return cpu_build.load("meshserve_paged_attention_cpu", "paged_attention.cpp")


def prefill_kernel(kv: torch.Tensor, q: torch.Tensor):
    """The compiled prefill kernel (CPU, AVX-512 BF16) when this step's prompt chunks run it: bf16
    queries over a bf16 or int8 arena, head_dim 32/64/128. Else None: the gather + SDPA below, its
    oracle (and the only path for float32 models, so the fp32 oracle tests never meet it)."""
    if (q.dtype != torch.bfloat16 or kv.device.type != "cpu" or kv.dtype not in (torch.bfloat16, torch.int8)
            or q.shape[-1] not in (32, 64, 128) or not kv.is_contiguous()):
        return None
    mod = cpu_build.load("meshserve_paged_attention_cpu", "paged_attention.cpp")
    return mod if mod is not None and mod.prefill_available() else None


def use_decode_kernel(kv: torch.Tensor) -> bool:
    return decode_kernel(kv) is not None


def decode_slots_and_mask(block_tables: torch.Tensor, context_lens: torch.Tensor,
                          block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path's padded slot ids [nd, T] and validity mask [nd, 1, 1, T] from block tables."""
    nd, t = block_tables.shape[0], int(context_lens.max())
    pos = torch.arange(t, device=block_tables.device)
    slots = torch.gather(block_tables, 1, (pos // block_size).expand(nd, t)) * block_size + pos % block_size
    return slots, (pos.unsqueeze(0) < context_lens.unsqueeze(1)).view(nd, 1, 1, t)


SCALE_BYTES = 4  # an int8 row's float32 scale (shared/kv_layout.py INT8_SCALE_BYTES)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> int8 rows [..., head_dim + 4]: round(x / s) and s = max|x| / 127 (float32,
    its bytes appended). An all-zero row gets s = 0."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xf / torch.where(s > 0, s, 1)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, s.view(torch.int8)], -1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] -> [..., head_dim] in `dtype` (computed in float32)."""
    s = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * s).to(dtype)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv: one layer's arena [2, num_slots, kv_heads, row]; k, v: [num_tokens, kv_heads, head_dim]."""
    if cuda_ops.handles(kv):
        cuda_ops.write_kv(kv, k, v, slot_mapping)
        return
    if kv.dtype == torch.int8:
        kernel = decode_kernel(kv)
        if kernel is not None and k.dtype in (torch.float32, torch.bfloat16):
            kernel.write_kv_int8(kv, k, v, slot_mapping)  # quantize_kv's rows, in one pass
            return
        k, v = quantize_kv(k), quantize_kv(v)
    kv[0].index_copy_(0, slot_mapping, k)
    kv[1].index_copy_(0, slot_mapping, v)


def _read(kv: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K and V of `slots` [T], [2, T, kv_heads, head_dim] in `dtype`."""
    if kv.dtype != torch.int8:
        return kv.index_select(1, slots)
    kernel = decode_kernel(kv) if kv.device.type == "cpu" and not cuda_ops.handles(kv) else None
    if kernel is not None and dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(2, slots.shape[0], kv.shape[2], kv.shape[3] - SCALE_BYTES, dtype=dtype)
        kernel.dequantize_slots(out, kv, slots)  # dequantize_kv of the gathered rows, in one pass
        return out
    return dequantize_kv(kv.index_select(1, slots), dtype)


def prefill_reference(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv: torch.Tensor,
                      p: PrefillChunk, slot_mapping: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt chunk's causal attention, gather + SDPA: q [L, q_heads, head_dim], the chunk's own
    new keys/values (used when it has no cached context and the arena holds them exactly) and their
    slots; [L, q_heads * head_dim]. The oracle of the compiled prefill kernel."""
    length, hq, d = q.shape
    qp = q.transpose(0, 1).unsqueeze(0)  # [1, hq, L, d]
    slots = p.slots
    if slots is None and kv.dtype == torch.int8:  # attend over what the cache holds, as later chunks will
        slots = slot_mapping
    if slots is None:
        kp, vp = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # index_select copies whole [kv_heads, head_dim] rows; indexing (kv[:, slots]) goes
        # element by element and was a tenth of a mixed workload's time.
        kvp = _read(kv, slots, q.dtype).transpose(1, 2).unsqueeze(1)  # [2, 1, hkv, T, d]
        o = F.scaled_dot_product_attention(qp, kvp[0], kvp[1], attn_mask=p.causal_mask(q.dtype, q.device),
                                           scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(length, hq * d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, q_heads, head_dim]; k, v: this step's new keys/values (already written to kv).

    Returns [num_tokens, q_heads * head_dim]."""
    n, hq, d = q.shape
    hkv = kv.shape[2]
    nd = meta.num_decodes
    kernel = decode_kernel(kv) if nd and meta.decode_block_tables is not None else None
    if kernel is not None:
        # Reads K/V through the block tables; q may be a strided view (rows of the fused qkv).
        out = torch.empty(n, hq * d, dtype=q.dtype, device=q.device)
        qd = q[:nd] if q.stride(2) == 1 else q[:nd].contiguous()
        kernel.paged_decode_attention(
            out[:nd].view(nd, hq, d), qd, kv, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, scale)
        if nd == n:
            return out
    elif nd:
        slots, mask = meta.decode_slots, meta.decode_mask
        if slots is None:  # metadata made for the kernel
            slots, mask = decode_slots_and_mask(meta.decode_block_tables, meta.decode_context_lens,
                                                meta.block_size)
        # Grouped-query trick: the query heads sharing a KV head become the "query length" axis,
        # so no KV head is ever repeated. Keys and values come out of the arena in one gather.
        qd = q[:nd].view(nd, hkv, hq // hkv, d)
        kvd = _read(kv, slots.flatten(), q.dtype).view(2, *slots.shape, hkv, d).transpose(2, 3)  # [2, nd, hkv, T, d]
        o = F.scaled_dot_product_attention(qd, kvd[0], kvd[1], attn_mask=mask, scale=scale)
        if nd == n:
            return o.reshape(nd, hq * d)
        out = torch.empty(n, hq * d, dtype=q.dtype, device=q.device)
        out[:nd] = o.reshape(nd, hq * d)
    else:
        out = torch.empty(n, hq * d, dtype=q.dtype, device=q.device)
    pk = prefill_kernel(kv, q) if meta.prefills else None
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.length)
        if pk is not None:  # reads the context (the chunk's own keys included) out of the arena
            slots = p.slots if p.slots is not None else meta.slot_mapping[rows]
            pk.paged_prefill_attention(out[rows].view(p.length, hq, d), q[rows], kv, slots, scale)
        else:
            out[rows] = prefill_reference(q[rows], k[rows] if k is not None else None,
                                          v[rows] if v is not None else None, kv, p, meta.slot_mapping[rows], scale)
    return out
