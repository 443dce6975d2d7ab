"""Prefix-cache keys: what the engine caches KV blocks under and the mesh scheduler routes by.

A full block is keyed by a chained hash of (parent block's key, its tokens, the model), so a key
names the whole prefix up to that block. Pure functions, no torch and no engine: the scheduler
(a process that does no tensor math) computes the same keys as the workers.
"""

from __future__ import annotations

import hashlib

import numpy as np


def namespace(model: str, lora_key: str | None = None, cache_salt: str | None = None) -> str:
    """What keys are salted with: the model, a LoRA adapter's identity when the request has one
    (an adapter changes every layer's K and V, so its blocks are not the base model's), and the
    request's cache_salt (vLLM's: only requests with the same salt share cached blocks, so one
    tenant cannot learn from timing what another's prompts were)."""
    ns = model if lora_key is None else f"{model}+lora:{lora_key}"
    return ns if cache_salt is None else f"{ns}+salt:{cache_salt}"


def block_hash(parent: int | None, tokens: list[int], model: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(model.encode())
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(tokens: list[int], block_size: int, model: str) -> list[int]:
    """The chained keys of a prompt's full blocks (what a router compares with workers' caches)."""
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        out.append(block_hash(out[-1] if out else None, tokens[i * block_size:(i + 1) * block_size], model))
    return out
