"""A node's KV arenas: one per KV shape, and how the node's KV memory is divided between them.

Models whose KV has the same shape (layers x KV heads x head dim) and arena dtype share one arena
(its key: shared/kv_layout.py `arena_key`); a model of another shape gets its own. Block ids are
ids within one arena, so every message that carries them names the arena too (shared/schemas.py).

Sizes are planned from the manifest (at start, and again when a reload changes it), arenas made
when first asked for: an arena's memory is taken only when a worker of that shape asks for it (the
first model's arena at start, as before: the manifest's first model whose shape is known), so a
manifest's models that never run cost no KV memory, which matters most for GPU memory on the CUDA
backend. When the plan changes:
- an arena in shared memory (the CPU backend) is resized in place, in use or not (`resizes`): its
  file was made sparse with room for the whole budget, so growing only lets the ledger lease more
  ids; shrinking stops it leasing the ids beyond the new size, its workers give those back as they
  become free (services/worker/kv_blocks.py), and their pages leave the file (shm.punch);
- an arena on the GPU (one CUDA allocation every worker opened by its IPC handle) cannot change
  size: when the new plan wants its memory (it is bigger than its part while another shape gets
  less than its part, or made again it would be bigger) it is retired once nobody uses it and made
  again at its new size if it is asked for again (`retirable`);
- an arena of a shape no model has any more is retired once nobody uses it, on either backend.

The plan (`plan_budgets`): each model of the manifest gets a part of `--kv-cache-gb`: a model
with a `memory_quota_gb` its quota (its KV blocks never exceed it, shared/partitions.py), every
other model an equal part of what the quotas leave, and at least an equal part of the whole (all
parts scaled down together when they then add up to more than the budget). An arena gets the parts
of its models. What no planned arena takes (quotas smaller than the budget, models whose shape
could not be read at start: a known model name not pulled yet, a broken config) is the reserve: an
arena of a shape the plan did not know is made from what is left of it, and when nothing is left a
worker of that shape is refused with the reason. Without a manifest the
node's one arena gets the whole budget, as before. The host swap tier (`--swap-space`) is divided in
the same proportions: each arena has its own (its blocks' bytes are its shape's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from meshserve.shared.kv_layout import kv_arena_dtype
from meshserve.shared.schemas import KVShape

log = logging.getLogger("meshserve.kv_pool")

GB = 1 << 30


def model_parts(total: int, quotas: dict[str, float | None]) -> dict[str, int]:
    """Each model's bytes of the node's KV budget: its quota (GiB) if it has one, else an equal part
    of what the quotas leave but at least total / number of models; scaled to fit `total`."""
    if not quotas:
        return {}
    parts = {m: min(q * GB, total) for m, q in quotas.items() if q is not None}
    others = [m for m, q in quotas.items() if q is None]
    if others:
        each = max((total - sum(parts.values())) / len(others), total / len(quotas))
        parts.update(dict.fromkeys(others, each))
    scale = min(1.0, total / sum(parts.values())) if sum(parts.values()) else 1.0
    return {m: int(p * scale) for m, p in parts.items()}


@dataclass
class ArenaBudgets:
    """The node's KV bytes (and host swap tier bytes) per arena key, and what is left for the shapes
    the plan did not know. Pure bookkeeping: the plan can change (a manifest reload: `replan`), the
    arenas made cannot, but one nobody uses can be retired and made again (`retirable`)."""

    total: int
    swap: int = 0
    planned: dict[str, int] = field(default_factory=dict)  # arena key -> bytes
    made: dict[str, int] = field(default_factory=dict)  # arena key -> bytes it was made with
    complete: bool = True  # the plan knows every model's shape (an arena outside it serves no model of it)
    block: dict[str, int] = field(default_factory=dict)  # arena key -> its block's bytes (made ones)

    def _free(self) -> tuple[int, int]:
        """(bytes no arena was made with, of those the parts of the planned arenas not made yet)."""
        unmade = sum(n for k, n in self.planned.items() if k not in self.made)
        return self.total - sum(self.made.values()), unmade

    def for_arena(self, key: str) -> int:
        """The bytes a new arena of this key gets: its planned part (all such parts scaled down
        together when the arenas made leave less), or else the reserve left."""
        free, unmade = self._free()
        if key in self.planned and key not in self.made:
            return int(self.planned[key] * min(1.0, max(0, free) / unmade))
        return max(0, free - unmade)

    def swap_for(self, nbytes: int) -> int:
        """The host swap tier bytes of an arena of nbytes: the same share of --swap-space."""
        return self.swap * nbytes // self.total if self.total else 0

    def replan(self, planned: dict[str, int], complete: bool) -> None:
        """A new plan (the manifest changed); the arenas made keep their size until retired."""
        self.planned, self.complete = dict(planned), complete

    def _slack(self, k: str, n: int) -> int:
        """The difference in size not worth a change: 5% of n, and at least a block."""
        return max(self.block.get(k, 1), n // 20)

    def retirable(self, busy: set[str], resizable: set[str] = frozenset()) -> list[str]:
        """Made arenas, none of them `busy`, whose memory the plan wants elsewhere: one of a shape no
        model of the manifest has; and, unless it can be resized in place (`resizes`), one bigger than
        its part while a planned arena not made yet gets less than its part, or one that, made again,
        would get 5% (and a block) more than it has."""
        free, unmade = self._free()
        starved = unmade > free
        out = []
        for k, n in self.made.items():
            if k in busy:
                continue
            if k not in self.planned:
                if self.complete:
                    out.append(k)
                continue
            if k in resizable:
                continue
            block = self.block.get(k, 1)
            again = ArenaBudgets(self.total, planned=self.planned,
                                 made={j: m for j, m in self.made.items() if j != k}).for_arena(k) // block
            if (starved and n > self.planned[k] + block) or again >= max(n // block + 1, n // block * 1.05):
                out.append(k)
        return out

    def resizes(self, resizable: set[str]) -> dict[str, int]:
        """New sizes (bytes) for made arenas that can change size in place, in use or not: one bigger
        than its part by more than the slack shrinks to its part (the memory beyond goes back as its
        blocks are freed), one smaller grows toward its part from the memory that neither another
        arena made nor the part of a planned one not made yet takes."""
        out = {}
        for k in resizable & self.made.keys() & self.planned.keys():
            if self.made[k] > self.planned[k] + self._slack(k, self.planned[k]):
                out[k] = self.planned[k]
        free, unmade = self._free()
        room = free - unmade  # what a shrink gives back counts once its blocks are freed (`made` follows)
        for k in sorted(resizable & self.made.keys() & self.planned.keys() - out.keys()):
            want = self.planned[k] - self.made[k]
            if want > self._slack(k, self.planned[k]) and room > self._slack(k, self.planned[k]):
                out[k] = self.made[k] + min(want, room)
                room -= out[k] - self.made[k]
        return out

    def retire(self, key: str) -> None:
        self.made.pop(key, None)
        self.block.pop(key, None)

    def describe(self) -> dict:
        free, unmade = self._free()
        return {"total_bytes": self.total, "planned_bytes": dict(self.planned), "made_bytes": dict(self.made),
                "reserve_bytes": max(0, free - unmade)}


def plan_budgets(total: int, swap: int, models: list[tuple[str, str | None, float | None]]) -> ArenaBudgets:
    """models: (id, arena key or None when its shape is unknown, memory_quota_gb or None)."""
    parts = model_parts(total, {m: q for m, _, q in models})
    planned: dict[str, int] = {}
    for m, key, _ in models:
        if key is not None:
            planned[key] = planned.get(key, 0) + parts[m]
    return ArenaBudgets(total, swap, planned, complete=all(key is not None for _, key, _ in models))


def manifest_shapes(manifest, default_dtype: str,
                    kv_cache_dtype: str) -> list[tuple[str, KVShape | None, float | None]]:
    """(id, KV shape, memory_quota_gb) of each model of the manifest, its shape read from its config
    without its weights and without torch (models_repo.model_config); a model not on this machine yet
    (a known name not pulled) or whose config cannot be read has shape None."""
    from meshserve.shared.models_repo import model_config

    out, configs = [], {}
    for m in manifest.models:
        try:
            if m.path not in configs:
                configs[m.path] = model_config(m.path, download=False)
            cfg = configs[m.path]
            shape = KVShape(num_hidden_layers=cfg.num_hidden_layers, num_key_value_heads=cfg.num_key_value_heads,
                            head_dim=cfg.head_dim, dtype=kv_arena_dtype(m.kv_cache_dtype or kv_cache_dtype,
                                                                        m.dtype or default_dtype))
        except Exception as e:  # noqa: BLE001 - its arena comes from the reserve, if it ever runs
            log.warning("KV shape of model %s (%s) unknown at start: %s", m.id, m.path, e)
            shape = None
        out.append((m.id, shape, m.memory_quota_gb))
    return out
