"""The shape and size of a KV arena, from a model's shape: what the engine allocates and what the
kv-pool creates for a node. Torch-free (the kv-pool on the CPU backend runs without torch), so a
dtype is its name here, or anything with an `itemsize` (a torch.dtype).

    arena: [layers, 2 (K and V), slots = blocks x block_size, kv_heads, row]

`row` is head_dim elements of the model's dtype, or, with `--kv-cache-dtype int8`, head_dim int8
values followed by the 4 bytes of their float32 scale (one scale per token and KV head,
kernels/paged_attention.py `quantize_kv`). The scale lives inside its slot, so everything that
moves a block's bytes (the swap tiers, the cross-node transfer, a handoff by block ids) moves the
scales with it, and every worker that maps the arena reads them.

A node has one arena per KV shape (services/kv_pool/arenas.py): models of the same layers, KV heads,
head dim and arena dtype share one, and `arena_key` names it in every message that carries block ids
(a block id means nothing without its arena).
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1}
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
INT8_SCALE_BYTES = 4  # the float32 scale at the end of an int8 arena's row


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name ("bfloat16") or a dtype object (torch.bfloat16)."""
    if isinstance(dtype, str):
        try:
            return DTYPE_BYTES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})") from None
    return dtype.itemsize


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def kv_arena_dtype(kv_cache_dtype: str, model_dtype) -> str:
    """The arena's element dtype name: the model's for "auto", "int8" for "int8"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})")
    return "int8" if kv_cache_dtype == "int8" else _name(model_dtype)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """A known KV cache dtype (every backend runs each: the CPU kernels and the CUDA ones, kernels/cuda/,
    read int8 rows alike); refused at start-up rather than at the arena's creation."""
    kv_arena_dtype(kv_cache_dtype, "float32")


def kv_row(cfg, dtype) -> int:
    """Elements of one (slot, KV head) row of an arena of `dtype`."""
    return cfg.head_dim + INT8_SCALE_BYTES if _name(dtype) == "int8" else cfg.head_dim


def kv_arena_shape(cfg, num_blocks: int, block_size: int, dtype="float32") -> list[int]:
    return [cfg.num_hidden_layers, 2, num_blocks * block_size, cfg.num_key_value_heads, kv_row(cfg, dtype)]


def kv_bytes_per_block(cfg, block_size: int, dtype) -> int:
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * kv_row(cfg, dtype) * dtype_bytes(dtype)


def arena_key(cfg, dtype) -> str:
    """The name of the arena that holds this model's KV in `dtype` (the arena's element dtype: the
    model's, or int8 for any model with --kv-cache-dtype int8): "<layers>x<kv heads>x<head dim>-<dtype>"."""
    return f"{cfg.num_hidden_layers}x{cfg.num_key_value_heads}x{cfg.head_dim}-{_name(dtype)}"
