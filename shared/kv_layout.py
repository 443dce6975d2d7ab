"""The shape and size of a KV arena, from a model's shape: what the engine allocates and what the
kv-pool creates for a node. Torch-free (the kv-pool on the CPU backend runs without torch), so a
dtype is its name here, or anything with an `itemsize` (a torch.dtype).

    arena: [layers, 2 (K and V), slots = blocks x block_size, kv_heads, head_dim]
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name ("bfloat16") or a dtype object (torch.bfloat16)."""
    if isinstance(dtype, str):
        try:
            return DTYPE_BYTES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})") from None
    return dtype.itemsize


def kv_arena_shape(cfg, num_blocks: int, block_size: int) -> list[int]:
    return [cfg.num_hidden_layers, 2, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim]


def kv_bytes_per_block(cfg, block_size: int, dtype) -> int:
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes(dtype)
