"""LoRA adapters as the engine applies them: the one place adapter math happens.

A projection with an adapter computes W x + s B A x. The base part is the shared projection
(one copy of the base weights for every request); `LoRABatch.apply` adds each row's own
s B (A x), grouped by adapter, so rows of different adapters (and of the base alone) run in one
step. llama.py fuses q|k|v and gate|up; an adapter's matrices for a fused projection are fused the
same way, along the output: A of its modules stacked along the rank ([sum r, in]), B placed
block-diagonally ([out of the fused projection, sum r], rows of modules it does not target zero),
with the scaling folded into B. That is exactly each module's own s B_m A_m x in its output
slice, so this is its own reference: the oracle is the merged weight W + s B A (tests/test_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora import FUSED, AdapterSpec, check_adapter, module_shape, read_adapter
from .config import ModelConfig


@dataclass
class LoRAWeights:
    """One adapter, per layer: fused projection name -> (A [R, in], B [out, R]) in the model's dtype."""

    name: str
    key: str  # AdapterSpec.key: what the prefix cache salts this adapter's blocks with
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    spec: AdapterSpec | None = None

    @classmethod
    def load(cls, name: str, path: str, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
             base_names: tuple[str, ...] = ()) -> "LoRAWeights":
        """Reads and checks (shared/lora.py) the adapter at `path` for a base model of `cfg`; raises LoRAError."""
        from safetensors.torch import load_file

        spec = read_adapter(path)
        check_adapter(spec, cfg, base_names)
        sd = load_file(str(spec.weights_file))
        mats: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for tname, (layer, module, ab, _, _) in spec.tensors.items():
            mats.setdefault((layer, module), {})[ab] = sd[tname].to(torch.float32)
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_hidden_layers)]
        for i in range(cfg.num_hidden_layers):
            for fused, modules in FUSED.items():
                present = [m for m in modules if (i, m) in mats]
                if not present:
                    continue
                outs = [module_shape(cfg, m)[1] for m in modules]
                a = torch.cat([mats[(i, m)]["A"] for m in present])
                b = torch.zeros(sum(outs), a.shape[0])
                rank = 0
                for m in present:
                    o = sum(outs[:modules.index(m)])
                    bm = mats[(i, m)]["B"]
                    b[o:o + bm.shape[0], rank:rank + bm.shape[1]] = bm * spec.scaling
                    rank += bm.shape[1]
                layers[i][fused] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
        return cls(name, spec.key, layers, spec)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for ab in layer.values() for t in ab)


class LoRABatch:
    """Which rows of a step's flattened batch run which adapter (rows of no adapter: none)."""

    def __init__(self, groups: list[tuple[LoRAWeights, slice | torch.Tensor]]):
        self.groups = groups

    @classmethod
    def of(cls, spans: list[tuple[LoRAWeights | None, int]], device: torch.device) -> "LoRABatch | None":
        """spans: each sequence's adapter (or None) and its number of rows, in batch order; None when
        no row has an adapter (the model then runs as without adapters)."""
        ranges: dict[int, tuple[LoRAWeights, list[tuple[int, int]]]] = {}
        start = 0
        for w, n in spans:
            if w is not None:
                ranges.setdefault(id(w), (w, []))[1].append((start, n))
            start += n
        if not ranges:
            return None
        groups = []
        for w, rs in ranges.values():
            if len(rs) == 1:
                groups.append((w, slice(rs[0][0], rs[0][0] + rs[0][1])))
            else:
                groups.append((w, torch.cat([torch.arange(s, s + n) for s, n in rs]).to(device)))
        return cls(groups)

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """y (the base projection of x, [rows, out]) plus each adapter's s B A x on its rows, in place."""
        x = x.reshape(x.shape[0], -1)
        for w, rows in self.groups:
            ab = w.layers[layer].get(proj)
            if ab is None:
                continue
            a, b = ab
            delta = (x[rows] @ a.T) @ b.T
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y
